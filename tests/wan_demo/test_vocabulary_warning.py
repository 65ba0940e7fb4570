"""``omniloop generate`` warns ONCE (one stderr line) when the prompt uses words outside the
checkpoint's declared ``omniloop.json`` ``"vocabulary"`` — a general mechanism
(cli/omniloop_cli/vocabulary.py), shown here on the core's toy checkpoint carrying the wan-demo
video vocabulary (``omniloop_wan_demo.prompts.vocabulary_words``)."""

import json

from click.testing import CliRunner

from omniloop.testing import make_manager
from omniloop_cli import cli
from omniloop_cli.vocabulary import declared_vocabulary, prompt_words, unknown_words, vocabulary_warning
from omniloop_wan_demo.prompts import vocabulary_words


def _gen(ckpt, prompt, tmp_path):
    args = ["generate", prompt, "--model", str(ckpt), "--steps", "1", "--frames", "2", "--seed", "0",
            "--out", str(tmp_path / "o.mp4")]
    return CliRunner().invoke(cli, args, obj=make_manager(), env={"COLUMNS": "300"})


def _declare(ckpt, words):
    (ckpt / "omniloop.json").write_text(json.dumps({"vocabulary": words}))


def test_out_of_vocabulary_words_warn_once(toy_checkpoint, tmp_path):
    _declare(toy_checkpoint, vocabulary_words("video"))
    ok = _gen(toy_checkpoint, "a blue square moving right", tmp_path)
    assert ok.exit_code == 0, ok.output + ok.stderr
    assert "warning" not in ok.stderr and "never saw" not in ok.stdout + ok.stderr

    res = _gen(toy_checkpoint, "A red Fox, jumping over a fox!", tmp_path)
    assert res.exit_code == 0, res.output + res.stderr  # advice, never a refusal
    lines = [ln for ln in res.stderr.splitlines() if "never saw" in ln]
    assert len(lines) == 1 and res.stderr.count("never saw") == 1
    assert lines[0].startswith("warning:") and "'fox', 'jumping', 'over'" in lines[0]
    assert "never saw" not in res.stdout


def test_no_vocabulary_no_warning(toy_checkpoint, tmp_path):
    res = _gen(toy_checkpoint, "a red fox", tmp_path)
    assert res.exit_code == 0 and "never saw" not in res.stderr


def test_a_malformed_vocabulary_is_named_not_fatal(toy_checkpoint, tmp_path):
    _declare(toy_checkpoint, "a red fox")
    res = _gen(toy_checkpoint, "a red fox", tmp_path)
    assert res.exit_code == 0
    assert "omniloop.json vocabulary: expected a non-empty list of words" in res.stderr


def test_helpers(tmp_path):
    assert prompt_words("A red-Star, at the TOP left. a star") == ["a", "red", "star", "at", "the", "top", "left"]
    assert unknown_words("a red star at the top left", frozenset(vocabulary_words("image"))) == []
    assert unknown_words("a red star moving left", frozenset(vocabulary_words("image"))) == ["moving"]
    assert declared_vocabulary(tmp_path) == (None, None)  # no omniloop.json
    (tmp_path / "omniloop.json").write_text(json.dumps({"vocabulary": ["A", "Red"]}))
    assert declared_vocabulary(tmp_path) == (frozenset({"a", "red"}), None)
    msg = vocabulary_warning(tmp_path, " ".join(f"w{i}" for i in range(8)), "m")
    assert "'w0', 'w1', 'w2', 'w3', 'w4' and 3 more" in msg and "\n" not in msg
    (tmp_path / "omniloop.json").write_text(json.dumps({"vocabulary": [1, 2]}))
    assert declared_vocabulary(tmp_path)[1].startswith("omniloop.json vocabulary")
