"""Train the small ``WanTransformer3DModel`` (and the tiny UMT5 text encoder, jointly) with flow
matching on latents of the trained VAE.

Recipe (rectified flow as in Wan / diffusers FlowMatch):

* latents: posterior *mode* of ``n_clips`` rendered clips, normalized per channel with their own
  mean/std, which are written into the VAE config (``latents_mean`` / ``latents_std``) so that
  ``WanPipeline`` de-normalizes exactly as we normalized (``z = x * std + mean``);
* ``x_t = (1 - s) x0 + s * noise``, target ``noise - x0``, timestep ``1000 s``;
* ``s`` logit-normal (``sigmoid(N(0, 1))``) then shifted with the shipped scheduler's flow shift
  (``shift * s / (1 + (shift - 1) s)``), which puts more training on the high-noise steps where
  layout and motion are decided;
* prompt dropped to ``""`` 10 % of the time (that is what WanPipeline's default negative prompt
  encodes to), so classifier-free guidance works;
* text embeddings zero-padded to a random length (512 half of the time, WanPipeline's default,
  else 8-64), so that the model does not depend on how far a runtime pads;
* EMA of the weights (the shipped weights), bf16 autocast, AdamW.

Resumable: ``--resume DIR`` takes a folder holding the saved pipeline (``pipeline/``, whose EMA
weights and VAE it continues from) and the raw weights (``raw-*.safetensors``).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .common import (
    DIT_CONFIG,
    FLOW_SHIFT,
    TEXT_ENCODER_CONFIG,
    assemble_pipeline,
    build_scheduler,
    build_text_encoder,
    build_transformer,
    encode_tokens,
    load_split,
    load_tokenizer,
    optimizer_step,
    param_count,
    sample_batch,
    save_split,
    schedule_lr,
    tokenize,
)
from .render import all_prompts, render, sample_params

PROMPTS = all_prompts()


def prompt_index(params) -> np.ndarray:
    idx = {p: i for i, p in enumerate(PROMPTS)}
    return np.array([idx[p] for p in params.prompts()], dtype=np.int64)


def latent_coverage(mask: torch.Tensor, *, dilate: int = 1) -> torch.Tensor:
    """Object coverage ``[B, 1, 17, 64, 64]`` (pixels) -> a boolean mask on the latent grid
    ``[B, 1, 5, 16, 16]``: Wan's VAE keeps frame 0 alone and folds frames 1..16 in fours, and
    downsamples 4x spatially; a latent cell is "object" when any pixel of its group is, then the
    mask grows by ``dilate`` cells so the object's outline and surroundings count too."""
    b, c, t, h, w = mask.shape
    if (t - 1) % 4 or h % 4 or w % 4:
        raise ValueError(f"latent_coverage: need 1+4k frames and sides divisible by 4, got {tuple(mask.shape)}")
    m = mask > 0
    groups = torch.cat([m[:, :, :1], m[:, :, 1:].reshape(b, c, (t - 1) // 4, 4, h, w).any(dim=3)], dim=2)
    flat = groups.transpose(1, 2).reshape(-1, c, h, w).float()
    cells = torch.nn.functional.max_pool2d(flat, 4, 4)
    if dilate:
        cells = torch.nn.functional.max_pool2d(cells, 2 * dilate + 1, 1, dilate)
    return (cells > 0).reshape(b, groups.shape[2], c, h // 4, w // 4).transpose(1, 2)


@torch.no_grad()
def encode_dataset(vae, *, n: int, seed: int, device: str, batch: int = 256, max_seconds: float = 60.0,
                   coverage: bool = False) -> tuple[torch.Tensor, ...]:
    """Posterior-mode latents ``[N, 16, 5, 16, 16]`` (fp32, on ``device``) and prompt indices;
    with ``coverage`` also the object's boolean mask on the latent grid (:func:`latent_coverage`)."""
    lats, pids, covs = [], [], []
    t0 = time.perf_counter()
    done = 0
    i = 0
    while done < n and time.perf_counter() - t0 < max_seconds:
        p = sample_params(min(batch, n - done), seed * 7919 + i)
        x, mask = render(p, device=device, return_mask=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            z = vae.encode(x * 2 - 1).latent_dist.mode()
        lats.append(z.float())
        pids.append(torch.as_tensor(prompt_index(p), device=device))
        if coverage:
            covs.append(latent_coverage(mask))
        done += len(p)
        i += 1
    if coverage:
        return torch.cat(lats), torch.cat(pids), torch.cat(covs)
    return torch.cat(lats), torch.cat(pids)


def latent_stats(lat: torch.Tensor) -> tuple[list[float], list[float]]:
    mean = lat.mean(dim=(0, 2, 3, 4))
    std = lat.std(dim=(0, 2, 3, 4))
    return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in std]


def normalize_latents(vae, lat: torch.Tensor, stats: tuple[list[float], list[float]] | None
                      ) -> tuple[torch.Tensor, tuple[list[float], list[float]]]:
    """Per-channel normalised latents; without ``stats`` they are measured on ``lat`` and written
    into the VAE config (WanPipeline de-normalises with ``z * std + mean``)."""
    if stats is None:
        stats = latent_stats(lat)
        vae.register_to_config(latents_mean=stats[0], latents_std=stats[1])
    mean = torch.tensor(stats[0], device=lat.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(stats[1], device=lat.device).view(1, -1, 1, 1, 1)
    return (lat - mean) / std, stats


def sample_sigmas(b: int, *, mode: str, shift: float | torch.Tensor, device: str, gen: torch.Generator) -> torch.Tensor:
    if mode == "logit_normal":
        u = torch.sigmoid(torch.randn(b, device=device, generator=gen))
    elif mode == "uniform":
        u = torch.rand(b, device=device, generator=gen)
    else:
        raise ValueError(mode)
    s = shift * u / (1 + (shift - 1) * u)
    return s.clamp(1e-4, 1.0)


class EMA:
    def __init__(self, modules: dict[str, torch.nn.Module], decay: float):
        self.decay = decay
        self.modules = modules
        self.shadow = {k: copy.deepcopy(m).eval().requires_grad_(False) for k, m in modules.items()}

    @torch.no_grad()
    def update(self, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        for k, m in self.modules.items():
            src = [p.detach() for p in m.parameters()]
            dst = list(self.shadow[k].parameters())
            torch._foreach_mul_(dst, d)
            torch._foreach_add_(dst, src, alpha=1 - d)


def make_pipeline(vae, transformer, text_encoder, tokenizer, scheduler: str = "unipc", shift: float = FLOW_SHIFT):
    return assemble_pipeline(vae, transformer, text_encoder, tokenizer, build_scheduler(scheduler, shift))


def pipeline_eval(pipe, *, prompts: list[str], seeds: list[int], steps: int, guidance: float, batch: int = 144) -> dict[str, Any]:
    """Adherence of ``pipe`` (a diffusers WanPipeline; see ``validation_generator``)."""
    from omniloop_wan_demo.evaluate import DiffusersGenerator, evaluate

    gen = DiffusersGenerator(pipe, batch_size=batch)
    rep = evaluate(gen, prompts=prompts, seeds=seeds, steps=steps, guidance_scale=guidance, backend="diffusers")
    return rep.to_dict(with_clips=False) | {"clips": clip_records(rep)}


def clip_records(rep) -> list[dict[str, Any]]:
    """A report's clips, compactly: prompt, seed, detected direction / colour / shape, travel (px)
    and frames with a ghost — what a GPU session's ``eval.json`` keeps per clip."""
    return [{"p": c.prompt, "s": c.seed, "d": c.detected["direction"], "c": c.detected["color"],
             "sh": c.detected.get("shape"), "tr": c.detected["travel"], "g": c.detected.get("ghost_frames", 0)}
            for c in rep.clips]


#: a clip holds a duplicate object when a ghost is in at least this many of its 17 frames (a
#: trail or a speck lasts a few frames; a second object moving beside the first, most of the clip)
DUPLICATE_FRAMES = 8


def duplicates(clips: list[dict[str, Any]]) -> dict[str, Any]:
    """Of :func:`clip_records`' rows: how many hold a duplicate object (``DUPLICATE_FRAMES``), in
    all and per seed (seeds with none left out), and how many hold any ghost."""
    dup = [c for c in clips if c.get("g", 0) >= DUPLICATE_FRAMES]
    per_seed: dict[str, int] = {}
    for c in dup:
        per_seed[str(c["s"])] = per_seed.get(str(c["s"]), 0) + 1
    return {"duplicate_clips": len(dup), "duplicates_per_seed": dict(sorted(per_seed.items(), key=lambda kv: int(kv[0]))),
            "clips_with_a_ghost": sum(1 for c in clips if c.get("g", 0) > 0)}


def train_dit(
    *,
    vae,
    tokenizer,
    out: str | Path | None,
    seconds: float = 240.0,
    max_steps: int | None = None,
    batch: int = 256,
    lr: float = 4e-4,
    n_clips: int = 32768,
    cfg_drop: float = 0.1,
    shift: float = FLOW_SHIFT,
    timestep_sampling: str = "logit_normal",
    ema_decay: float = 0.999,
    seed: int = 0,
    device: str = "cuda",
    resume: str | Path | None = None,
    stats: tuple[list[float], list[float]] | None = None,
    eval_every: float = 60.0,
    eval_fn: Callable[[Any, int], dict[str, Any]] | None = None,
    log_every: int = 100,
    warmup: int = 300,
    decay_frac: float = 0.2,
    encode_seconds: float = 60.0,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Returns ``(modules, info)``; modules has ``transformer``/``text_encoder`` (raw) and
    ``ema_transformer``/``ema_text_encoder``; the VAE's config carries the latent statistics."""
    torch.manual_seed(seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    info: dict[str, Any] = {"log": [], "evals": []}

    t_enc = time.perf_counter()
    lat, pid = encode_dataset(vae, n=n_clips, seed=seed + 17, device=device, max_seconds=encode_seconds)
    info["encode_seconds"] = round(time.perf_counter() - t_enc, 1)
    info["n_clips"] = int(lat.shape[0])
    lat, stats = normalize_latents(vae, lat, stats)
    info["latents_mean"], info["latents_std"] = stats
    print(f"dit: {lat.shape[0]} latents encoded in {info['encode_seconds']}s; normalized std {float(lat.std()):.3f}", flush=True)

    transformer = build_transformer().to(device)
    text_encoder = build_text_encoder().to(device)
    if resume:
        raw = load_split(Path(resume) / "raw")
        transformer.load_state_dict({k[len("transformer."):]: v for k, v in raw.items() if k.startswith("transformer.")})
        text_encoder.load_state_dict({k[len("text_encoder."):]: v for k, v in raw.items() if k.startswith("text_encoder.")}, strict=False)
    transformer.train()
    text_encoder.train()
    ema = EMA({"transformer": transformer, "text_encoder": text_encoder}, ema_decay)
    if resume:
        from diffusers import WanTransformer3DModel
        from transformers import UMT5EncoderModel

        pdir = Path(resume) / "pipeline"
        ema.shadow["transformer"].load_state_dict(WanTransformer3DModel.from_pretrained(str(pdir / "transformer"), torch_dtype=torch.float32).state_dict())
        ema.shadow["text_encoder"].load_state_dict(UMT5EncoderModel.from_pretrained(str(pdir / "text_encoder"), torch_dtype=torch.float32).state_dict(), strict=False)
        prev = json.loads((Path(resume) / "state.json").read_text()) if (Path(resume) / "state.json").exists() else {}
        start_step = int(prev.get("step", 0))
    else:
        start_step = 0
    info["params"] = {"transformer": param_count(transformer), "text_encoder": param_count(text_encoder)}
    info["config"] = {"transformer": {k: list(v) if isinstance(v, tuple) else v for k, v in DIT_CONFIG.items()},
                      "text_encoder": TEXT_ENCODER_CONFIG}

    params = list(transformer.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.01)

    ids, mask = tokenize(tokenizer, [*PROMPTS, ""])
    ids, mask = ids.to(device), mask.to(device)
    uncond = len(PROMPTS)
    gen = torch.Generator(device).manual_seed(seed + 1000 + start_step)

    t0 = time.perf_counter()
    last_eval = t0
    step = 0
    run_loss = 0.0
    run_n = 0
    while True:
        el = time.perf_counter() - t0
        if el >= seconds or (max_steps is not None and step >= max_steps):
            break
        schedule_lr(opt, lr, step=step, elapsed=el, budget_s=seconds, max_steps=max_steps, warmup=warmup,
                    decay_frac=decay_frac)
        x0, p, pad_to = sample_batch(lat, pid, batch, uncond=uncond, cfg_drop=cfg_drop, gen=gen, device=device)
        s = sample_sigmas(batch, mode=timestep_sampling, shift=shift, device=device, gen=gen)
        noise = torch.randn(x0.shape, device=device, generator=gen)
        sb = s.view(-1, 1, 1, 1, 1)
        xt = (1 - sb) * x0 + sb * noise
        target = noise - x0
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            emb = encode_tokens(text_encoder, ids[p], mask[p], pad_to)
            pred = transformer(hidden_states=xt, timestep=s * 1000.0, encoder_hidden_states=emb, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), target)
        optimizer_step(opt, params, loss, ema, start_step + step)
        run_loss += loss.detach()
        run_n += 1
        step += 1
        if step % log_every == 0:
            rec = {"step": start_step + step, "t": round(time.perf_counter() - t0, 1), "lr": opt.param_groups[0]["lr"],
                   "loss": round(float(run_loss) / run_n, 5)}
            run_loss, run_n = 0.0, 0
            info["log"].append(rec)
            print("dit", json.dumps(rec), flush=True)
        if eval_fn is not None and time.perf_counter() - last_eval >= eval_every:
            te0 = time.perf_counter()
            try:
                r = eval_fn(ema.shadow, start_step + step)
                r["train_seconds"] = round(te0 - t0, 1)
                info["evals"].append(r)
                print("eval", json.dumps(r), flush=True)
            except Exception as e:  # never lose a training run to an eval bug
                print(f"eval failed: {type(e).__name__}: {e}", flush=True)
            t0 += time.perf_counter() - te0  # evaluation time does not count as training time
            last_eval = time.perf_counter()
    info["steps"] = step
    info["total_steps"] = start_step + step
    info["seconds"] = round(time.perf_counter() - t0, 1)
    info["recipe"] = dict(batch=batch, lr=lr, cfg_drop=cfg_drop, shift=shift, timestep_sampling=timestep_sampling,
                          ema_decay=ema_decay, warmup=warmup, decay_frac=decay_frac, n_clips=info["n_clips"])
    modules = {
        "transformer": transformer.eval(),
        "text_encoder": text_encoder.eval(),
        "ema_transformer": ema.shadow["transformer"],
        "ema_text_encoder": ema.shadow["text_encoder"],
    }
    if out:
        save_raw(modules, out, start_step + step)
    return modules, info


def save_raw(modules: dict[str, Any], out: str | Path, step: int) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {f"transformer.{k}": v.float() for k, v in modules["transformer"].state_dict().items()}
    state |= {f"text_encoder.{k}": v.float() for k, v in modules["text_encoder"].state_dict().items()}
    # tied/shared tensors (UMT5 shares the embedding) must be saved once
    seen: dict[int, str] = {}
    dedup = {}
    for k, v in state.items():
        if v.data_ptr() in seen:
            continue
        seen[v.data_ptr()] = k
        dedup[k] = v.clone()
    (out / "state.json").write_text(json.dumps({"step": step}))
    return save_split(dedup, out / "raw")


def main(argv: list[str] | None = None) -> None:
    from diffusers import AutoencoderKLWan

    ap = argparse.ArgumentParser(description="train the demo DiT (see module docstring)")
    ap.add_argument("--vae", help="trained VAE folder (ignored with --resume: the pipeline's VAE is used)")
    ap.add_argument("--resume", help="folder with pipeline/ and raw-*.safetensors")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=240)
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--n-clips", type=int, default=32768)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if a.resume:
        vae = AutoencoderKLWan.from_pretrained(str(Path(a.resume) / "pipeline" / "vae"), torch_dtype=torch.float32)
        stats = (list(vae.config.latents_mean), list(vae.config.latents_std))
    else:
        vae = AutoencoderKLWan.from_pretrained(a.vae, torch_dtype=torch.float32)
        stats = None
    vae.to(a.device).eval()
    tok = load_tokenizer()
    modules, info = train_dit(vae=vae, tokenizer=tok, out=a.out, seconds=a.seconds, max_steps=a.max_steps,
                              batch=a.batch, lr=a.lr, n_clips=a.n_clips, device=a.device, resume=a.resume, stats=stats)
    from .common import save_pipeline

    pipe = make_pipeline(vae, modules["ema_transformer"], modules["ema_text_encoder"], tok)
    save_pipeline(pipe, Path(a.out) / "pipeline")
    Path(a.out, "train_dit.json").write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
