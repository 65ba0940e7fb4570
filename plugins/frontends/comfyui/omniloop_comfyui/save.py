"""Write a job's outputs the way ComfyUI's save nodes write them.

* the IMAGE tensor is float ``[0, 1]``; ComfyUI turns it into bytes with
  ``np.clip(255. * x, 0, 255).astype(np.uint8)``. The runtime's artifacts are uint8 already
  (the family's decode, diffusers' rounding), so the IMAGE is ``u8 / 255`` in float32 and ComfyUI's
  conversion gives the runtime's bytes back exactly (all 256 levels; tested). A file written here
  therefore equals the native request's output.
* ``SaveImage``: PNG, ``compress_level=4``, text chunks ``prompt`` (the API graph) and one per
  ``extra_pnginfo`` key (the editor sends ``workflow``); ``<prefix>_<counter:05>_.png``.
* ``SaveAnimatedWEBP``: Pillow, ``lossless``, ``quality``, ``method`` (default 4, fastest 0,
  slowest 6), ``duration = int(1000 / fps)``; ``SaveWEBM``: PyAV (vp9 / av1, crf);
  ``SaveVideo``: mp4 (H.264) through :func:`omniloop_io.media.write_mp4`.

File names: ``filename_prefix`` may name subfolders (``video/ComfyUI``); the compiler allows only
plain names; every path is resolved and refused unless inside the output folder. Files are written
to a temporary name and renamed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from .compiler import SaveSpec

WEBP_METHODS = {"default": 4, "fastest": 0, "slowest": 6}
SUFFIX = {"image": "png", "webp": "webp", "webm": "webm", "video": "mp4"}


class OutputPathError(Exception):
    pass


def comfy_image(frames_u8: Any) -> np.ndarray:
    """The runtime's uint8 frames ``[T, H, W, 3]`` (or ``[H, W, 3]``) as ComfyUI's IMAGE (float32 in [0, 1])."""
    arr = np.asarray(frames_u8.numpy() if hasattr(frames_u8, "numpy") else frames_u8)
    if arr.ndim == 3:
        arr = arr[None]
    return arr.astype(np.float32) / np.float32(255.0)


def to_bytes(image: np.ndarray) -> np.ndarray:
    """ComfyUI's pixel conversion: ``np.clip(255. * x, 0, 255).astype(np.uint8)``."""
    return np.clip(255.0 * image, 0, 255).astype(np.uint8)


def _target(output_dir: Path, prefix: str, suffix: str) -> tuple[Path, str, str]:
    root = Path(output_dir).resolve()
    sub, _, base = prefix.rpartition("/")
    folder = (root / sub).resolve() if sub else root
    if folder != root and root not in folder.parents:
        raise OutputPathError(f"{prefix!r} leaves the output folder")
    folder.mkdir(parents=True, exist_ok=True)
    pattern = re.compile(re.escape(base) + r"_(\d{5,})_\." + suffix + "$")
    counter = 1 + max((int(m.group(1)) for p in folder.iterdir() if (m := pattern.match(p.name))), default=0)
    name = f"{base}_{counter:05}_.{suffix}"
    path = (folder / name).resolve()
    if path.parent != folder:
        raise OutputPathError(f"{name!r} leaves its folder")
    return path, name, sub


def write_save(spec: SaveSpec, frames_u8: Any, fps: float, output_dir: Path, *, prompt: dict[str, Any] | None = None,
               extra_pnginfo: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Write one save node's files; returns ComfyUI's ``[{filename, subfolder, type}]``."""
    from PIL import Image, PngImagePlugin

    image = comfy_image(frames_u8)
    kind = spec.kind
    path, name, sub = _target(output_dir, spec.prefix, SUFFIX[kind])
    tmp = path.with_name(f".{name}.tmp")
    results = []
    try:
        if kind == "image":  # one file per image of the batch, as ComfyUI
            for k in range(image.shape[0]):
                if k:
                    path, name, sub = _target(output_dir, spec.prefix, "png")
                    tmp = path.with_name(f".{name}.tmp")
                info = PngImagePlugin.PngInfo()
                if prompt is not None:
                    info.add_text("prompt", json.dumps(prompt))
                for key, value in (extra_pnginfo or {}).items():
                    info.add_text(str(key), json.dumps(value))
                Image.fromarray(to_bytes(image[k])).save(tmp, format="PNG", pnginfo=info, compress_level=4)
                os.replace(tmp, path)
                results.append({"filename": name, "subfolder": sub, "type": "temp" if spec.temp else "output"})
            return results
        if kind == "webp":
            o = spec.options
            pil = [Image.fromarray(to_bytes(f)) for f in image]
            exif = Image.Exif()
            if prompt is not None:
                exif[0x0110] = "prompt:" + json.dumps(prompt)
            pil[0].save(tmp, format="WEBP", save_all=True, duration=int(1000.0 / float(o["fps"])), append_images=pil[1:],
                        exif=exif, lossless=bool(o["lossless"]), quality=int(o["quality"]),
                        method=WEBP_METHODS[o["method"]])
        elif kind == "webm":
            _write_webm(tmp, to_bytes(image), spec.options)
        elif kind == "video":
            import torch

            from omniloop_io.media import write_mp4

            write_mp4(torch.from_numpy(to_bytes(image)), float(spec.options.get("fps") or fps), tmp.with_suffix(".mp4"))
            os.replace(tmp.with_suffix(".mp4"), path)
            return [{"filename": name, "subfolder": sub, "type": "output"}]
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return [{"filename": name, "subfolder": sub, "type": "output"}]


def _write_webm(path: Path, frames: np.ndarray, options: dict[str, Any]) -> None:
    from fractions import Fraction

    from omniloop_io.media import _import_av

    av = _import_av()
    codec = {"vp9": "libvpx-vp9", "av1": "libsvtav1"}[options["codec"]]
    with av.open(str(path), mode="w", format="webm") as container:
        stream = container.add_stream(codec, rate=Fraction(round(float(options["fps"]) * 1000), 1000))
        stream.width, stream.height = frames.shape[2] // 2 * 2, frames.shape[1] // 2 * 2
        stream.pix_fmt = "yuv420p"
        stream.bit_rate = 0
        stream.options = {"crf": str(int(options["crf"]))}
        for f in frames:
            frame = av.VideoFrame.from_ndarray(f[: stream.height, : stream.width], format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def output_frames(output: Any) -> tuple[Any, float]:
    """The uint8 frames ``[T, H, W, 3]`` and fps of a finished request's output (image or video)."""
    video = output.artifacts.get("video")
    if video is not None and getattr(video, "frames", None) is not None:
        return video.frames, float(video.fps)
    image = output.artifacts.get("image")
    if image is not None and getattr(image, "pixels", None) is not None:
        return image.pixels[None], 0.0
    raise ValueError("the request produced no image or video")


def write_job_outputs(job: Any, output: Any, output_dir: Path, *, prompt: dict[str, Any] | None = None,
                      extra_pnginfo: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Every save node of ``job``: ``{node_id: {"images": [...], "animated": [...]}}`` (ComfyUI's ui outputs)."""
    frames, fps = output_frames(output)
    out: dict[str, dict[str, Any]] = {}
    for spec in job.saves:
        files = write_save(spec, frames, fps, output_dir, prompt=prompt, extra_pnginfo=extra_pnginfo)
        entry: dict[str, Any] = {"images": files}
        if spec.kind != "image":
            entry["animated"] = [True]
        out[spec.node_id] = entry
    return out
