"""``omniloop generate --task reason``: the text goes to stdout (the summary to stderr), equal to
the Python API's text for the same greedy request; bad sampling values are one error line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("omniloop_qwen")

from omniloop_cli import cli


def qwen_manager() -> Any:
    import omniloop_qwen.plugin as qwen_plugin
    import omniloop_scheduler.plugin as scheduler_plugin
    from omniloop.testing import make_manager

    return make_manager(("qwen", qwen_plugin), ("scheduler", scheduler_plugin), toy=False, scheduler=False)


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omniloop_qwen.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("cli-qwen"), arch="qwen2")


def test_reason_prints_the_text(tiny_qwen: Path) -> None:
    from omniloop.runtime import Runtime

    args = ["generate", "the quick brown fox", "--task", "reason", "--model", str(tiny_qwen),
            "--max-tokens", "6", "--temperature", "0", "--device", "cpu", "--dtype", "float32"]
    res = CliRunner().invoke(cli, args, obj=qwen_manager())
    assert res.exit_code == 0, res.output
    rt = Runtime.from_model(tiny_qwen, manager=qwen_manager(), device="cpu", dtype="float32")
    ref = rt.generate({"task": "reason", "prompt": "the quick brown fox",
                       "sampling": {"max_tokens": 6, "temperature": 0}}).artifacts["text"].text
    assert res.stdout == ref + "\n"
    assert "completed" in res.stderr and "completed" not in res.stdout

    res = CliRunner().invoke(cli, [*args, "--json"], obj=qwen_manager())
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["text"] == ref


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--max-tokens", "0"], "sampling.max_tokens"),
    (["--temperature", "-1"], "sampling.temperature"),
    (["--out", "x.txt"], "--out"),
])
def test_reason_bad_flags_are_one_error_line(tiny_qwen: Path, extra: list[str], fragment: str) -> None:
    res = CliRunner().invoke(cli, ["generate", "hi", "--task", "reason", "--model", str(tiny_qwen), *extra],
                             obj=qwen_manager())
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], res.stderr


def test_a_text_model_defaults_to_reason(tiny_qwen: Path) -> None:
    """Issue 42 (finding 7): without --task a text-only model runs ``reason`` (it used to be
    asked for t2v and refused)."""
    args = ["generate", "the quick brown fox", "--model", str(tiny_qwen), "--max-tokens", "4", "--temperature", "0"]
    res = CliRunner().invoke(cli, args, obj=qwen_manager())
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() and "completed" in res.stderr
