"""``omniloop eval adherence`` (issue 42, findings 6 and 7): progress while it generates, the same
samples as one call, and ``--guidance``'s help naming the checkpoints' real defaults."""

from __future__ import annotations

import json
from typing import Any, ClassVar

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


class _RecordingProgress:
    """Stands in for rich's Progress: records each bar's total and how far it was advanced."""

    bars: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, *columns: Any, **kwargs: Any) -> None:
        self.console = kwargs.get("console")

    def __enter__(self) -> _RecordingProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def add_task(self, description: str, total: int | None = None, **kwargs: Any) -> int:
        self.bars.append({"total": total, "done": 0, "advances": 0, "stderr": bool(self.console and self.console.stderr)})
        return len(self.bars) - 1

    def advance(self, task: int, k: float = 1) -> None:
        self.bars[task]["done"] += k
        self.bars[task]["advances"] += 1


def test_the_cli_draws_a_bar_on_stderr_that_reaches_every_clip(monkeypatch: Any) -> None:
    """``omniloop eval adherence`` (finding 6: it printed nothing for minutes): a bar per step count,
    on stderr, advanced clip by clip up to the number of clips scored (24 prompts x 1 seed)."""
    import rich.progress

    import omniloop_wan_demo.evaluate as ev

    monkeypatch.setattr(_RecordingProgress, "bars", [])
    monkeypatch.setattr(rich.progress, "Progress", _RecordingProgress)
    monkeypatch.setattr(ev, "make_generator", lambda *a, **k: (_fake([]), "runtime", None))
    res = CliRunner().invoke(adherence, ["--model", "wan-demo", "--steps", "1,2", "--seeds", "0", "--no-table"])
    assert res.exit_code == 0, res.output
    bars = _RecordingProgress.bars
    assert [b["total"] for b in bars] == [24, 24] and all(b["stderr"] for b in bars)
    assert [b["done"] for b in bars] == [24, 24] and all(b["advances"] == 24 for b in bars)  # the runtime: clip by clip
