"""Reading and writing media: mp4 (PyAV, h264 yuv420p, optionally with an AAC sound track), png,
input images, and audio (wav, flac, mp3, Ogg Opus, AAC, raw pcm; PyAV).

Writes are atomic: the file is written next to its destination under a temporary name
(``.<name>.<12 hex>.tmp<suffix>``) and moved into place with ``os.replace``, so a reader never sees
half a video. A process killed mid-write (SIGKILL, power loss) leaves its temporary file behind;
the next write into the same folder removes such leftovers — only names of exactly this pattern,
only when older than :data:`STALE_TEMP_SECONDS`, so a write in progress in another process is never
touched. PyAV and Pillow are imported lazily; when one is missing the error says which package to
install (they are omniloop-io's dependencies).

omniloop-io; the core's ``omniloop.media`` until omniloop 0.2 (issue 34: the runtime reads and writes no files).
"""

from __future__ import annotations

import io
import os
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from omniloop.errors import OmniloopError, RequestError

if TYPE_CHECKING:
    import torch


class MediaError(OmniloopError):
    """A media dependency is missing or a file could not be written."""


def _import_av() -> Any:
    try:
        import av
    except ImportError:
        raise MediaError("writing mp4 needs PyAV: pip install av (an omniloop-io dependency)") from None
    return av


def _import_pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise MediaError("reading and writing images needs Pillow: pip install pillow") from None
    return Image


#: a temporary file of ours older than this is a leftover of a killed write (no encode of one
#: output takes an hour; a live writer's file is younger)
STALE_TEMP_SECONDS = 3600.0
#: exactly the names :func:`_atomic_path` makes: ``.<dest name>.<12 hex>.tmp<suffix>``
_TEMP_NAME = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp\.(mp4|png|webp|wav|flac|mp3|ogg|opus)$")


def clean_stale_temp_files(
    folder: str | os.PathLike[str], *, older_than: float = STALE_TEMP_SECONDS, pattern: re.Pattern[str] = _TEMP_NAME
) -> list[Path]:
    """Remove temporary files left in ``folder`` by killed writes; return them.

    Only regular files whose name matches ``pattern`` exactly (by default this module's own
    temp-file names; another writer passes the pattern of its names) and whose modification time
    is more than ``older_than`` seconds ago; never follows links, never looks into sub-folders,
    and any file that cannot be removed is skipped."""
    removed: list[Path] = []
    now = time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        if not pattern.match(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not entry.is_file(follow_symlinks=False) or now - st.st_mtime <= older_than:
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(Path(entry.path))
    return removed


@contextmanager
def _atomic_path(path: str | os.PathLike[str], suffix: str) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; move it onto ``path`` only if the block succeeds."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temp_files(dest.parent)
    # not mkstemp: its 0600 mode would stick to the final file; a random name is enough here
    tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:12]}.tmp{suffix}"
    try:
        yield tmp
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def check_writable(path: str | os.PathLike[str]) -> None:
    """Raise :class:`MediaError` now if a file cannot be written at ``path`` (before hours of work).

    ``path`` must not be a folder; an existing file must be writable; the nearest existing folder
    on the way to it must take a new file — tried for real with a hidden probe file removed at
    once (permission bits say nothing on ``/proc`` or a read-only mount). Missing folders below it
    are left to be created at write time."""
    import tempfile

    p = Path(path)
    if p.is_dir():
        raise MediaError(f"{p} is a folder, not a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise MediaError(f"{p} exists and cannot be overwritten (permission denied)")
    folder = p.parent
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    if not folder.is_dir():
        raise MediaError(f"cannot write {p}: {folder} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".omniloop-probe-", dir=folder)
    except OSError as exc:
        raise MediaError(f"cannot write {p}: {exc.strerror or exc} in {folder}") from None
    os.close(fd)
    os.unlink(probe)


def _check_frames(frames: torch.Tensor, ndim: int, what: str) -> torch.Tensor:
    import torch
    if not isinstance(frames, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(frames).__name__}")
    if frames.dtype != torch.uint8 or frames.ndim != ndim or frames.shape[-1] != 3:
        shape = "[T, H, W, 3]" if ndim == 4 else "[H, W, 3]"
        raise ValueError(f"{what} must be uint8 {shape}, got {frames.dtype} {list(frames.shape)}")
    return frames.detach().to("cpu").contiguous()


def pad_to_even(frames: torch.Tensor) -> torch.Tensor:
    """Pad ``[..., H, W, 3]`` to even H and W by repeating the last row / column (yuv420p needs even sizes)."""
    import torch
    h, w = frames.shape[-3], frames.shape[-2]
    if h % 2:
        frames = torch.cat([frames, frames[..., -1:, :, :]], dim=-3)
    if w % 2:
        frames = torch.cat([frames, frames[..., :, -1:, :]], dim=-2)
    return frames


def write_mp4(frames: torch.Tensor, fps: float, path: str | os.PathLike[str], *, crf: int = 18,
              audio: tuple[torch.Tensor, int] | None = None) -> Path:
    """Write uint8 frames ``[T, H, W, 3]`` as an h264 / yuv420p mp4 at ``fps``; return the path.

    Odd heights or widths are padded to even by repeating the edge. Every frame is written with
    its own timestamp (``pts = i`` in a ``1/fps`` time base), so players see ``T`` frames at ``fps``.
    ``audio``: ``(samples [channels, n] float in [-1, 1], sample_rate)``, muxed as an AAC track
    beside the video (both start at 0; packets interleaved by time).
    """
    av = _import_av()
    frames = pad_to_even(_check_frames(frames, 4, "frames"))
    if frames.shape[0] < 1:
        raise ValueError("frames must hold at least one frame")
    if not fps or fps <= 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    sound = None if audio is None else (_check_samples(audio[0], audio[1]), audio[1])
    rate = Fraction(fps).limit_denominator(1001)
    t, h, w = frames.shape[0], frames.shape[1], frames.shape[2]
    arr = frames.numpy()
    with _atomic_path(path, ".mp4") as tmp:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=rate)
            stream.width, stream.height = w, h
            stream.pix_fmt = "yuv420p"
            frame_time = Fraction(1, 1) / rate  # not stream.time_base: the muxer may change it once it starts
            stream.time_base = frame_time
            # one encoder thread: x264's frame threading makes the bytes depend on CPU load, and
            # the same frames must give the same file (goldens, cache keys, parity of served mp4s)
            stream.options = {"crf": str(crf), "threads": "1"}
            stream.codec_context.thread_count = 1
            track: Any = None
            pending: list[Any] = []
            if sound is not None:  # AAC, its frames handed to the muxer as the video reaches their time
                enc = AUDIO_ENCODINGS["aac"]
                track = _add_audio_stream(container, enc, sound[0].shape[0], sound[1])
                track.codec_context.open()
                pending = _audio_frames(av, sound[0], sound[1], enc, track.codec_context.frame_size)
                pending.reverse()

            def audio_until(seconds: float | None) -> None:
                while pending and (seconds is None or pending[-1].pts * pending[-1].time_base < seconds):
                    for packet in track.encode(pending.pop()):
                        container.mux(packet)

            for i in range(t):
                frame = av.VideoFrame.from_ndarray(arr[i], format="rgb24")
                frame.pts = i
                frame.time_base = frame_time
                for packet in stream.encode(frame):
                    container.mux(packet)
                audio_until(float((i + 1) / rate))
            for packet in stream.encode():
                container.mux(packet)
            if track is not None:
                audio_until(None)
                for packet in track.encode(None):
                    container.mux(packet)
    return Path(path)


def write_png(pixels: torch.Tensor, path: str | os.PathLike[str]) -> Path:
    """Write uint8 ``[H, W, 3]`` pixels (or the first frame of ``[T, H, W, 3]``) as a png."""
    import torch
    image_mod = _import_pil()
    if isinstance(pixels, torch.Tensor) and pixels.ndim == 4:
        pixels = pixels[0]
    arr = _check_frames(pixels, 3, "pixels").numpy()
    with _atomic_path(path, ".png") as tmp:
        image_mod.fromarray(arr, mode="RGB").save(tmp, format="PNG")
    return Path(path)


#: image file types :func:`write_image` writes, by suffix
IMAGE_FORMATS = {".png": "PNG", ".webp": "WEBP"}


def write_image(pixels: torch.Tensor, path: str | os.PathLike[str]) -> Path:
    """Write uint8 ``[H, W, 3]`` pixels as the image type of ``path``'s suffix: ``.png``, or
    ``.webp`` (lossless, so the pixels read back equal). Other suffixes raise ``ValueError``."""
    import torch
    suffix = Path(path).suffix.lower()
    fmt = IMAGE_FORMATS.get(suffix)
    if fmt is None:
        raise ValueError(f"unsupported image type {suffix or '(none)'!r}; use {' or '.join(IMAGE_FORMATS)}")
    if fmt == "PNG":
        return write_png(pixels, path)
    image_mod = _import_pil()
    if isinstance(pixels, torch.Tensor) and pixels.ndim == 4:
        pixels = pixels[0]
    arr = _check_frames(pixels, 3, "pixels").numpy()
    with _atomic_path(path, suffix) as tmp:
        image_mod.fromarray(arr, mode="RGB").save(tmp, format=fmt, lossless=True, quality=100, method=4)
    return Path(path)


#: the most pixels :func:`read_image` decodes (Pillow itself refuses only at ~179 M, and decoding
#: an image that size takes seconds and gigabytes); callers with tighter limits pass ``max_pixels``
MAX_IMAGE_PIXELS = 2**25


def read_image(source: str | os.PathLike[str] | bytes, name: str = "image", *,
               max_pixels: int | None = MAX_IMAGE_PIXELS) -> torch.Tensor:
    """Decode an image file (path or bytes) to uint8 ``[H, W, 3]`` RGB, upright (its EXIF
    orientation applied, as a photo viewer shows it).

    A file that is missing, does not decode, or whose header says more than ``max_pixels`` pixels
    (checked before any pixel is decoded) raises :class:`RequestError` with ``name`` as the field
    path (e.g. ``inputs[1].path``).
    """
    import torch
    image_mod = _import_pil()
    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            img = image_mod.open(io.BytesIO(bytes(source)))
        else:
            p = Path(source)
            if not p.is_file():
                raise RequestError(name, f"image file {str(p)!r} does not exist")
            img = image_mod.open(p)
        w, h = img.size
        if max_pixels is not None and w * h > max_pixels:
            raise RequestError(name, f"image of {w}x{h} = {w * h} pixels; at most {max_pixels} are decoded")
        img.load()
        from PIL import ImageOps

        img = ImageOps.exif_transpose(img)
        rgb = img.convert("RGB")
    except RequestError:
        raise
    except Exception as exc:
        what = "image data" if isinstance(source, (bytes, bytearray, memoryview)) else f"image file {str(source)!r}"
        raise RequestError(name, f"{what} could not be decoded ({type(exc).__name__}: {exc})") from None
    import numpy as np

    return torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy())


def read_video(source: str | os.PathLike[str], name: str = "video", *, frame_cap: int = 1024,
               max_pixels: int | None = MAX_IMAGE_PIXELS) -> torch.Tensor:
    """Decode a video file's first stream to uint8 ``[T, H, W, 3]`` RGB, at most ``frame_cap``
    frames (the rest is not decoded). A missing file, one that does not decode, or frames of more
    than ``max_pixels`` pixels raise :class:`RequestError` with ``name`` as the field path."""
    import numpy as np
    import torch

    av = _import_av()
    p = Path(source)
    if not p.is_file():
        raise RequestError(name, f"video file {str(p)!r} does not exist")
    frames: list[Any] = []
    try:
        with av.open(str(p)) as container:
            if not container.streams.video:
                raise RequestError(name, f"video file {str(p)!r} has no video stream")
            for frame in container.decode(video=0):
                if max_pixels is not None and frame.width * frame.height > max_pixels:
                    raise RequestError(name, f"frames of {frame.width}x{frame.height} pixels; at most {max_pixels}")
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) >= frame_cap:
                    break
    except RequestError:
        raise
    except Exception as exc:
        raise RequestError(name, f"video file {str(p)!r} could not be decoded ({type(exc).__name__}: {exc})") from None
    if not frames:
        raise RequestError(name, f"video file {str(p)!r} holds no frame")
    return torch.from_numpy(np.stack(frames).astype(np.uint8, copy=False))


def to_pil(pixels: torch.Tensor) -> Any:
    """uint8 ``[H, W, 3]`` to a ``PIL.Image`` (RGB)."""
    image_mod = _import_pil()
    return image_mod.fromarray(_check_frames(pixels, 3, "pixels").numpy(), mode="RGB")


# --------------------------------------------------------------------------------------------
# Audio
# --------------------------------------------------------------------------------------------


@attrs.define(frozen=True)
class AudioFormat:
    """How one audio file type is written: PyAV's container and encoder, the encoder's sample
    format, and the sample rates it takes (None: any; another rate is resampled to the nearest
    one it takes, never below the source rate when one is available)."""

    name: str
    container: str
    codec: str
    sample_format: str
    media_type: str
    rates: tuple[int, ...] | None = None


_MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
_AAC_RATES = (7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)

#: audio encodings by name (the server's ``response_format`` values; ``pcm`` is raw, no container):
#: 16-bit PCM in wav and flac; mp3 (LAME); Ogg Opus; AAC in ADTS
AUDIO_ENCODINGS: dict[str, AudioFormat] = {
    "wav": AudioFormat("wav", "wav", "pcm_s16le", "s16", "audio/wav"),
    "flac": AudioFormat("flac", "flac", "flac", "s16", "audio/flac"),
    "mp3": AudioFormat("mp3", "mp3", "libmp3lame", "s16p", "audio/mpeg", _MP3_RATES),
    "opus": AudioFormat("opus", "ogg", "libopus", "flt", "audio/ogg", _OPUS_RATES),
    "aac": AudioFormat("aac", "adts", "aac", "fltp", "audio/aac", _AAC_RATES),
    "pcm": AudioFormat("pcm", "s16le", "pcm_s16le", "s16", "audio/pcm"),
}
#: audio file types :func:`write_audio` writes, by suffix (``.ogg`` and ``.opus`` are both Ogg Opus)
AUDIO_FORMATS: dict[str, str] = {".wav": "wav", ".flac": "flac", ".mp3": "mp3", ".ogg": "opus", ".opus": "opus"}
#: channel counts the writers take (the layouts every encoder here knows)
_LAYOUTS = {1: "mono", 2: "stereo"}
#: the most samples one clip may hold (an hour of 48 kHz stereo is 173 M)
MAX_AUDIO_SAMPLES = 3600 * 192_000


def audio_format_of(path: str | os.PathLike[str]) -> str:
    """The encoding :func:`write_audio` uses for ``path`` (by suffix); ``ValueError`` naming the
    suffixes it writes otherwise."""
    suffix = Path(path).suffix.lower()
    fmt = AUDIO_FORMATS.get(suffix)
    if fmt is None:
        raise ValueError(f"unsupported audio type {suffix or '(none)'!r}; use {', '.join(AUDIO_FORMATS)}")
    return fmt


def _check_samples(samples: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """``[channels, n]`` float samples on the CPU as float32, clamped to [-1, 1]; checked."""
    import torch

    if not isinstance(samples, torch.Tensor):
        raise TypeError(f"samples must be a torch.Tensor, got {type(samples).__name__}")
    if samples.ndim != 2 or not samples.is_floating_point():
        raise ValueError(f"samples must be float [channels, n], got {samples.dtype} {list(samples.shape)}")
    if samples.shape[0] not in _LAYOUTS:
        raise ValueError(f"audio of {samples.shape[0]} channels; the writers take {' or '.join(map(str, _LAYOUTS))}")
    if not 1 <= samples.shape[1] <= MAX_AUDIO_SAMPLES:
        raise ValueError(f"audio must hold 1 to {MAX_AUDIO_SAMPLES} samples per channel, got {samples.shape[1]}")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or not 1 <= sample_rate <= 384_000:
        raise ValueError(f"sample_rate must be an integer from 1 to 384000, got {sample_rate!r}")
    x = samples.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("samples hold non-finite values (NaN or inf)")
    return x.clamp(-1.0, 1.0).contiguous()


def _target_rate(rate: int, rates: tuple[int, ...] | None) -> int:
    """``rate`` if the encoder takes it, else the lowest rate above it it takes (else its highest)."""
    if rates is None or rate in rates:
        return rate
    above = [r for r in rates if r >= rate]
    return min(above) if above else max(rates)


def _audio_frames(av: Any, samples: torch.Tensor, sample_rate: int, fmt: AudioFormat, frame_size: int) -> list[Any]:
    """The samples as frames the encoder takes: its sample format, a rate it takes, ``frame_size``
    samples each (the last may be shorter; 0: one frame), pts counted in samples."""
    layout = _LAYOUTS[samples.shape[0]]
    src = av.AudioFrame.from_ndarray(samples.numpy(), format="fltp", layout=layout)
    src.sample_rate = sample_rate
    src.pts = 0
    rate = _target_rate(sample_rate, fmt.rates)
    resampler = av.AudioResampler(format=fmt.sample_format, layout=layout, rate=rate, frame_size=frame_size or None)
    frames = [*resampler.resample(src), *resampler.resample(None)]
    pts = 0
    for f in frames:
        f.pts = pts
        f.time_base = Fraction(1, rate)
        pts += f.samples
    return frames


def _add_audio_stream(container: Any, fmt: AudioFormat, channels: int, sample_rate: int) -> Any:
    rate = _target_rate(sample_rate, fmt.rates)
    try:
        stream = container.add_stream(fmt.codec, rate=rate)
    except Exception as exc:  # a PyAV/FFmpeg build without this encoder
        raise MediaError(f"writing {fmt.name} needs FFmpeg's {fmt.codec} encoder, which this PyAV build lacks "
                         f"({type(exc).__name__}: {exc}); use another format (wav and flac always work)") from None
    stream.layout = _LAYOUTS[channels]
    stream.format = fmt.sample_format
    stream.time_base = Fraction(1, rate)
    stream.codec_context.thread_count = 1  # the same samples give the same bytes
    return stream


def _encode_audio_into(av: Any, container: Any, samples: torch.Tensor, sample_rate: int, fmt: AudioFormat) -> None:
    stream = _add_audio_stream(container, fmt, samples.shape[0], sample_rate)
    stream.codec_context.open()  # so that frame_size is known (0: the encoder takes any length)
    for frame in _audio_frames(av, samples, sample_rate, fmt, stream.codec_context.frame_size):
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)


def pcm_s16(samples: torch.Tensor) -> bytes:
    """Raw 16-bit signed little-endian PCM, channels interleaved (the server's ``pcm``): ``x * 32768``
    rounded and clipped to the int16 range, as FFmpeg converts the other formats' samples."""
    import torch

    x = (samples * 32768.0).round().clamp(-32768, 32767).to(torch.int16)
    return x.t().contiguous().numpy().astype("<i2").tobytes()


def encode_audio(samples: torch.Tensor, sample_rate: int, fmt: str) -> bytes:
    """float samples ``[channels, n]`` in [-1, 1] (clamped) encoded as ``fmt``, one of
    :data:`AUDIO_ENCODINGS`; the file's bytes (``pcm``: raw 16-bit little-endian, interleaved).

    mp3, opus and aac take only some sample rates: another rate is resampled to the nearest higher
    one they take (a decoder then reports that rate). ``ValueError`` for an unknown ``fmt`` or bad
    samples (not ``[1 or 2, n]`` float, non-finite values, a rate outside 1 Hz..384 kHz)."""
    enc = AUDIO_ENCODINGS.get(fmt)
    if enc is None:
        raise ValueError(f"unsupported audio format {fmt!r}; use {', '.join(AUDIO_ENCODINGS)}")
    x = _check_samples(samples, sample_rate)
    if fmt == "pcm":
        return pcm_s16(x)
    av = _import_av()
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=enc.container) as container:
        _encode_audio_into(av, container, x, sample_rate, enc)
    return buf.getvalue()


def write_audio(samples: torch.Tensor, sample_rate: int, path: str | os.PathLike[str]) -> Path:
    """Write float samples ``[channels, n]`` as the audio type of ``path``'s suffix (see
    :data:`AUDIO_FORMATS`: ``.wav``, ``.flac``, ``.mp3``, ``.ogg``/``.opus``), atomically; return
    the path. ``ValueError`` for another suffix (check it before any compute: :func:`audio_format_of`)."""
    fmt = audio_format_of(path)
    data = encode_audio(samples, sample_rate, fmt)
    with _atomic_path(path, Path(path).suffix.lower()) as tmp:
        tmp.write_bytes(data)
    return Path(path)


__all__ = [
    "AUDIO_ENCODINGS",
    "AUDIO_FORMATS",
    "IMAGE_FORMATS",
    "AudioFormat",
    "MediaError",
    "audio_format_of",
    "check_writable",
    "clean_stale_temp_files",
    "encode_audio",
    "pad_to_even",
    "pcm_s16",
    "read_image",
    "read_video",
    "to_pil",
    "write_audio",
    "write_image",
    "write_mp4",
    "write_png",
]
