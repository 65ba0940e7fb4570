"""Writing a finished output to files, and the short human summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from .app import fail


def _primary_frames(output: Any) -> tuple[Any, float] | None:
    """The output's main picture as uint8 ``[T, H, W, 3]`` frames and fps, or None."""
    from omniloop.artifacts import Image, VideoFrames

    for art in output.artifacts.values():
        if isinstance(art, VideoFrames):
            return art.frames, float(art.fps)
    for art in output.artifacts.values():
        if isinstance(art, Image):
            return art.pixels.unsqueeze(0), 1.0
    return None


def write_outputs(output: Any, path: Path, *, latents: bool = False) -> dict[str, Path]:
    """Write the video (``.mp4``) or image (``.png``/``.webp``: an ``Image`` artifact, or a video of
    one frame) to ``path``; with ``latents``, the final latents beside it (``<stem>.latents.pt``)."""
    from omniloop import media

    files: dict[str, Path] = {}
    picture = _primary_frames(output)
    if picture is not None:
        frames, fps = picture
        if path.suffix.lower() in media.IMAGE_FORMATS:
            if frames.shape[0] != 1:
                fail(f"--out: a {path.suffix.lower()} holds one frame; the output has {frames.shape[0]} (use .mp4)")
            files["output"] = Path(media.write_image(frames[0], path))
        else:
            files["output"] = Path(media.write_mp4(frames, fps, path))
    art = output.artifacts.get("latents") if latents else None
    if art is not None and getattr(art, "tensor", None) is not None:
        import torch

        lpath = path.with_name(path.stem + ".latents.pt")
        lpath.parent.mkdir(parents=True, exist_ok=True)
        torch.save(art.tensor.detach().cpu(), lpath)
        files["latents"] = lpath
    return files


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return " ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


#: the deploy's compute settings and their defaults: the summary names those changed from these
COMPUTE_DEFAULTS: dict[str, Any] = {"attention_backend": "sdpa", "linear_precision": "dtype", "compile": False}


def compute_settings(runtime: Any) -> dict[str, Any]:
    """How the deploy computes (``dtype``, attention backend, linear precision, compile): reported
    with every ``omniloop generate`` (``compute`` in ``--json``), since they change speed and, for
    distribution-altering choices such as ``linear_precision: fp8``, the output itself."""
    deploy = getattr(runtime, "deploy", None)
    if deploy is None:
        return {}
    out = {"dtype": getattr(deploy, "dtype", None), **{k: getattr(deploy, k, v) for k, v in COMPUTE_DEFAULTS.items()}}
    chosen = getattr(getattr(runtime, "attention", None), "name", None)
    if chosen:  # the backend that runs (``attention_backend: auto`` resolved at load)
        out["attention_backend"] = chosen
    return out


def summarize(con: Console, output: Any, files: dict[str, Path], load_seconds: float,
              compute: dict[str, Any] | None = None) -> None:
    m = output.metrics
    if "output" in files:
        picture = _primary_frames(output)
        shape = ""
        if picture is not None:
            frames, fps = picture
            t, h, w = frames.shape[:3]
            shape = f" ({t} frame{'s' if t != 1 else ''}, {w}x{h}" + (f", {fps:g} fps)" if t > 1 else ")")
        con.print(f"[bold green]wrote[/] {escape(str(files['output']))}{shape}")
    for kind, p in files.items():
        if kind != "output":
            con.print(f"[bold green]wrote[/] {escape(str(p))} ({kind})")
    status = output.status.value
    color = "green" if output.ok else "red"
    parts = [f"[{color}]{status}[/]", f"{_fmt(m.get('total_seconds', 0.0))} s", f"{m.get('steps', 0)} steps"]
    if "seed" in m:
        parts.append(f"seed {m['seed']}")
    parts.append(f"load {load_seconds:.3g} s")
    con.print("  " + " · ".join(parts))
    changed = {k: v for k, v in (compute or {}).items() if k in COMPUTE_DEFAULTS and v != COMPUTE_DEFAULTS[k]}
    if changed:
        names = {"attention_backend": "attention", "linear_precision": "linears"}
        con.print("  compute: " + " · ".join("compile" if k == "compile" else f"{names[k]} {escape(str(v))}"
                                           for k, v in changed.items()), highlight=False)
    if m.get("node_seconds"):
        con.print("  nodes: " + ", ".join(f"{escape(n)} {s:.3g} s" for n, s in m["node_seconds"].items()))
    for name, per_branch in (m.get("plugins") or {}).items():
        if isinstance(per_branch, dict):
            for branch, vals in per_branch.items():
                con.print(f"  plugin {escape(name)} [{escape(str(branch))}]: {escape(_fmt(vals))}", highlight=False)
        else:
            con.print(f"  plugin {escape(name)}: {escape(_fmt(per_branch))}", highlight=False)
    for w in m.get("warnings") or []:
        con.print(f"  [yellow]warning:[/] {escape(str(w))}")
