"""The audio front ends end to end through the stable-audio family (tiny stereo checkpoint: 2
channels at 400 Hz, 0.32 s; the CLI also on the Stable Audio 3 one, 2 channels at 256 Hz):
``omniloop generate`` infers t2a and writes a wav holding the Python
API's waveform at 16 bits; ``omniloop serve``'s ``/v1/audio/speech`` through the official ``openai``
SDK (wav at the model's rate, mp3 resampled to 8 kHz) with the right channels and duration."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from .conftest import PROMPT, sa_manager, sa_runtime

av = pytest.importorskip("av")
openai = pytest.importorskip("openai")

SECONDS = 0.25


def decode(data: bytes) -> tuple[int, np.ndarray]:
    """(sample rate, float samples [channels, n]) of an audio file's bytes."""
    with av.open(io.BytesIO(data)) as c:
        parts, rate = [], 0
        for frame in c.decode(audio=0):
            rate, channels = frame.sample_rate, len(frame.layout.channels)
            arr = frame.to_ndarray().astype(np.float64)
            arr = arr if frame.format.is_planar else arr.reshape(-1, channels).T
            parts.append(arr / (32768.0 if frame.format.name.startswith("s16") else 1.0))
    return rate, np.concatenate(parts, axis=1)


@pytest.mark.parametrize(("variant", "rate", "n"), [("stereo", 400, 100), ("sa3", 256, 64)])
def test_generate_writes_the_python_apis_waveform(tiny_ckpt, tmp_path: Path, variant: str, rate: int, n: int) -> None:
    from omniloop_cli import cli

    ckpt = tiny_ckpt(variant)
    out = tmp_path / "clip.wav"
    res = CliRunner().invoke(cli, ["generate", PROMPT, "--model", str(ckpt), "--seconds", str(SECONDS), "--steps", "3",
                                   "--seed", "5", "--out", str(out)], obj=sa_manager())
    assert res.exit_code == 0, res.output  # no --task: t2a, the model's only task
    got_rate, got = decode(out.read_bytes())
    want = sa_runtime(ckpt).generate({"task": "t2a", "prompt": PROMPT, "audio": {"seconds": SECONDS},
                                      "diffusion": {"steps": 3, "seed": 5}}).artifacts["audio"]
    assert got_rate == want.sample_rate == rate and got.shape == tuple(want.samples.shape) == (2, n)
    assert float(np.abs(got - want.samples.clamp(-1, 1).numpy()).max()) <= 1 / 32768 + 1e-6


def test_openai_speech_through_the_family(tiny_ckpt, tmp_path: Path) -> None:
    from openai import OpenAI

    from omniloop_server import create_app
    from omniloop_server.testing import serving

    ckpt = tiny_ckpt("stereo")
    app = create_app(sa_runtime(ckpt, step=True), output_dir=tmp_path / "out", shutdown_timeout=0)
    with serving(app) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        for fmt, want_rate in (("wav", 400), ("mp3", 8000)):
            data = client.audio.speech.create(model=ckpt.name, voice="alloy", input=PROMPT, response_format=fmt,
                                              extra_body={"seconds": SECONDS, "steps": 3, "guidance": 7.0,
                                                          "seed": 1, "negative_prompt": "noise"}).read()
            rate, x = decode(data)
            assert rate == want_rate and x.shape[0] == 2
            assert abs(x.shape[1] / rate - SECONDS) < 1e-3, (fmt, x.shape)
        too_long = client.with_raw_response  # a window beyond the checkpoint's 0.32 s: one 422 naming seconds
        with pytest.raises(openai.UnprocessableEntityError) as err:
            too_long.audio.speech.create(model=ckpt.name, voice="alloy", input=PROMPT, extra_body={"seconds": 5})
        assert err.value.body["param"] == "seconds"
