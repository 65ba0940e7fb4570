"""The demo models' prompt grammar (``omniloop_wan_demo.prompts``): the vocabulary, the video and
image prompt forms and their parsers; and the deprecated ``omniloop_wan_demo.data`` (until 0.3)."""

import importlib
import sys

import pytest

from omniloop_wan_demo import prompts as grammar


def test_vocabulary():
    assert grammar.SHAPES == ("circle", "square", "triangle", "star")  # indices are stable: star came last
    assert len(grammar.all_prompts()) == len(grammar.COLORS) * len(grammar.SHAPES) * len(grammar.DIRECTIONS) == 96
    with pytest.raises(ValueError):
        grammar.parse_prompt("a dog running")


def test_image_prompts_round_trip():
    assert list(grammar.POSITIONS) == ["top left", "top", "top right", "left", "center", "right",
                               "bottom left", "bottom", "bottom right"]
    assert grammar.POSITIONS["top left"] == (0.25, 0.25) and grammar.POSITIONS["bottom"] == (0.5, 0.75)
    assert grammar.image_prompt_for("red", "star", "top left") == "a red star at the top left"
    prompts = grammar.all_image_prompts()
    assert len(prompts) == len(set(prompts)) == 6 * 4 * 9
    for p in prompts:
        assert grammar.image_prompt_for(*grammar.parse_image_prompt(p)) == p
    assert grammar.parse_image_prompt("A Green Circle, at the Center.") == ("green", "circle", "center")
    assert grammar.parse_image_prompt("a cyan square at the bottom-right") == ("cyan", "square", "bottom right")


@pytest.mark.parametrize("bad, what", [
    ("a dog at the top left", "no color"),
    ("a red dog at the top", "no shape"),
    ("a red blue star at the top", "more than one color"),
    ("a red star", "no single position"),
    ("a red star at the top bottom", "no single position"),
    ("a red star at the center left", "no single position"),
    (None, "must be a string"),
])
def test_parse_image_prompt_refuses(bad, what):
    with pytest.raises(ValueError, match=what):
        grammar.parse_image_prompt(bad)


def test_vocabulary_words():
    video = grammar.vocabulary_words("video")
    image = grammar.vocabulary_words("image")
    for p in grammar.all_prompts():
        assert set(p.split()) <= set(video)
    for p in grammar.all_image_prompts():
        assert set(p.split()) <= set(image)
    assert "star" in video and "moving" in video and "at" not in video
    assert {"top", "bottom", "center", "the"} <= set(image) and "moving" not in image
    with pytest.raises(ValueError, match="video' or 'image"):
        grammar.vocabulary_words("audio")



def test_the_grammar_imports_nothing_heavy():
    """The runtime package's grammar is pure Python: the eval command and the CLI's vocabulary
    warning need no torch to read it."""
    import subprocess

    code = "import sys, omniloop_wan_demo.prompts; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_the_old_data_module_warns_and_still_resolves_every_name():
    """``omniloop_wan_demo.data`` (before the demos' training code moved to ``demos/``): importing
    it warns once with a DeprecationWarning naming both new homes; the grammar's names are the same
    objects, the renderer's come from ``omniloop_wan_demo_training.render``."""
    from omniloop_wan_demo import prompts
    from omniloop_wan_demo_training import render

    sys.modules.pop("omniloop_wan_demo.data", None)
    with pytest.warns(DeprecationWarning, match=r"omniloop_wan_demo\.prompts.*omniloop_wan_demo_training\.render"):
        data = importlib.import_module("omniloop_wan_demo.data")
    assert data.COLORS is prompts.COLORS and data.vocabulary_words is prompts.vocabulary_words
    assert data.render is render.render and data.make_clips is render.make_clips and data.FRAMES == render.FRAMES
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        data.nope  # noqa: B018
