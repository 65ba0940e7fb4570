"""One time-boxed training session: data pool -> VAE -> transformer + text encoders -> evaluation.

    python -m omniloop_flux_demo_training.gpu_run --out $OUT --vae-seconds 75 --dit-seconds 240
    python -m omniloop_flux_demo_training.gpu_run --out $OUT --resume DIR --vae-seconds 0 --dit-seconds 240
    python -m omniloop_flux_demo_training.gpu_run --out /tmp/fd --smoke          # CPU, every phase, < 2 min

Writes into ``--out`` (8 files at most, each < 16 MiB, no sub-folders — what the GPU tool brings
back): ``pipeline.tar`` (the diffusers FluxPipeline folder with the EMA weights, transformer and VAE
fp16, ``omniloop.json``), ``vae.safetensors`` (fp32 VAE), ``raw-dit.safetensors`` and
``ema-dit.safetensors`` (fp32 transformer + text encoders, raw and EMA: ``--resume`` reads these
three and ``train.json``), ``train.json`` (recipe, timings, losses, latent statistics),
``eval.json`` (detector scores of images sampled from the saved fp16 pipeline), ``samples.png``
(one row per colour, shapes x positions) and, from the shell script, ``log.txt``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

DIT_KEYS = ("transformer", "text_encoder", "text_encoder_2")
RESUME_FILES = ("vae.safetensors", "raw-dit.safetensors", "ema-dit.safetensors", "train.json")


class UsageError(ValueError):
    """A bad command-line value (one line, exit code 2)."""


def _positive_seconds(name: str, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{name} must be a finite number of seconds >= 0, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m omniloop_flux_demo_training.gpu_run", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (created; files land directly in it)")
    p.add_argument("--vae-seconds", type=float, default=75.0)
    p.add_argument("--dit-seconds", type=float, default=240.0)
    p.add_argument("--resume", type=Path, default=None, help="a previous session's --out (its VAE is reused)")
    p.add_argument("--smoke", action="store_true", help="tiny everything on the CPU (tests)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pool", type=int, default=32768, help="training images rendered once")
    p.add_argument("--vae-batch", type=int, default=128)
    p.add_argument("--dit-batch", type=int, default=1024)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--eval-seeds", type=int, default=2, help="seeds per prompt in the final evaluation (216 prompts)")
    p.add_argument("--eval-every", type=float, default=60.0, help="seconds of DiT training between quick EMA evaluations (0: none)")
    args = p.parse_args(argv)
    for name in ("vae_seconds", "dit_seconds", "lr", "eval_every"):
        _positive_seconds("--" + name.replace("_", "-"), getattr(args, name))
    for name in ("pool", "vae_batch", "dit_batch", "eval_seeds"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if args.resume is not None:
        missing = [f for f in RESUME_FILES if not (args.resume / f).is_file()]
        if missing:
            raise UsageError(f"--resume {args.resume}: not a session folder ({', '.join(missing)} missing)")
        if args.vae_seconds > 0:
            raise UsageError("--resume keeps the VAE (the DiT learned its latents): pass --vae-seconds 0")
    elif args.vae_seconds == 0 and not args.smoke:
        raise UsageError("--vae-seconds 0 needs --resume (a trained VAE to start from)")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} exists and is not a folder")
    if args.smoke:
        args.pool, args.vae_batch, args.dit_batch, args.eval_seeds = min(args.pool, 64), 4, 8, 1
    return args


def omniloop_json(train_log: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's omniloop.json: request defaults the flux family reads, the adherence kind and
    vocabulary ``omniloop eval adherence`` / ``omniloop generate`` read, and where it came from."""
    from omniloop_wan_demo.prompts import vocabulary_words

    from .model import SIZE, TEXT_LEN

    return {
        "variant": "flux-demo",
        "defaults": {"steps": 20, "guidance_scale": 1.0, "height": SIZE, "width": SIZE, "max_sequence_length": TEXT_LEN},
        "adherence": {"kind": "image"},
        "vocabulary": vocabulary_words("image"),
        "training": {k: train_log.get(k) for k in ("dit_total_steps", "seed", "latent_stats")},
    }


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch
    from safetensors.torch import load_file, save_file

    from . import model as M
    from .train import EMA, encode_pool, render_pool, train_dit, train_vae, vae_check

    t_start = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # The first H200 session (2026-12-01) died in the DiT's first backward with
        # CUBLAS_STATUS_EXECUTION_FAILED (an asynchronous fault from an earlier kernel). cuDNN's
        # SDPA is the suspect (80-token sequences, batch x heads 4096); it stays off here.
        # OMNILOOP_FD_SDPA=math falls back to the math kernel (the session script's retry).
        torch.backends.cuda.enable_cudnn_sdp(False)
        if os.environ.get("OMNILOOP_FD_SDPA") == "math":
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.manual_seed(args.seed)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    rec: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "device": str(device),
                           "torch": torch.__version__, "seed": args.seed, "timings": {}}
    comps = M.build_components(args.seed, smoke=args.smoke)
    prev: dict[str, Any] = {}
    if args.resume is not None:
        prev = json.loads((args.resume / "train.json").read_text())
        comps["vae"].load_state_dict(load_file(str(args.resume / "vae.safetensors")))
        raw = load_file(str(args.resume / "raw-dit.safetensors"))
        for k in DIT_KEYS:
            comps[k].load_state_dict({n[len(k) + 1:]: t for n, t in raw.items() if n.startswith(k + ".")})
        log(f"resumed from {args.resume} ({prev.get('dit_total_steps', 0)} DiT steps)")
    for k in ("vae", "transformer", "text_encoder", "text_encoder_2"):
        rec.setdefault("params", {})[k] = M.count_params(comps[k])

    t = time.perf_counter()
    pool, prompts = render_pool(args.pool, args.seed + prev.get("sessions", 0), device)
    rec["timings"]["render_pool_s"] = round(time.perf_counter() - t, 1)
    log(f"rendered {len(pool)} images in {rec['timings']['render_pool_s']} s")

    vae = comps["vae"].to(device)
    if args.vae_seconds > 0:
        rec["vae"] = train_vae(vae, pool, seconds=args.vae_seconds, batch=args.vae_batch, seed=args.seed,
                               max_steps=3 if args.smoke else None, log=log)
    else:
        rec["vae"] = prev.get("vae", {})
    vae.eval().requires_grad_(False)
    rec["vae_check"] = vae_check(vae, pool)
    log(f"vae: {rec['vae_check']}")
    save_file({k: v.detach().float().cpu().contiguous() for k, v in vae.state_dict().items()}, str(out / "vae.safetensors"))

    t = time.perf_counter()
    lat = encode_pool(vae, pool)
    if args.resume is not None and "latent_stats" in prev:  # keep the normalisation the DiT was trained with
        shift, scale = prev["latent_stats"]["shift_factor"], prev["latent_stats"]["scaling_factor"]
    else:
        shift, scale = float(lat.mean()), float(1.0 / lat.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    rec["latent_stats"] = {"shift_factor": shift, "scaling_factor": scale, "shape": list(lat.shape[1:])}
    latents = ((lat - shift) * scale).contiguous()
    del pool
    rec["timings"]["encode_s"] = round(time.perf_counter() - t, 1)
    log(f"latents {tuple(latents.shape)}: shift {shift:.4f} scale {scale:.4f}")

    ema = None
    if args.resume is not None:
        ema_sd = load_file(str(args.resume / "ema-dit.safetensors"))
        ema = EMA({k: comps[k] for k in DIT_KEYS}, 0.999)
        for k in DIT_KEYS:
            ema.modules[k].load_state_dict({n[len(k) + 1:]: t for n, t in ema_sd.items() if n.startswith(k + ".")})
    def tick(step: int, ema: EMA) -> dict[str, Any]:
        """EMA weights, 216 prompts x seed 0, 20 steps, no CFG (in-memory fp32 modules)."""
        from .evaluate import quick_eval

        acc = quick_eval({**comps, **ema.modules, "vae": vae}, steps=1 if args.smoke else 20, smoke=args.smoke)
        log(f"dit step {step}: EMA eval {acc}")
        return {"accuracy": acc}

    ema, rec["dit"] = train_dit(comps, latents, prompts, seconds=args.dit_seconds, batch=args.dit_batch, lr=args.lr,
                                ema=ema, seed=args.seed + prev.get("sessions", 0), max_steps=3 if args.smoke else None,
                                log=log, step0=int(prev.get("dit_total_steps", 0)),
                                warmup=20 if args.resume is not None else 200,
                                tick=tick if args.eval_every > 0 else None,
                                tick_seconds=0.0 if args.smoke else args.eval_every)
    rec["dit_total_steps"] = rec["dit"]["total_steps"]
    rec["sessions"] = prev.get("sessions", 0) + 1
    del latents

    def flat(mods: dict[str, Any]) -> dict[str, Any]:
        return {f"{k}.{n}": v.detach().float().cpu().clone() for k, m in mods.items() for n, v in m.state_dict().items()}

    save_file(flat({k: comps[k] for k in DIT_KEYS}), str(out / "raw-dit.safetensors"))
    save_file(flat(ema.modules), str(out / "ema-dit.safetensors"))
    shipped = {**comps, **{k: ema.modules[k] for k in DIT_KEYS}, "vae": vae}
    with tempfile.TemporaryDirectory() as tmp:
        folder = M.save_pipeline(shipped, Path(tmp) / "pipeline", omniloop_json=omniloop_json(rec))
        with tarfile.open(out / "pipeline.tar", "w") as tar:
            tar.add(str(folder), arcname="pipeline")
        rec["pipeline_bytes"] = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        log(f"wrote pipeline.tar ({rec['pipeline_bytes'] / 1e6:.1f} MB of files)")
        rec["timings"]["train_total_s"] = round(time.perf_counter() - t_start, 1)
        (out / "train.json").write_text(json.dumps(rec, indent=1, default=str))
        try:
            from .evaluate import evaluate_folder

            report = evaluate_folder(folder, device=device, seeds=list(range(args.eval_seeds)),
                                     samples_png=out / "samples.png", smoke=args.smoke, log=log)
        except Exception as exc:  # the weights are saved; an evaluation failure must not lose them
            traceback.print_exc()
            report = {"error": f"{type(exc).__name__}: {exc}"}
    (out / "eval.json").write_text(json.dumps(report, indent=1, default=str))
    rec["timings"]["total_s"] = round(time.perf_counter() - t_start, 1)
    (out / "train.json").write_text(json.dumps(rec, indent=1, default=str))
    log(f"done in {rec['timings']['total_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
