"""omniloop_io.media's audio writers (wav, flac, mp3, Ogg Opus, AAC, raw pcm) and the mp4 with a sound
track: every file decoded back with PyAV (rate, channels, length, and the pitch where the codec is lossy)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch

from omniloop_io import media

av = pytest.importorskip("av")

SR = 16000


def tone(seconds: float, channels: int = 2, rate: int = SR, freq: float = 440.0) -> torch.Tensor:
    t = torch.arange(round(seconds * rate), dtype=torch.float64) / rate
    return torch.stack([0.5 * torch.sin(2 * math.pi * freq * (k + 1) * t) for k in range(channels)]).float()


def decode(data: bytes | Path) -> tuple[torch.Tensor, int, str]:
    """Every sample of the first audio stream as float ``[channels, n]``, its rate and codec."""
    import numpy as np

    src = io.BytesIO(data) if isinstance(data, bytes) else str(data)
    with av.open(src) as c:
        stream = c.streams.audio[0]
        chunks, rate = [], None
        for frame in c.decode(stream):
            rate = frame.sample_rate
            arr = frame.to_ndarray().astype(np.float64)
            if frame.format.name.startswith("s16"):
                arr = arr / 32768.0
            if not frame.format.is_planar:  # packed: [1, n * channels]
                arr = arr.reshape(-1, len(frame.layout.channels)).T
            chunks.append(arr)
        name = stream.codec_context.name
    return torch.from_numpy(np.concatenate(chunks, axis=1)).float(), int(rate), name


def peak_hz(x: torch.Tensor, rate: int) -> float:
    spec = torch.fft.rfft(x.double() * torch.hann_window(x.shape[-1], dtype=torch.float64))
    return float(spec.abs().argmax()) * rate / x.shape[-1]


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_lossless_formats_hold_the_samples_at_16_bits(fmt: str) -> None:
    x = tone(0.75)
    y, rate, _ = decode(media.encode_audio(x, SR, fmt))
    assert rate == SR and y.shape == x.shape
    assert float((y - x).abs().max()) <= 1.0 / 32767 + 1e-6


@pytest.mark.parametrize(("fmt", "codec", "decoded_rate", "slack"), [
    ("mp3", "mp3", SR, 0), ("opus", "opus", 48000, 0), ("aac", "aac", SR, 2048),
])
def test_lossy_formats_keep_rate_channels_length_and_pitch(fmt: str, codec: str, decoded_rate: int, slack: int) -> None:
    x = tone(1.0, freq=440.0)
    y, rate, name = decode(media.encode_audio(x, SR, fmt))
    assert name.startswith(codec)
    assert rate == decoded_rate and y.shape[0] == 2  # Opus always decodes at 48 kHz
    want = round(x.shape[1] * rate / SR)
    assert want <= y.shape[1] <= want + slack  # mp3 (LAME tag) and Ogg Opus trim exactly; raw ADTS keeps padding
    assert abs(peak_hz(y[0], rate) - 440.0) < 5 and abs(peak_hz(y[1], rate) - 880.0) < 5


def test_a_rate_mp3_does_not_take_is_resampled_to_the_next_one_it_does() -> None:
    x = tone(0.5, channels=1, rate=44000)
    y, rate, _ = decode(media.encode_audio(x, 44000, "mp3"))
    assert rate == 44100 and y.shape[0] == 1
    assert abs(peak_hz(y[0], rate) - 440.0) < 5


def test_pcm_is_raw_16_bit_little_endian_interleaved() -> None:
    x = torch.tensor([[0.0, 0.5, -1.0], [1.0, -0.5, 2.0]])  # 2.0 is clamped
    data = media.encode_audio(x, SR, "pcm")
    got = torch.frombuffer(bytearray(data), dtype=torch.int16).tolist()
    assert got == [0, 32767, 16384, -16384, -32768, 32767]
    wav, _, _ = decode(media.encode_audio(x, SR, "wav"))
    assert (wav * 32768).round().to(torch.int16).t().flatten().tolist() == got  # the same conversion as FFmpeg's


@pytest.mark.parametrize("suffix", sorted(media.AUDIO_FORMATS))
def test_write_audio_by_suffix(tmp_path: Path, suffix: str) -> None:
    x = tone(0.5)
    path = media.write_audio(x, SR, tmp_path / f"clip{suffix}")
    y, rate, name = decode(path)
    assert name == {"wav": "pcm_s16le", "flac": "flac", "opus": "opus", "mp3": "mp3float"}.get(
        media.AUDIO_FORMATS[suffix], name)
    assert y.shape[0] == 2 and abs(y.shape[1] / rate - 0.5) < 1e-3
    assert [p.name for p in tmp_path.iterdir()] == [f"clip{suffix}"]  # no temporary file left


def test_bad_samples_and_types_are_refused_before_encoding(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unsupported audio type '\.aiff'"):
        media.write_audio(tone(0.1), SR, tmp_path / "x.aiff")
    with pytest.raises(ValueError, match="unsupported audio format 'ogg'"):
        media.encode_audio(tone(0.1), SR, "ogg")
    with pytest.raises(ValueError, match="non-finite"):
        media.encode_audio(torch.full((2, 10), float("nan")), SR, "wav")
    with pytest.raises(ValueError, match="3 channels"):
        media.encode_audio(torch.zeros(3, 10), SR, "wav")
    with pytest.raises(ValueError, match="float"):
        media.encode_audio(torch.zeros(2, 10, dtype=torch.int16), SR, "wav")
    with pytest.raises(ValueError, match="sample_rate"):
        media.encode_audio(tone(0.1), 0, "wav")
    assert list(tmp_path.iterdir()) == []


def test_mp4_with_audio_has_both_streams_of_equal_duration(tmp_path: Path) -> None:
    fps, t = 16.0, 33
    frames = torch.randint(0, 255, (t, 32, 48, 3), dtype=torch.uint8)
    sound = tone(t / fps, rate=22050)
    path = media.write_mp4(frames, fps, tmp_path / "v.mp4", audio=(sound, 22050))
    with av.open(str(path)) as c:
        video, audio = c.streams.video[0], c.streams.audio[0]
        assert audio.codec_context.name == "aac" and audio.sample_rate == 22050 and audio.channels == 2
        v_s = float(video.duration * video.time_base)
        a_s = float(audio.duration * audio.time_base)
        n_video = sum(1 for _ in c.decode(video))
    assert n_video == t
    assert abs(v_s - t / fps) <= 1 / fps and abs(a_s - v_s) <= 1 / fps
    y, rate, _ = decode(path)
    assert rate == 22050 and abs(y.shape[1] - sound.shape[1]) <= 2048
    assert abs(peak_hz(y[0], rate) - 440.0) < 5


def test_mp4_without_audio_is_unchanged(tmp_path: Path) -> None:
    frames = torch.zeros(4, 16, 16, 3, dtype=torch.uint8)
    a = media.write_mp4(frames, 8.0, tmp_path / "a.mp4").read_bytes()
    b = media.write_mp4(frames, 8.0, tmp_path / "b.mp4", audio=None).read_bytes()
    assert a == b
    with av.open(str(tmp_path / "a.mp4")) as c:
        assert len(c.streams.audio) == 0


@pytest.mark.parametrize(("fmt", "decoded_rate"), [("wav", 400), ("flac", 400), ("mp3", 8000), ("opus", 48000)])
def test_a_tiny_models_low_rate_is_written_or_resampled(fmt: str, decoded_rate: int) -> None:
    """A tiny test checkpoint's 400 Hz (stable-audio's tiny stereo): kept by wav and flac, resampled
    to the lowest rate mp3 takes, Opus' 48 kHz; the length is kept."""
    x = tone(0.32, rate=400, freq=50.0)
    y, rate, _ = decode(media.encode_audio(x, 400, fmt))
    assert rate == decoded_rate and y.shape[0] == 2
    assert abs(y.shape[1] / rate - 0.32) < 1e-3
