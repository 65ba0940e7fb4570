"""``omniloop generate`` for audio: the toy-audio family (omniloop.testing.toy_audio) written in every
format and decoded back with PyAV; the refusals (one line, exit 2, nothing written, before any load);
an output with both video and audio written as an mp4 with its AAC track, or the track alone."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from omniloop.artifacts import Audio, VideoFrames
from omniloop.request import OmniOutput, Status
from omniloop.testing import build_toy_audio_checkpoint, build_toy_checkpoint, make_manager
from omniloop.testing.toy_audio import prompt_frequency
from omniloop_cli import cli
from omniloop_cli.output import write_outputs

av = pytest.importorskip("av")


def invoke(args: list[str]) -> Result:
    return CliRunner().invoke(cli, args, obj=make_manager(toy_audio=True))


def one_error_line(res: Result) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def audio_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_toy_audio_checkpoint(tmp_path_factory.mktemp("toy-audio"), sample_rate=16000, channels=2, max_seconds=6.0)


@pytest.fixture(scope="module")
def video_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_toy_checkpoint(tmp_path_factory.mktemp("toy"))


def decoded(path: Path) -> tuple[int, int, float, torch.Tensor]:
    """(sample rate, channels, seconds, channel 0 as float) of an audio file."""
    import numpy as np

    with av.open(str(path)) as c:
        stream = c.streams.audio[0]
        parts, rate, channels = [], 0, 0
        for frame in c.decode(stream):
            rate, channels = frame.sample_rate, len(frame.layout.channels)
            arr = frame.to_ndarray().astype(np.float64)
            arr = arr if frame.format.is_planar else arr.reshape(-1, channels).T
            parts.append(arr[0] / (32768.0 if frame.format.name.startswith("s16") else 1.0))
    x = torch.from_numpy(np.concatenate(parts))
    return rate, channels, x.shape[0] / rate, x


def peak_hz(x: torch.Tensor, rate: int) -> float:
    spec = torch.fft.rfft(x.double() * torch.hann_window(x.shape[0], dtype=torch.float64))
    return float(spec.abs().argmax()) * rate / x.shape[0]


@pytest.mark.parametrize(("suffix", "rate"), [(".wav", 16000), (".flac", 16000), (".mp3", 16000), (".ogg", 48000),
                                             (".opus", 48000)])
def test_generate_t2a_writes_every_format(audio_ckpt: Path, tmp_path: Path, suffix: str, rate: int) -> None:
    out = tmp_path / f"clip{suffix}"
    res = invoke(["generate", "a glass bell", "--model", str(audio_ckpt), "--task", "t2a", "--seconds", "1.25",
                  "--seed", "3", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "wrote" in res.stdout and "1.25 s, 16000 Hz, 2 channels" in res.stdout
    assert "denoise" in res.stderr and "4/4" in res.stderr  # the loop's progress bar, as for video
    got_rate, channels, seconds, x = decoded(out)
    assert (got_rate, channels) == (rate, 2)
    assert abs(seconds - 1.25) < 1e-3
    assert abs(peak_hz(x, got_rate) - prompt_frequency("a glass bell")) < 2.0


def test_task_is_inferred_for_an_audio_only_model_and_the_default_file_is_wav(audio_ckpt: Path, tmp_path: Path) -> None:
    res = invoke(["generate", "a drum", "--model", str(audio_ckpt), "--start", "1.5", "--out", f"{tmp_path}/", "--json"])
    assert res.exit_code == 0, res.output
    import json

    doc = json.loads(res.stdout)
    path = Path(doc["output_path"])
    assert path.suffix == ".wav" and path.parent == tmp_path
    assert doc["artifacts"]["audio"]["sample_rate"] == 16000
    _, _, seconds, _ = decoded(path)
    assert abs(seconds - 4.5) < 1e-3  # no --seconds: to the checkpoint's maximum (6 s) from start 1.5


@pytest.mark.parametrize(("args", "message"), [
    (["--seconds", "0"], "audio.seconds: must be > 0"),
    (["--seconds", "-1"], "audio.seconds: must be > 0"),
    (["--seconds", "nan"], "audio.seconds"),
    (["--seconds", "1e999"], "audio.seconds"),
    (["--seconds", "7"], "audio.seconds: 7 s is longer than the checkpoint's maximum of 6 s"),
    (["--seconds", "2", "--start", "5"], "audio.start + audio.seconds = 7 s is longer"),
    (["--out", "OUT.mp4"], "--out: a t2a request makes audio; unsupported file type '.mp4'"),
    (["--out", "OUT.aiff"], "unsupported file type '.aiff'"),
    (["--frames", "9"], "diffusion.frames: a toy-audio t2a request makes audio"),
])
def test_bad_audio_input_is_one_line_before_anything_is_written(audio_ckpt: Path, tmp_path: Path, args: list[str],
                                                                 message: str) -> None:
    args = [a.replace("OUT", str(tmp_path / "x")) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "x.wav")]
    res = invoke(["generate", "a bell", "--model", str(audio_ckpt), *args])
    assert message in one_error_line(res)
    assert list(tmp_path.iterdir()) == []


def test_audio_on_a_model_that_makes_none_is_refused(video_ckpt: Path, tmp_path: Path) -> None:
    res = invoke(["generate", "a fox", "--model", str(video_ckpt), "--seconds", "2", "--out", str(tmp_path / "v.mp4")])
    assert "--seconds/--start: model" in one_error_line(res) and "makes no audio for a t2v request" in res.stderr
    res = invoke(["generate", "a fox", "--model", str(video_ckpt), "--out", str(tmp_path / "v.wav")])
    assert "--out: a .wav holds audio" in one_error_line(res)
    res = invoke(["generate", "a fox", "--model", str(video_ckpt), "--task", "t2a", "--out", str(tmp_path / "v.wav")])
    assert "task: 't2a' is not supported by family 'toy'" in one_error_line(res)
    assert list(tmp_path.iterdir()) == []


def _av_output(seconds: float = 33 / 16) -> OmniOutput:
    fps, t = 16.0, 33
    n = round(seconds * 16000)
    tt = torch.arange(n, dtype=torch.float64) / 16000
    samples = torch.stack([0.4 * torch.sin(2 * math.pi * 330 * tt)] * 2).float()
    return OmniOutput(request_id="r", status=Status.COMPLETED, artifacts={
        "video": VideoFrames(frames=torch.randint(0, 255, (t, 32, 32, 3), dtype=torch.uint8), fps=fps),
        "audio": Audio(samples=samples, sample_rate=16000),
    })


def test_an_output_with_video_and_audio_muxes_into_mp4_or_writes_the_track_alone(tmp_path: Path) -> None:
    out = _av_output()
    files = write_outputs(out, tmp_path / "both.mp4")
    with av.open(str(files["output"])) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        assert a.codec_context.name == "aac" and a.sample_rate == 16000
        assert abs(float(v.duration * v.time_base) - float(a.duration * a.time_base)) <= 1 / 16
    files = write_outputs(out, tmp_path / "track.flac")
    rate, channels, seconds, x = decoded(files["output"])
    assert (rate, channels) == (16000, 2) and abs(seconds - 33 / 16) < 1e-3
    assert abs(peak_hz(x, rate) - 330.0) < 2.0


def test_generate_on_a_video_model_with_sound_muxes_or_writes_the_track(tmp_path: Path) -> None:
    """toy-av (a t2v family declaring audio_tasks, as LTX-2 will): --out x.mp4 holds both streams,
    as long as each other within one frame; --out x.wav the track alone; --seconds is taken."""
    ckpt = build_toy_audio_checkpoint(tmp_path / "toy-av", family="toy-av", fps=8.0)
    res = invoke(["generate", "a horn", "--model", str(ckpt), "--seconds", "2", "--seed", "1",
                  "--out", str(tmp_path / "both.mp4")])
    assert res.exit_code == 0, res.output
    assert "16 frames, 16x16, 8 fps, with sound" in res.stdout
    with av.open(str(tmp_path / "both.mp4")) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        assert a.codec_context.name == "aac" and a.sample_rate == 16000 and a.channels == 2
        v_s, a_s = float(v.duration * v.time_base), float(a.duration * a.time_base)
    assert abs(v_s - 2.0) <= 1 / 8 and abs(a_s - v_s) <= 1 / 8
    res = invoke(["generate", "a horn", "--model", str(ckpt), "--seconds", "2", "--out", str(tmp_path / "track.wav")])
    assert res.exit_code == 0, res.output
    rate, channels, seconds, x = decoded(tmp_path / "track.wav")
    assert (rate, channels) == (16000, 2) and abs(seconds - 2.0) < 1e-3
    assert abs(peak_hz(x, rate) - prompt_frequency("a horn")) < 2.0


def test_help_lists_the_audio_flags() -> None:
    res = CliRunner().invoke(cli, ["generate", "--help"], obj=make_manager(toy_audio=True))
    assert "--seconds" in res.output and "--start" in res.output and ".wav" in res.output


