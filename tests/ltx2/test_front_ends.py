"""The ltx2 output through the front ends: ``omniloop generate --out x.mp4`` writes one mp4 with a
video and an AAC audio track whose durations agree within one video frame (checked with PyAV),
``--out x.wav`` the track alone; ``POST /v1/videos`` (JSON, and the OpenAI SDK's multipart call)
serves the same kind of file.

The tiny checkpoint ``a`` makes 25 audio latents per second, decoded to 8000 Hz stereo; its causal
audio VAE decodes 4L - 3 mel frames from L latents, so the track is 3 mel hops (30 ms) shorter
than the video — less than one frame at 25 fps, as in diffusers.
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

av = pytest.importorskip("av")

FPS, FRAMES = 25.0, 25


def durations(source: Any) -> tuple[float, float, Any, Any]:
    with av.open(source) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        info = (a.codec_context.name, a.sample_rate, a.channels)
        n = sum(1 for _ in c.decode(video=0))
        return float(v.duration * v.time_base), float(a.duration * a.time_base), info, n


def test_generate_mp4_has_both_streams_of_equal_length(tiny_ckpt: Any, manager: Any, tmp_path: Path) -> None:
    from omniloop_cli import cli

    out = tmp_path / "clip.mp4"
    res = CliRunner().invoke(cli, ["generate", "a robot dancing", "--model", str(tiny_ckpt("a")), "--frames",
                                   str(FRAMES), "--fps", str(FPS), "--steps", "2", "--seed", "1", "--out", str(out)],
                             obj=manager())
    assert res.exit_code == 0, res.output
    assert "with sound" in res.stdout
    v_s, a_s, (codec, rate, channels), n = durations(str(out))
    assert (codec, rate, channels, n) == ("aac", 8000, 2, FRAMES)
    assert abs(v_s - FRAMES / FPS) <= 1 / FPS and abs(a_s - v_s) <= 1 / FPS, (v_s, a_s)
    wav = tmp_path / "track.wav"
    res = CliRunner().invoke(cli, ["generate", "a robot dancing", "--model", str(tiny_ckpt("a")), "--frames",
                                   str(FRAMES), "--fps", str(FPS), "--steps", "2", "--out", str(wav)], obj=manager())
    assert res.exit_code == 0, res.output
    with av.open(str(wav)) as c:
        a = c.streams.audio[0]
        assert (a.sample_rate, a.channels) == (8000, 2)


def test_generate_refuses_frames_off_the_vae_grid_in_one_line(tiny_ckpt: Any, manager: Any, tmp_path: Path) -> None:
    from omniloop_cli import cli

    out = tmp_path / "x.mp4"
    res = CliRunner().invoke(cli, ["generate", "a cat", "--model", str(tiny_ckpt("a")), "--frames", "8",
                                   "--out", str(out)], obj=manager())
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "diffusion.frames" in lines[0], res.output
    assert not out.exists()


# the openai SDK marks its videos API (the endpoint shape /v1/videos serves) deprecated upstream: not ours to act on
@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_v1_videos_serves_the_mp4_with_its_audio_track(tiny_ckpt: Any, make_runtime: Any, tmp_path: Path) -> None:
    import httpx

    from omniloop_server import create_app
    from omniloop_server.testing import serving

    app = create_app(make_runtime(tiny_ckpt("a"), step=True), output_dir=tmp_path / "out", shutdown_timeout=0,
                     poll_after_ms=20)
    body = {"prompt": "a robot dancing", "size": "32x32", "frames": FRAMES,
            "omniloop": {"diffusion": {"steps": 2, "fps": FPS}, "audio": {"guidance": 5.0}}}
    with serving(app) as url:
        job = httpx.post(f"{url}/v1/videos", json=body, timeout=60).json()
        deadline = time.monotonic() + 120
        while job.get("status") not in ("completed", "failed"):
            assert time.monotonic() < deadline, job
            time.sleep(0.05)
            job = httpx.get(f"{url}/v1/videos/{job['id']}", timeout=60).json()
        assert job["status"] == "completed", job
        data = httpx.get(f"{url}/v1/videos/{job['id']}/content", timeout=60).content
        # the OpenAI SDK's own call (multipart/form-data): 1 s at the checkpoint's 25 fps
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-")
        try:
            model = client.models.list().data[0].id
            video = client.videos.create_and_poll(model=model, prompt="a robot dancing", seconds="1", size="32x32",
                                                  extra_body={"steps": 2}, poll_interval_ms=50)
            assert video.status == "completed", video
            sdk_data = client.videos.download_content(video.id).content
        finally:
            client.close()
    for blob in (data, sdk_data):
        v_s, a_s, (codec, rate, channels), n = durations(io.BytesIO(blob))
        assert (codec, rate, channels, n) == ("aac", 8000, 2, FRAMES)
        assert abs(a_s - v_s) <= 1 / FPS, (v_s, a_s)


def test_generate_i2v_mp4_with_sound(tiny_ckpt: Any, manager: Any, tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image

    from omniloop_cli import cli

    Image.fromarray(np.full((32, 32, 3), 120, dtype=np.uint8)).save(tmp_path / "first.png")
    out = tmp_path / "i2v.mp4"
    res = CliRunner().invoke(cli, ["generate", "a robot dancing", "--model", str(tiny_ckpt("a")), "--task", "i2v",
                                   "--image", str(tmp_path / "first.png"), "--frames", "9", "--fps", str(FPS),
                                   "--steps", "2", "--out", str(out)], obj=manager())
    assert res.exit_code == 0, res.output
    v_s, a_s, (codec, _, _), n = durations(str(out))
    assert codec == "aac" and n == 9 and abs(a_s - v_s) <= 1 / FPS
