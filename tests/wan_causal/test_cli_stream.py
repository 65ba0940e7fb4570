"""``omniloop generate --stream`` on a causal Wan deployment writes each chunk's frames as it comes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner

from omniloop.testing import make_manager
from omniloop_cli import cli
from omniloop_cli import stream as stream_mod
from omniloop_io import media
from omniloop_wan import plugin as wan_plugin


def test_generate_stream_writes_frames_as_they_come(tiny_wan: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    deploy = tmp_path / "deploy.json"
    deploy.write_text(json.dumps({
        "model": {"path": str(tiny_wan)},
        "options": {"rollout": "causal", "rollout_options": {"chunk_frames": 3, "steps": 2, "kv_slabs": 4}},
    }))
    manager = make_manager(("wan", wan_plugin), toy=False)
    seen: list[int] = []
    real = stream_mod.FrameStream.update

    def spy(self, event):  # files of a chunk exist before the next event is handled
        out = real(self, event)
        if out:
            assert all(p.exists() for p in out)
            seen.append(len(out))
        return out

    monkeypatch.setattr(stream_mod.FrameStream, "update", spy)
    res = CliRunner().invoke(cli, ["generate", "a red fox runs", "--deploy", str(deploy), "--frames", "21", "--seed", "4",
                                   "--out", "fox.mp4", "--stream", "--json"], obj=manager)
    assert res.exit_code == 0, res.output
    assert seen == [9, 12]  # two chunks of 3 latent frames
    folder = tmp_path / "fox.frames"
    index = json.loads((folder / "index.json").read_text())
    assert index["frames"] == 21 and [c["frames"] for c in index["chunks"]] == [9, 12]
    pngs = sorted(folder.glob("frame_*.png"))
    assert len(pngs) == 21
    doc = json.loads(res.stdout)
    assert Path(doc["files"]["frames"]).resolve() == folder.resolve() and Path(doc["output_path"]).exists()
    video = torch.stack([media.read_image(p) for p in pngs])
    assert video.shape == (21, 32, 32, 3)


def test_stream_flag_on_a_non_streaming_deployment_is_refused(tiny_wan: Path, tmp_path: Path, monkeypatch) -> None:
    """--stream where the pipeline emits no frames (Node.emits) is refused before any compute
    (issue 42: it used to be ignored silently, writing only the final clip)."""
    monkeypatch.chdir(tmp_path)
    manager = make_manager(("wan", wan_plugin), toy=False)
    res = CliRunner().invoke(cli, ["generate", "a fox", "--model", str(tiny_wan), "--frames", "5", "--steps", "1",
                                   "--out", "a.mp4", "--stream"], obj=manager)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --stream: the t2v pipeline of model"), res.stderr
    assert not (tmp_path / "a.mp4").exists() and not (tmp_path / "a.frames").exists()


def test_return_latents_under_the_causal_rollout_is_refused(tiny_wan: Path, tmp_path: Path, monkeypatch) -> None:
    """Issue 34: the causal rollout returns the decoded video only; ``--return-latents`` used to
    write no file without a word. Now one line naming the option, the family and the rollout,
    exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    deploy = tmp_path / "deploy.json"
    deploy.write_text(json.dumps({"model": {"path": str(tiny_wan)}, "options": {"rollout": "causal"}}))
    manager = make_manager(("wan", wan_plugin), toy=False)
    res = CliRunner().invoke(cli, ["generate", "a fox", "--deploy", str(deploy), "--frames", "21", "--out", "a.mp4",
                                   "--return-latents"], obj=manager)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "outputs.return_latents" in lines[0] and "family 'wan' under options.rollout: causal does not return latents" in lines[0]
    assert not list(tmp_path.glob("a*"))
