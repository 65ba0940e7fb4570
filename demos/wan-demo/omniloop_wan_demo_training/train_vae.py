"""Train the small ``AutoencoderKLWan`` (4x spatial, 4x temporal, z=16) for reconstruction.

Clips are rendered on the fly on the training device (an endless deterministic stream). The loss
is MSE up-weighted on object pixels (``1 + object_weight * coverage``): with plain MSE the small
objects are a few percent of the pixels and the autoencoder collapses to the background. A tiny
KL term keeps the posterior a proper Gaussian.

    python -m omniloop_wan_demo_training.train_vae --out runs/vae --seconds 150
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .common import VAE_CONFIG, build_vae, param_count
from .render import render, sample_params, to_uint8_frames


def lr_at(step: int, frac: float, lr: float, warmup: int = 100, final: float = 0.1) -> float:
    w = min(1.0, (step + 1) / warmup)
    cos = final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return lr * w * cos


def vae_loss(vae, x: torch.Tensor, coverage: torch.Tensor, *, object_weight: float, kl_weight: float,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    post = vae.encode(x).latent_dist
    z = post.sample(generator=generator)
    xr = vae.decode(z).sample
    w = 1.0 + object_weight * coverage
    err = (xr.float() - x) ** 2
    rec = (err * w).mean() / w.mean()
    kl = 0.5 * (post.mean.float() ** 2 + post.var.float() - 1.0 - post.logvar.float()).mean()
    loss = rec + kl_weight * kl
    return loss, {"rec": rec.detach(), "kl": kl.detach(), "mse": err.mean().detach()}


@torch.no_grad()
def reconstruction_check(vae, *, n: int = 128, seed: int = 999, device: str = "cuda", batch: int = 64) -> dict[str, Any]:
    """Detector accuracy on reconstructions (posterior mode) of ``n`` held-out clips."""
    from omniloop_wan_demo.evaluate import detect

    p = sample_params(n, seed)
    labels = p.labels()
    ok = {"color": 0, "direction": 0, "shape": 0}
    mse = 0.0
    for i in range(0, n, batch):
        sub = type(p)(*[getattr(p, f)[i : i + batch] for f in p.__dataclass_fields__])
        x = render(sub, device=device) * 2 - 1
        z = vae.encode(x).latent_dist.mode()
        xr = vae.decode(z).sample.float().clamp(-1, 1)
        mse += float(((xr - x) ** 2).mean()) * len(sub)
        for j in range(len(sub)):
            d = detect(to_uint8_frames((xr[j] + 1) / 2))
            lab = labels[i + j]
            for k in ok:
                ok[k] += getattr(d, k) == lab[k]
    return {"n": n, "mse": mse / n, "psnr": float(10 * np.log10(4.0 / max(mse / n, 1e-12))),
            "accuracy": {k: v / n for k, v in ok.items()}}


def train_vae(
    *,
    out: str | Path | None,
    seconds: float = 150.0,
    max_steps: int | None = None,
    batch: int = 32,
    lr: float = 6e-4,
    object_weight: float = 20.0,
    kl_weight: float = 1e-5,
    seed: int = 0,
    device: str = "cuda",
    resume: str | Path | None = None,
    log_every: int = 50,
    amp: bool = True,
) -> tuple[Any, dict[str, Any]]:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    if resume:
        vae = AutoencoderKLWan.from_pretrained(str(resume), torch_dtype=torch.float32)
    else:
        vae = build_vae()
    vae.to(device).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=1e-4)
    gen = torch.Generator(device).manual_seed(seed + 1)
    log: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    step = 0
    amp_ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if (amp and device.startswith("cuda")) else None
    while True:
        el = time.perf_counter() - t0
        if el >= seconds or (max_steps is not None and step >= max_steps):
            break
        frac = el / seconds if max_steps is None else step / max_steps
        for g in opt.param_groups:
            g["lr"] = lr_at(step, frac, lr)
        p = sample_params(batch, seed * 1_000_003 + step)
        x, cov = render(p, device=device, return_mask=True)
        x = x * 2 - 1
        if amp_ctx:
            with amp_ctx():
                loss, parts = vae_loss(vae, x, cov, object_weight=object_weight, kl_weight=kl_weight, generator=gen)
        else:
            loss, parts = vae_loss(vae, x, cov, object_weight=object_weight, kl_weight=kl_weight, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % log_every == 0:
            rec = dict(step=step, t=round(time.perf_counter() - t0, 1), lr=opt.param_groups[0]["lr"], **{k: round(float(v), 6) for k, v in parts.items()})
            log.append(rec)
            print("vae", json.dumps(rec), flush=True)
        step += 1
    vae.eval()
    info = {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "batch": batch, "lr": lr,
            "object_weight": object_weight, "kl_weight": kl_weight, "params": param_count(vae),
            "config": {k: v for k, v in VAE_CONFIG.items() if k not in ("latents_mean", "latents_std")}, "log": log}
    if out:
        vae.save_pretrained(str(out))
    return vae, info


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=150)
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--object-weight", type=float, default=20.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--resume")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    vae, info = train_vae(out=a.out, seconds=a.seconds, max_steps=a.max_steps, batch=a.batch, lr=a.lr,
                          object_weight=a.object_weight, device=a.device, resume=a.resume, seed=a.seed)
    info["recon"] = reconstruction_check(vae, device=a.device, n=64)
    Path(a.out, "train_vae.json").write_text(json.dumps(info, indent=2))
    print(json.dumps(info["recon"]))


if __name__ == "__main__":
    main()
