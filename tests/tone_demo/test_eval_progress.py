"""``omniloop eval adherence --model tone-demo`` (issue 42, finding 6): a progress bar on stderr,
advanced batch by batch, while the clips are generated (it printed nothing until the end). The
pipeline is a stand-in that returns each prompt's ground-truth clip (tone-demo's weights are not
needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import omniloop_tone_demo.cli as cli
from omniloop_tone_demo.grammar import parse, synthesize


class _Pipe:
    def __call__(self, *, prompt: list[str], **kwargs: Any) -> Any:
        clips = synthesize([parse(p) for p in prompt], gen=torch.Generator().manual_seed(0))
        return type("Out", (), {"audios": clips})()


def test_the_audio_evaluation_draws_a_bar_that_reaches_every_clip(monkeypatch: Any, tmp_path: Path) -> None:
    rich_progress = pytest.importorskip("rich.progress")
    bars: list[dict[str, Any]] = []

    class Recording(rich_progress.Progress):  # draws as usual, and records each bar
        def add_task(self, description: str, *args: Any, total: float | None = None, **kwargs: Any) -> Any:
            bars.append({"total": total, "done": 0, "stderr": self.console.stderr})
            return super().add_task(description, *args, total=total, **kwargs)

        def advance(self, task_id: Any, advance: float = 1) -> None:
            bars[-1]["done"] += advance
            super().advance(task_id, advance)

    (tmp_path / "omniloop.json").write_text(json.dumps({"defaults": {"steps": 3, "guidance_scale": 7.0}}))
    monkeypatch.setattr(cli, "resolve", lambda model: tmp_path)
    monkeypatch.setattr(cli, "load_pipeline", lambda *a, **k: _Pipe())
    monkeypatch.setattr(rich_progress, "Progress", Recording)
    reports = cli.run("tone-demo", seeds="0", n_prompts=8, batch_size=3, backend="diffusers")  # the stand-in pipeline
    assert bars == [{"total": 8, "done": 8, "stderr": True}]
    assert reports[0].n == 8 and reports[0].accuracy["all"] == 1.0
