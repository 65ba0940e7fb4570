"""Where the tone-demo checkpoint lives (package data) and why it may be missing.

The package ships ``checkpoint/``: a diffusers ``StableAudioPipeline`` folder whose VAE is stored
as its two linear projections (``vae/linear_oobleck.safetensors``, 16 KB, instead of the
``AutoencoderOobleck``'s 3.4 MB of mostly fixed zero and 0/1 weights: :mod:`.linear_vae`) and
whose other weights are float16 (they load as float32, or as the runtime's dtype). The runtime
and diffusers load complete folders, so the first use writes one, built from the shipped files,
into a cache folder (:func:`cache_root`: ``$OMNILOOP_TONE_DEMO_CACHE``, else
``$XDG_CACHE_HOME/omniloop/tone-demo``, else ``~/.cache/omniloop/tone-demo``), named by a hash of
the shipped files; later uses find it there.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
VAE_WEIGHTS = "vae/diffusion_pytorch_model.safetensors"
VAE_COMPACT = "vae/linear_oobleck.safetensors"

#: the files a usable checkpoint folder has (a diffusers StableAudioPipeline folder + omniloop.json);
#: a shipped folder may hold :data:`VAE_COMPACT` instead of :data:`VAE_WEIGHTS`
REQUIRED = ("model_index.json", "omniloop.json", "scheduler/scheduler_config.json", "tokenizer/tokenizer.json",
            "text_encoder/config.json", "text_encoder/model.safetensors",
            "projection_model/config.json", "projection_model/diffusion_pytorch_model.safetensors",
            "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors",
            "vae/config.json", VAE_WEIGHTS)


def shipped_dir() -> Path:
    """The checkpoint folder as shipped in this package (maybe with the compact VAE)."""
    return PACKAGE_DIR / "checkpoint"


def cache_root() -> Path:
    """Where complete folders built from a compact checkpoint go."""
    env = os.environ.get("OMNILOOP_TONE_DEMO_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "omniloop" / "tone-demo"


def checkpoint_missing(folder: Path | None = None) -> str | None:
    """Why the tone-demo checkpoint cannot be used (``None`` when it can); a folder with the
    compact VAE counts as complete."""
    folder = folder or shipped_dir()
    missing = [n for n in REQUIRED if not (folder / n).is_file()
               and not (n == VAE_WEIGHTS and (folder / VAE_COMPACT).is_file())]
    if not missing:
        return None
    return (f"the tone-demo weights are not installed ({folder.name}/{missing[0]} is missing"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}); train them with "
            "bash demos/tone-demo/scripts/gpu_train.sh (or python -m omniloop_tone_demo_training.train --out DIR) "
            "and copy DIR/checkpoint to omniloop_tone_demo/checkpoint")


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(f.relative_to(folder).as_posix().encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def materialize(folder: Path, root: Path | None = None) -> Path:
    """A complete diffusers folder for ``folder``: ``folder`` itself when it holds the full VAE
    weights, else ``root/<hash>/`` (built once: the shipped files copied, the VAE's weights written
    from its projections; a temporary folder renamed into place, so a concurrent or interrupted
    build never leaves a half-written folder under the final name)."""
    if not (folder / VAE_COMPACT).is_file() or (folder / VAE_WEIGHTS).is_file():
        return folder
    root = root or cache_root()
    final = root / f"checkpoint-{_digest(folder)}"
    if (final / VAE_WEIGHTS).is_file() and checkpoint_missing(final) is None:
        return final
    from .linear_vae import load_compact

    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    except OSError as e:
        raise OSError(f"cannot write the tone-demo cache folder {root} ({e.strerror or e}); "
                      "set OMNILOOP_TONE_DEMO_CACHE to a writable folder") from None
    try:
        if final.exists():  # damaged (a file deleted by hand): built again
            shutil.rmtree(final)
        build = tmp / "checkpoint"
        shutil.copytree(folder, build, ignore=shutil.ignore_patterns(Path(VAE_COMPACT).name, "__pycache__"))
        load_compact(folder / "vae").save_pretrained(str(build / "vae"), safe_serialization=True)
        try:
            build.rename(final)
        except OSError:  # another process finished first
            if checkpoint_missing(final) is not None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def checkpoint_dir() -> Path:
    """The diffusers-format ``StableAudioPipeline`` folder of the shipped weights (built in the
    cache on first use when the package ships the compact VAE; the shipped folder itself when it
    holds no weights: :func:`checkpoint_missing` says what is missing)."""
    folder = shipped_dir()
    if checkpoint_missing(folder) is not None:
        return folder
    return materialize(folder)
