"""Install a trained v2 session's files into the package (CPU, run once by whoever ships):

    python -m omniloop_wan_demo_training.v2 --ship FILES_AT          # the folder with pipeline.tar / fast.tar / fast_lora.safetensors

* ``pipeline.tar`` -> ``checkpoint/`` (wan-demo v2, every component). Before it is replaced,
  ``checkpoint_causal/``'s links to wan-demo's ``vae``, ``text_encoder``, ``tokenizer``,
  ``scheduler`` and ``model_index.json`` become real copies of v1's (5.6 MB): the causal variant's
  transformer was fine-tuned from v1 and only matches v1's VAE latent space and text encoder.
  The package's ``tokenizer/`` gets v2's tokenizer (v1's ids unchanged, new words appended).
* ``fast.tar`` -> ``checkpoint_fast/``: its own ``transformer/`` and ``omniloop.json``; the rest
  are relative links to ``checkpoint/`` (:data:`~..checkpoint_path.FAST_SHARED`).
* ``fast_lora.safetensors`` (+ ``result.json``, :mod:`.dmd_fast`'s output) -> ``adapters/fast.safetensors``
  and ``checkpoint_fast/transformer`` a link to ``checkpoint/``'s (:func:`ship_fast_lora`): wan-demo-fast
  becomes v2 with that LoRA fused at load.
* :func:`ship_decoder` (``decoder_specks --ship DIR``): a fine-tuned decoder (same encoder, same
  config) -> ``checkpoint/vae/``, the shared decoder of wan-demo, wan-demo-fast and the ``fast``
  adapter; a student that keeps the decoder it was measured with (``wan-demo-causal``) gets a real
  copy of the old one first, in place of its link.
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
    from .common import DEMO_DEFAULTS
    from .distill import FAST_TIMESTEPS, GRID_SHIFT

    pkg = Path(package) if package is not None else PACKAGE_DIR
    ck, fast_dst = pkg / "checkpoint", pkg / "checkpoint_fast"
    (pkg / "adapters").mkdir(exist_ok=True)
    _copy(Path(lora), pkg / "adapters" / "fast.safetensors")
    fast_dst.mkdir(exist_ok=True)
    for name in ("transformer", *FAST_SHARED):
        link = fast_dst / name
        _remove(link)
        link.symlink_to(os.path.relpath(ck / name, fast_dst))
    meta_file = fast_dst / "omniloop.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {
        "variant": "wan-demo-fast",
        "defaults": dict(DEMO_DEFAULTS, steps=len(FAST_TIMESTEPS), guidance_scale=1.0, sampler="few-step",
                         sampler_options={"few-step": {"timesteps": list(FAST_TIMESTEPS), "grid_shift": GRID_SHIFT}})}
    if training is not None:
        meta["training"] = training
    meta_file.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    _add_vocabulary(meta_file)
    return {"adapter": str(pkg / "adapters" / "fast.safetensors"), "checkpoint_fast": str(fast_dst)}


#: the student folders whose ``vae`` stays the decoder they were measured with when wan-demo's
#: decoder is replaced (:func:`ship_decoder`): a decoder fine-tuned on one student's latents may cost
#: another its shapes (wan-demo-causal's run 3 lost ~2 points with the speck-trained decoder of
#: 2026-12-05; docs/wan-demo-recipe-and-measurements.md, "Session 12"). Its run 4 (2026-12-06) was
#: measured with wan-demo's current decoder and links it again.
KEEP_DECODER = ("checkpoint_causal",)
VAE_WEIGHTS = "diffusion_pytorch_model.safetensors"


def _decoder_check(new: Path, old: Path) -> None:
    """Refuse a ``vae/`` folder that is not wan-demo's VAE with only its decoder changed: the same
    config (but ``_name_or_path``), the same tensors, and the encoder's bit for bit (the denoisers'
    latent space)."""
    from safetensors.torch import load_file

    for f in ("config.json", VAE_WEIGHTS):
        if not (new / f).is_file():
            raise ValueError(f"ship: {new / f} is missing (a vae/ folder in diffusers' layout is expected)")
    cfg_new, cfg_old = (json.loads((d / "config.json").read_text()) for d in (new, old))
    for cfg in (cfg_new, cfg_old):
        cfg.pop("_name_or_path", None)
    if cfg_new != cfg_old:
        diff = sorted(k for k in set(cfg_new) | set(cfg_old) if cfg_new.get(k) != cfg_old.get(k))
        raise ValueError(f"ship: {new / 'config.json'} differs from the shipped VAE's in {', '.join(diff)}")
    a, b = load_file(str(new / VAE_WEIGHTS)), load_file(str(old / VAE_WEIGHTS))
    if {k: tuple(v.shape) for k, v in a.items()} != {k: tuple(v.shape) for k, v in b.items()}:
        raise ValueError(f"ship: {new / VAE_WEIGHTS} does not hold the shipped VAE's tensors")
    enc = [k for k in a if k.startswith(("encoder.", "quant_conv.")) and not (a[k].dtype == b[k].dtype and a[k].equal(b[k]))]
    if enc:
        raise ValueError(f"ship: {new / VAE_WEIGHTS} changes the encoder ({enc[0]}, {len(enc)} tensor(s)); only the "
                         "decoder may change, or every trained denoiser's latent space moves")


def ship_decoder(vae: Path, package: Path | None = None) -> dict[str, Any]:
    """Install a fine-tuned decoder (``decoder_specks``' ``vae/``) as wan-demo's ``checkpoint/vae``.
    The folders in :data:`KEEP_DECODER` that link to it get a real copy of the current one first.
    Returns what was done."""
    pkg = Path(package) if package is not None else PACKAGE_DIR
    dest = pkg / "checkpoint" / "vae"
    vae = Path(vae)
    if (vae / "vae" / "config.json").is_file():  # decoder_specks' --out folder
        vae = vae / "vae"
    _decoder_check(vae, dest)
    kept = []
    for name in KEEP_DECODER:
        link = pkg / name / "vae"
        if link.is_symlink():
            link.unlink()
            _copy(dest, link)
            kept.append(name)
    shutil.copyfile(vae / VAE_WEIGHTS, dest / VAE_WEIGHTS)
    os.chmod(dest / VAE_WEIGHTS, 0o644)
    done: dict[str, Any] = {"vae": str(dest), "kept_old_decoder": kept}
    log = vae.parent / "decoder_specks.json"  # decoder_specks' record, beside its vae/
    meta_file = pkg / "checkpoint" / "omniloop.json"
    if log.is_file() and meta_file.is_file():
        done["history"] = _record_decoder(meta_file, json.loads(log.read_text()))
    return done


def _record_decoder(meta_file: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Append the decoder fine-tune to ``omniloop.json``'s ``training.history`` (as the other
    decoder phases are recorded)."""
    import datetime as dt

    args = info.get("args", {})
    after = info.get("recon_after") or {}
    entry: dict[str, Any] = {
        "phase": "decoder_specks", "session": dt.date.today().isoformat(),
        "trained": "decoder + post_quant_conv (encoder frozen) on student latents' specks",
        "steps": int(info.get("steps", 0)), "seconds": float(info.get("seconds", 0.0)),
        "speck_clips": int(info.get("speck_clips", 0)), "other_clips": int(info.get("other_clips", 0)),
        **{k: float(args[k]) for k in ("lr", "speck_weight", "trail_weight") if k in args},
        **({"batch": int(args["batch"])} if "batch" in args else {}),
        **({"recon_psnr": after["psnr"]} if "psnr" in after else {}),
        # a focused run (decoder_specks --focus): which rendered clips were drawn more often, and how many
        **({"focus": str(args["focus"]), "focus_frac": float(args.get("focus_frac", 0.5))}
           if args.get("focus") not in (None, "None") else {}),
        **({"recon_shape_by_colour": after["shape_by_colour"]} if "shape_by_colour" in after else {}),
    }
    meta = json.loads(meta_file.read_text())
    meta.setdefault("training", {}).setdefault("history", []).append(entry)
    meta_file.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return entry


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
        lora = Path(src) / "fast_lora.safetensors"  # dmd_fast's output: wan-demo-fast as v2 + a LoRA
        if pipe is None and fast is None and not lora.is_file():
            raise ValueError(f"ship: {src} has neither pipeline.tar nor fast.tar (nor a dmd_fast fast_lora.safetensors)")
        if fast is not None and lora.is_file():
            raise ValueError(f"ship: {src} has both fast.tar and fast_lora.safetensors; ship one wan-demo-fast")
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
        if lora.is_file():
            result = Path(src) / "result.json"
            info = json.loads(result.read_text()) if result.is_file() else {}
            training = {"from": "wan-demo v2", "method": "DMD2 (omniloop_wan_demo_training.dmd_fast)",
                        **{k: info[k] for k in ("recipe", "extraction") if k in info},
                        **{k: v for k, v in info.get("training", {}).items() if k != "log"}}
            done.update(ship_fast_lora(lora, pkg, training=training))
    return done
