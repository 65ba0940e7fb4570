"""Install a trained v2 session's files into the package (CPU, run once by whoever ships):

    python -m omniloop_wan_demo_training.v2 --ship FILES_AT          # the folder with pipeline.tar / fast.tar

* ``pipeline.tar`` -> ``checkpoint/`` (wan-demo v2, every component). Before it is replaced,
  ``checkpoint_causal/``'s links to wan-demo's ``vae``, ``text_encoder``, ``tokenizer``,
  ``scheduler`` and ``model_index.json`` become real copies of v1's (5.6 MB): the causal variant's
  transformer was fine-tuned from v1 and only matches v1's VAE latent space and text encoder.
  The package's ``tokenizer/`` gets v2's tokenizer (v1's ids unchanged, new words appended).
* ``fast.tar`` -> ``checkpoint_fast/``: its own ``transformer/`` and ``omniloop.json``; the rest
  are relative links to ``checkpoint/`` (:data:`~..checkpoint_path.FAST_SHARED`).
* Both installed ``omniloop.json`` files get ``"vocabulary"`` (the 16 words of the video prompts,
  ``data.vocabulary_words("video")``) unless they already name one: the CLI warns on other words.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from omniloop_wan_demo.checkpoint_path import CAUSAL_SHARED, FAST_SHARED, PACKAGE_DIR

from .common import untar

PIPELINE_PARTS = ("vae", "transformer", "text_encoder", "tokenizer", "scheduler", "model_index.json", "omniloop.json")


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


def _copy(src: Path, dst: Path) -> None:
    _remove(dst)
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=False)
    else:
        shutil.copyfile(src, dst)
    for f in [dst, *dst.rglob("*")] if dst.is_dir() else [dst]:
        os.chmod(f, 0o755 if f.is_dir() else 0o644)  # package data: readable by everyone


#: what every shipped wan-demo checkpoint declares besides its vocabulary (omniloop.limits): the
#: size it was trained at, so requests outside it are refused, and its one task
DECLARATIONS = {
    "limits": {"min_height": 64, "max_height": 64, "min_width": 64, "max_width": 64, "max_frames": 17,
               "note": "trained on 17-frame 64x64 clips"},
    "tasks": ["t2v"],
}


def _add_vocabulary(meta: Path) -> None:
    """The vocabulary and :data:`DECLARATIONS`, unless the file already has them."""
    from .render import vocabulary_words

    info = json.loads(meta.read_text())
    if not isinstance(info, dict):
        raise ValueError(f"ship: {meta} is not a JSON object")
    changed = False
    if "vocabulary" not in info:
        info["vocabulary"] = sorted(vocabulary_words("video"))
        changed = True
    for key, value in DECLARATIONS.items():
        if key not in info:
            info[key] = value
            changed = True
    if changed:
        meta.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def _extract(src: Path, name: str, tmp: Path) -> Path | None:
    if (src / name).is_dir():
        return src / name
    if (src / f"{name}.tar").is_file():
        untar(src / f"{name}.tar", tmp)
        if not (tmp / name).is_dir():
            raise ValueError(f"ship: {src / f'{name}.tar'} holds no {name}/ folder")
        return tmp / name
    return None


def ship_fast_lora(lora: Path, package: Path | None = None, training: dict[str, Any] | None = None) -> dict[str, Any]:
    """wan-demo-fast as wan-demo + a LoRA (``dmd_fast``'s ``fast_lora.safetensors``): the file
    becomes ``adapters/fast.safetensors`` (what ``--adapter fast`` loads, and what the
    ``wan-demo-fast`` preset fuses at load), ``checkpoint_fast/transformer`` a link to wan-demo's,
    and ``checkpoint_fast/omniloop.json``'s ``training`` says so."""
    pkg = Path(package) if package is not None else PACKAGE_DIR
    ck, fast_dst = pkg / "checkpoint", pkg / "checkpoint_fast"
    (pkg / "adapters").mkdir(exist_ok=True)
    _copy(Path(lora), pkg / "adapters" / "fast.safetensors")
    link = fast_dst / "transformer"
    _remove(link)
    link.symlink_to(os.path.relpath(ck / "transformer", fast_dst))
    meta = json.loads((fast_dst / "omniloop.json").read_text())
    if training is not None:
        meta["training"] = training
    (fast_dst / "omniloop.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return {"adapter": str(pkg / "adapters" / "fast.safetensors"), "checkpoint_fast": str(fast_dst)}


def ship(src: Path, package: Path | None = None) -> dict[str, Any]:
    """Install ``src``'s ``pipeline.tar`` and/or ``fast.tar`` (or extracted ``pipeline/`` /
    ``fast/``) into ``package`` (default: this package). Returns what was done."""
    pkg = Path(package) if package is not None else PACKAGE_DIR
    ck, causal, fast_dst = pkg / "checkpoint", pkg / "checkpoint_causal", pkg / "checkpoint_fast"
    done: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        pipe = _extract(Path(src), "pipeline", tmp)
        fast = _extract(Path(src), "fast", tmp)
        if pipe is None and fast is None:
            raise ValueError(f"ship: {src} has neither pipeline.tar nor fast.tar")
        if pipe is not None:
            missing = [n for n in PIPELINE_PARTS if not (pipe / n).exists()]
            if missing:
                raise ValueError(f"ship: {pipe} lacks {missing[0]}")
            if causal.is_dir():  # keep v1's shared parts for the causal variant, as real files
                kept = []
                for name in CAUSAL_SHARED:
                    p = causal / name
                    if p.is_symlink():
                        target = p.resolve()
                        p.unlink()
                        _copy(target, p)
                        kept.append(name)
                done["checkpoint_causal_kept_v1"] = kept
            for name in PIPELINE_PARTS:
                _copy(pipe / name, ck / name)
            _copy(pipe / "tokenizer", pkg / "tokenizer")
            _add_vocabulary(ck / "omniloop.json")
            done["checkpoint"] = str(ck)
        if fast is not None:
            for f in ("transformer/config.json", "transformer/diffusion_pytorch_model.safetensors", "omniloop.json"):
                if not (fast / f).is_file():
                    raise ValueError(f"ship: {fast / f} is missing")
            fast_dst.mkdir(exist_ok=True)
            _copy(fast / "transformer", fast_dst / "transformer")
            _copy(fast / "omniloop.json", fast_dst / "omniloop.json")
            _add_vocabulary(fast_dst / "omniloop.json")
            for name in FAST_SHARED:
                link = fast_dst / name
                _remove(link)
                link.symlink_to(os.path.relpath(ck / name, fast_dst))
            done["checkpoint_fast"] = str(fast_dst)
    return done
