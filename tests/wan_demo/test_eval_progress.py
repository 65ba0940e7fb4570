"""``omniloop eval adherence`` (issue 42, findings 6 and 7): progress while it generates, the same
samples as one call, and ``--guidance``'s help naming the checkpoints' real defaults."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from click.testing import CliRunner

from omniloop_wan_demo.checkpoint_path import checkpoint_dir, fast_checkpoint_dir
from omniloop_wan_demo.cli import adherence
from omniloop_wan_demo.evaluate import evaluate


def _fake(calls: list[int]) -> Any:
    def generate(prompts: list[str], seeds: list[int], *, steps: int, guidance_scale: float) -> list[np.ndarray]:
        calls.append(len(prompts))
        return [np.full((17, 64, 64, 3), 30 * (s % 5), dtype=np.uint8) for s in seeds]
    return generate


def test_progress_reports_every_chunk_and_keeps_the_samples() -> None:
    calls: list[int] = []
    done: list[int] = []
    rep = evaluate(_fake(calls), seeds=[0, 1, 2], steps=2, progress=done.append, chunk=5)
    whole_calls: list[int] = []
    whole = evaluate(_fake(whole_calls), seeds=[0, 1, 2], steps=2)
    assert sum(done) == rep.n == whole.n == 72 and max(calls) == 5 and whole_calls == [72]
    assert rep.accuracy == whole.accuracy


def test_guidance_help_names_the_checkpoints_defaults() -> None:
    res = CliRunner().invoke(adherence, ["--help"])
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    for folder, name in ((checkpoint_dir(), "wan-demo"), (fast_checkpoint_dir(), "wan-demo-fast")):
        g = json.loads((folder / "omniloop.json").read_text())["defaults"]["guidance_scale"]
        assert f"{float(g)} for {name}" in text, text
