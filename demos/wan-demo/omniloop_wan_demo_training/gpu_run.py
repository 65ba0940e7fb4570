"""One training session on one GPU, time-boxed: (VAE) -> DiT -> evaluation -> files to bring back.

    python -m omniloop_wan_demo_training.gpu_run --out $OUT --vae-seconds 150 --dit-seconds 240
    python -m omniloop_wan_demo_training.gpu_run --out $OUT --resume .ckpt --dit-seconds 300

Writes into ``--out`` (at most 8 files, each < 16 MiB): ``pipeline.tar`` (the diffusers-format
checkpoint, fp16, EMA weights), ``raw-*.safetensors`` + ``state.json`` (raw fp32 weights to resume
from), ``train.json`` (logs, recipe, latent stats, evaluations during training), ``eval.json``
(the final adherence sweep on the saved fp16 checkpoint) and ``preview.png`` (frames 0/8/16 of a
few generated clips). ``vae.tar`` is written as soon as the VAE is trained and removed once
``pipeline.tar`` exists.

Validation sampling: through omniloop's runtime when ``--val-backend runtime`` and it is
importable; otherwise (the default while the runtime and the Wan family are being written)
through diffusers' ``WanPipeline`` built from the in-memory EMA modules. The backend used is
recorded in ``train.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omniloop_wan_demo.evaluate import default_prompts, full_prompts

from .common import FLOW_SHIFT, load_tokenizer, save_pipeline, tar_dir, untar
from .train_dit import make_pipeline, pipeline_eval, save_raw, train_dit
from .train_vae import reconstruction_check, train_vae


def _dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, default=str))


def preview(pipe, path: Path, prompts: list[str], *, steps: int = 20, guidance: float = 5.0) -> None:
    from PIL import Image

    from omniloop_wan_demo.evaluate import DiffusersGenerator

    vids = DiffusersGenerator(pipe, batch_size=len(prompts))(prompts, [0] * len(prompts), steps=steps, guidance_scale=guidance)
    rows = [np.concatenate([v[i] for i in (0, 4, 8, 12, 16)], axis=1) for v in vids]
    img = np.concatenate(rows, axis=0)
    Image.fromarray(img).save(path)


def final_eval(ckpt: Path, device: str, budget_s: float, smoke: bool = False, plan_name: str = "full") -> dict[str, Any]:
    """Adherence sweep on the saved (fp16) checkpoint loaded back with WanPipeline.from_pretrained."""
    from diffusers import WanPipeline

    from .common import build_scheduler

    t0 = time.perf_counter()
    pipe = WanPipeline.from_pretrained(str(ckpt), torch_dtype=torch.float32).to(device)
    res: dict[str, Any] = {"checkpoint_loaded_with": "diffusers.WanPipeline.from_pretrained(torch_dtype=float32)", "runs": []}
    full = full_prompts()
    plan = [
        ("unipc", 20, 5.0, full, [0, 1, 2, 3]),
        ("unipc", 50, 5.0, full, [0, 1, 2, 3]),
        ("unipc", 8, 5.0, full, [0, 1, 2, 3]),
        ("unipc", 4, 5.0, full, [0, 1, 2, 3]),
        ("unipc", 20, 1.0, full, [0, 1]),
        ("unipc", 20, 3.0, full, [0, 1]),
        ("unipc", 20, 8.0, full, [0, 1]),
        ("euler", 20, 5.0, full, [0, 1]),
        ("euler", 8, 5.0, full, [0, 1]),
        ("euler", 4, 5.0, full, [0, 1]),
        ("unipc", 20, 5.0, default_prompts(), [0, 1]),
    ]
    if plan_name == "short":  # steps sweep only
        plan = [("unipc", 20, 5.0, full, [0, 1, 2, 3]), ("unipc", 50, 5.0, full, [0, 1]),
                ("unipc", 8, 5.0, full, [0, 1]), ("unipc", 4, 5.0, full, [0, 1]), ("unipc", 20, 8.0, full, [0, 1])]
    if smoke:
        plan = [("unipc", 2, 5.0, full[:3], [0]), ("euler", 2, 5.0, full[:3], [0])]
    base_sched = pipe.scheduler
    for sched, steps, g, prompts, seeds in plan:
        if time.perf_counter() - t0 > budget_s:
            res["truncated"] = True
            break
        pipe.scheduler = base_sched if sched == "unipc" else build_scheduler("euler", FLOW_SHIFT)
        t1 = time.perf_counter()
        r = pipeline_eval(pipe, prompts=prompts, seeds=seeds, steps=steps, guidance=g)
        r.update(scheduler=sched, prompt_set="default24" if len(prompts) == 24 else "full72", wall_s=round(time.perf_counter() - t1, 2))
        if not (sched == "unipc" and steps == 20 and g == 5.0 and len(prompts) == 72):
            r.pop("clips", None)
        res["runs"].append(r)
        print("final", sched, steps, g, len(prompts), r["accuracy"], r["wall_s"], flush=True)
    pipe.scheduler = base_sched
    try:
        from omniloop_wan.family import WanFamily
        from omniloop_wan_demo.evaluate import FamilyLoopGenerator, evaluate

        t1 = time.perf_counter()
        m = WanFamily().load(ckpt, device=torch.device(device), dtype=torch.float32, options={})
        prompts = default_prompts()[:2] if smoke else default_prompts()
        rep = evaluate(FamilyLoopGenerator(m.components, device=device), prompts=prompts, seeds=[0, 1],
                       steps=2 if smoke else 20, guidance_scale=5.0, backend="family-loop")
        r = rep.to_dict(with_clips=False)
        r.update(scheduler="unipc", prompt_set="default24", loaded_with="omniloop_wan.WanFamily.load", wall_s=round(time.perf_counter() - t1, 2))
        res["runs"].append(r)
        print("final family-loop", r["accuracy"], r["wall_s"], flush=True)
    except Exception as e:
        res["family_loop_error"] = f"{type(e).__name__}: {e}"
        print("family loop final eval failed:", res["family_loop_error"], flush=True)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="time-boxed training session (see module docstring)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", help="folder with pipeline.tar (or pipeline/), raw-*.safetensors, state.json")
    ap.add_argument("--vae-seconds", type=float, default=150)
    ap.add_argument("--vae-batch", type=int, default=32)
    ap.add_argument("--dit-seconds", type=float, default=240)
    ap.add_argument("--dit-batch", type=int, default=256)
    ap.add_argument("--dit-lr", type=float, default=4e-4)
    ap.add_argument("--n-clips", type=int, default=32768)
    ap.add_argument("--eval-every", type=float, default=60)
    ap.add_argument("--eval-budget", type=float, default=60)
    ap.add_argument("--val-backend", default="family", choices=["family", "diffusers"])
    ap.add_argument("--timestep-sampling", default="logit_normal")
    ap.add_argument("--max-steps", type=int, help="(smoke tests) cap both trainers' steps")
    ap.add_argument("--final-plan", default="full", choices=["full", "short"])
    ap.add_argument("--warmup", type=int, default=300, help="DiT LR warmup steps")
    ap.add_argument("--smoke", action="store_true", help="tiny evaluations (CPU check of the whole session)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="wan_demo_"))
    dev = a.device
    t_start = time.perf_counter()
    train: dict[str, Any] = {"args": vars(a), "device": torch.cuda.get_device_name(0) if dev.startswith("cuda") else "cpu",
                             "torch": torch.__version__}
    try:
        import diffusers
        import transformers

        train["diffusers"], train["transformers"] = diffusers.__version__, transformers.__version__
    except Exception:
        pass
    tok = load_tokenizer()
    from diffusers import AutoencoderKLWan

    # ---- VAE --------------------------------------------------------------------------------
    stats = None
    if a.resume:
        rdir = Path(a.resume)
        if (rdir / "pipeline.tar").exists() and not (rdir / "pipeline").exists():
            untar(rdir / "pipeline.tar", rdir)
        vae = AutoencoderKLWan.from_pretrained(str(rdir / "pipeline" / "vae"), torch_dtype=torch.float32).to(dev).eval()
        stats = (list(vae.config.latents_mean), list(vae.config.latents_std))
        train["vae"] = {"resumed_from": str(rdir / "pipeline" / "vae")}
        prev = rdir / "train.json"
        if prev.exists():
            train["previous"] = {k: v for k, v in json.loads(prev.read_text()).items() if k in ("vae", "dit_summary")}
    else:
        vae, vinfo = train_vae(out=None, seconds=a.vae_seconds, max_steps=a.max_steps, batch=a.vae_batch, device=dev, seed=a.seed)
        # what ships is fp16: train the DiT on latents of exactly those weights
        vae = vae.half().float().eval()
        vinfo["recon"] = reconstruction_check(vae, device=dev, n=4 if a.smoke else 128)
        print("vae recon", json.dumps(vinfo["recon"]), flush=True)
        train["vae"] = vinfo
        vdir = work / "vae"
        vae.half().save_pretrained(str(vdir))
        vae.float()
        tar_dir(vdir, out / "vae.tar")
        _dump(out / "train.json", train)
    train["vae_done_s"] = round(time.perf_counter() - t_start, 1)

    # ---- DiT --------------------------------------------------------------------------------
    use_family = a.val_backend == "family"
    val_note = "validation: the omniloop Wan family's own pipeline + denoise loop (WanFamily.from_components + Execution) on the default 24 prompts; plus diffusers WanPipeline (batched) on all 72"
    if use_family:
        try:
            import omniloop.execution
            import omniloop.schema  # noqa: F401
            import omniloop_wan.family  # noqa: F401
            from omniloop_wan_demo.evaluate import FamilyLoopGenerator  # noqa: F401
        except Exception as e:
            use_family = False
            val_note = f"Wan family loop unavailable ({type(e).__name__}: {e}); validation through diffusers.WanPipeline only"
    else:
        val_note = "validation through diffusers.WanPipeline only (--val-backend diffusers)"
    train["validation_backend"] = val_note
    print(val_note, flush=True)
    quick_prompts = full_prompts()[:3] if a.smoke else full_prompts()
    fam_prompts = default_prompts()[:2] if a.smoke else default_prompts()
    quick_steps = 2 if a.smoke else 20

    def eval_fn(shadow: dict[str, Any], step: int) -> dict[str, Any]:
        from omniloop_wan_demo.evaluate import FamilyLoopGenerator, evaluate

        pipe = make_pipeline(vae, shadow["transformer"], shadow["text_encoder"], tok)
        r = pipeline_eval(pipe, prompts=quick_prompts, seeds=[0], steps=quick_steps, guidance=5.0)
        rec = {"step": step, "diffusers72": r["accuracy"], "n": r["n"], "wall_s": round(r["seconds"], 2)}
        if use_family:
            comps = {"transformer": pipe.transformer, "vae": pipe.vae, "text_encoder": pipe.text_encoder,
                     "tokenizer": tok, "scheduler": pipe.scheduler}
            g = FamilyLoopGenerator(comps, device=dev)
            fr = evaluate(g, prompts=fam_prompts, seeds=[0], steps=quick_steps, guidance_scale=5.0, backend="family-loop")
            rec["family24"] = fr.accuracy
            rec["family_wall_s"] = round(fr.seconds, 2)
        return rec

    modules, dinfo = train_dit(
        vae=vae, tokenizer=tok, out=None, seconds=a.dit_seconds, max_steps=a.max_steps, batch=a.dit_batch, lr=a.dit_lr,
        n_clips=a.n_clips, device=dev, resume=a.resume, stats=stats, eval_every=a.eval_every, eval_fn=eval_fn,
        timestep_sampling=a.timestep_sampling, seed=a.seed + (1 if a.resume else 0), warmup=a.warmup,
    )
    train["dit"] = dinfo
    train["dit_summary"] = {k: dinfo.get(k) for k in ("total_steps", "steps", "seconds", "n_clips", "params", "recipe")}
    train["dit_done_s"] = round(time.perf_counter() - t_start, 1)

    # ---- save -------------------------------------------------------------------------------
    pipe = make_pipeline(vae, modules["ema_transformer"], modules["ema_text_encoder"], tok)
    ckpt = save_pipeline(pipe, work / "pipeline", meta={"trained_steps": dinfo["total_steps"]})
    tar_dir(ckpt, out / "pipeline.tar")
    (out / "vae.tar").unlink(missing_ok=True)
    for p in save_raw(modules, work / "rawdir", dinfo["total_steps"]):
        shutil.copy(p, out / p.name)
    shutil.copy(work / "rawdir" / "state.json", out / "state.json")
    _dump(out / "train.json", train)
    print(f"saved at {time.perf_counter() - t_start:.1f}s", flush=True)

    # ---- evaluate what ships ------------------------------------------------------------------
    try:
        res = final_eval(ckpt, dev, a.eval_budget, smoke=a.smoke, plan_name=a.final_plan)
        _dump(out / "eval.json", res)
    except Exception:
        traceback.print_exc()
    try:
        from diffusers import WanPipeline

        p2 = WanPipeline.from_pretrained(str(ckpt), torch_dtype=torch.float32).to(dev)
        preview(p2, out / "preview.png", default_prompts()[:: 12 if a.smoke else 3], steps=quick_steps)
    except Exception:
        traceback.print_exc()
    train["total_s"] = round(time.perf_counter() - t_start, 1)
    _dump(out / "train.json", train)
    print(f"done in {train['total_s']}s", flush=True)


if __name__ == "__main__":
    main()
