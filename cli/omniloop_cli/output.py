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


def _primary_audio(output: Any) -> Any:
    """The output's sound (an ``Audio`` artifact: ``audio`` first), or None."""
    from omniloop.artifacts import Audio

    art = output.artifacts.get("audio")
    if isinstance(art, Audio):
        return art
    return next((a for a in output.artifacts.values() if isinstance(a, Audio)), None)


def write_outputs(output: Any, path: Path, *, latents: bool = False) -> dict[str, Path]:
    """Write the video (``.mp4``, with the output's audio muxed as an AAC track when it has one),
    image (``.png``/``.webp``: an ``Image`` artifact, or a video of one frame) or audio (``.wav``,
    ``.flac``, ``.mp3``, ``.ogg``/``.opus``: the ``Audio`` artifact alone) to ``path``; with
    ``latents``, the final latents beside it (``<stem>.latents.pt``)."""
    from omniloop_io import media

    files: dict[str, Path] = {}
    picture = _primary_frames(output)
    sound = _primary_audio(output)
    suffix = path.suffix.lower()
    if suffix in media.AUDIO_FORMATS:
        if sound is None:
            fail(f"--out: a {suffix} holds audio; the output has none")
        files["output"] = Path(media.write_audio(sound.samples, int(sound.sample_rate), path))
    elif picture is not None:
        frames, fps = picture
        if suffix in media.IMAGE_FORMATS:
            if frames.shape[0] != 1:
                fail(f"--out: a {suffix} holds one frame; the output has {frames.shape[0]} (use .mp4)")
            files["output"] = Path(media.write_image(frames[0], path))
        else:
            track = (sound.samples, int(sound.sample_rate)) if sound is not None else None
            files["output"] = Path(media.write_mp4(frames, fps, path, audio=track))
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
    options = getattr(deploy, "linear_precision_options", None)
    if options:  # e.g. omniloop-quant's fp8 keep: layers left in the deploy dtype
        out["linear_precision_options"] = dict(options)
    chosen = getattr(getattr(runtime, "attention", None), "name", None)
    if chosen:  # the backend that runs (``attention_backend: auto`` resolved at load)
        out["attention_backend"] = chosen
    return out


def summarize(con: Console, output: Any, files: dict[str, Path], load_seconds: float,
              compute: dict[str, Any] | None = None) -> None:
    m = output.metrics
    if "output" in files:
        picture = _primary_frames(output)
        sound = _primary_audio(output)
        shape = ""
        if picture is not None and files["output"].suffix.lower() in (".mp4", ".png", ".webp"):
            frames, fps = picture
            t, h, w = frames.shape[:3]
            shape = f" ({t} frame{'s' if t != 1 else ''}, {w}x{h}" + (f", {fps:g} fps" if t > 1 else "")
            shape += ", with sound)" if sound is not None and files["output"].suffix.lower() == ".mp4" else ")"
        elif sound is not None:
            c, n = sound.samples.shape
            shape = f" ({n / sound.sample_rate:.3g} s, {sound.sample_rate} Hz, {'mono' if c == 1 else f'{c} channels'})"
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
        parts = ["compile" if k == "compile" else f"{names[k]} {escape(str(v))}" for k, v in changed.items()]
        if "linear_precision" in changed and (compute or {}).get("linear_precision_options"):
            parts[list(changed).index("linear_precision")] += " " + escape(_fmt(compute["linear_precision_options"]))
        con.print("  compute: " + " · ".join(parts), highlight=False)
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
