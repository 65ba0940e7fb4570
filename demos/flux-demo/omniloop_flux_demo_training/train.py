"""Training the flux-demo model: data pool, VAE, transformer + text encoders (rectified flow), and
a batched sampler that does what the flux family's denoise loop does.

Recipe (deterministic by seed):

* **Data**: ``omniloop_wan_demo_training.render.render_images`` (one shape, one colour, one of 9 positions,
  same backgrounds as wan-demo's clips), rendered once per session into a pool on the device
  (``--pool`` images, seeds ``seed*1000 + chunk``), pixels in [-1, 1] as diffusers' VAEs expect.
* **VAE** (``AutoencoderKL``, 4x downsampling, 8 latent channels): MSE weighted ``1 + 20 x``
  object mask (pixels away from the image's median colour: plain MSE lets small objects blur
  away) + 1e-6 KL; AdamW, cosine decay, bf16 autocast, time-boxed.
* **Latents**: posterior mode of the pool through the VAE *as shipped* (fp16 round trip);
  ``shift_factor`` / ``scaling_factor`` of the VAE config set to the pool's mean and 1/std, which
  is how the flux family (and diffusers) normalise FLUX latents.
* **Transformer + both text encoders**, jointly (the vocabulary is closed and tiny; a jointly
  trained encoder learns what each word means for the picture, as wan-demo's did): rectified flow
  as in FLUX/diffusers — ``x_s = (1 - s) x0 + s noise``, target ``noise - x0``, the transformer's
  ``timestep`` input is ``s`` (the pipeline's ``t / 1000``); ``s`` logit-normal(0, 1) (the
  scheduler's shift is 1.0, so no shift); the prompt is dropped to ``""`` 10 % of the time so that
  true CFG (the family's ``cfg: classic``) has an unconditional branch; T5 padded to 16 tokens
  and CLIP to 16 (what ``omniloop.json`` makes the family use); AdamW with warmup and a decay over
  the last 20 % of the session, grad clip 1, EMA 0.999 (what ships), bf16 autocast.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .model import TEXT_LEN

Log = Callable[[str], None]


# ------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------


def render_pool(n: int, seed: int, device: torch.device | str, chunk: int = 4096) -> tuple[torch.Tensor, list[str]]:
    """``n`` training images in [-1, 1] ``[n, 3, 64, 64]`` (float32, on ``device``) and their prompts."""
    from omniloop_wan_demo_training.render import image_prompt_for, render_images

    images, prompts = [], []
    for k, start in enumerate(range(0, n, chunk)):
        try:
            imgs, labels = render_images(min(chunk, n - start), seed=seed * 1000 + k, device=device)
        except RuntimeError as exc:  # the renderer on this device failed: the same images drawn on the CPU
            print(f"render_images on {device} failed ({exc}); rendering on the CPU", flush=True)
            imgs, labels = render_images(min(chunk, n - start), seed=seed * 1000 + k, device="cpu")
        images.append(imgs.to(device).float() * 2 - 1)
        prompts += [image_prompt_for(*lab) for lab in labels]
    return torch.cat(images), prompts


def object_mask(x: torch.Tensor, threshold: float = 0.15) -> torch.Tensor:
    """``[B, 1, H, W]``: 1 where a pixel of ``x`` (in [-1, 1]) is far from its image's median colour."""
    med = x.flatten(2).median(dim=2).values[:, :, None, None]
    return ((x - med).abs().amax(dim=1, keepdim=True) > 2 * threshold).float()


def lr_at(step: int, frac: float, base: float, warmup: int, decay_from: float = 0.8) -> float:
    """Warmup over ``warmup`` steps, flat, then linear decay to 10 % over the last ``1 - decay_from``
    of the session (``frac``: elapsed fraction of the time box)."""
    lr = base * min(1.0, (step + 1) / max(1, warmup))
    if frac > decay_from:
        lr *= max(0.1, 1.0 - 0.9 * (frac - decay_from) / (1.0 - decay_from))
    return lr


def _autocast(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------
# VAE
# ------------------------------------------------------------------------------------------


def train_vae(vae: Any, pool: torch.Tensor, *, seconds: float, batch: int, lr: float = 1e-3, seed: int = 0,
              max_steps: int | None = None, log: Log = print) -> dict[str, Any]:
    """Train ``vae`` in place on random batches of ``pool`` for ``seconds`` (or ``max_steps``)."""
    device = pool.device
    vae.to(device).train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    g = torch.Generator(device=device).manual_seed(seed)
    t0, step, losses = time.perf_counter(), 0, []
    while True:
        frac = (time.perf_counter() - t0) / max(seconds, 1e-6)
        if (max_steps is not None and step >= max_steps) or (max_steps is None and frac >= 1.0):
            break
        idx = torch.randint(0, pool.shape[0], (batch,), device=device, generator=g)
        x = pool[idx]
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))) if step >= 50 else lr * (step + 1) / 50
        with _autocast(device):
            post = vae.encode(x).latent_dist
            z = post.sample(generator=g)
            rec = vae.decode(z).sample
        w = 1.0 + 20.0 * object_mask(x)
        mse = (w * (rec.float() - x) ** 2).mean() / w.mean()
        kl = post.kl().mean() / x[0].numel()
        loss = mse + 1e-6 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        losses.append(float(mse.detach()) if step % 50 == 0 else None)
        if step % 200 == 0:
            log(f"vae step {step} mse {float(mse.detach()):.5f} kl {float(kl.detach()):.3f} ({time.perf_counter() - t0:.0f} s)")
        step += 1
    vae.eval().requires_grad_(False)
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "batch": batch, "lr": lr,
            "mse_every_50": [x for x in losses if x is not None]}


@torch.no_grad()
def encode_pool(vae: Any, pool: torch.Tensor, batch: int = 1024) -> torch.Tensor:
    """Posterior-mode latents of ``pool`` through ``vae`` rounded to fp16 (the shipped weights)."""
    shipped = copy.deepcopy(vae).half().float().eval()
    return torch.cat([shipped.encode(pool[i:i + batch]).latent_dist.mode() for i in range(0, len(pool), batch)])


@torch.no_grad()
def vae_check(vae: Any, pool: torch.Tensor, n: int = 256) -> dict[str, float]:
    """PSNR (dB, on [0, 1] pixels) of posterior-mode reconstructions of the first ``n`` pool images."""
    x = pool[:n]
    shipped = copy.deepcopy(vae).half().float().eval()
    rec = shipped.decode(shipped.encode(x).latent_dist.mode()).sample.clamp(-1, 1)
    mse = float(((rec - x) / 2).pow(2).mean())
    return {"psnr_db": round(10 * math.log10(1.0 / max(mse, 1e-12)), 2), "n": n}


# ------------------------------------------------------------------------------------------
# Transformer
# ------------------------------------------------------------------------------------------


def pack(z: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, H/2 * W/2, 4C]`` (FluxPipeline's 2x2 packing)."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack` for a ``h`` x ``w`` latent."""
    b, _, d = x.shape
    c = d // 4
    return x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def image_ids(h: int, w: int, device: torch.device) -> torch.Tensor:
    """``[h/2 * w/2, 3]``: (0, row, col) per packed token, as FluxPipeline builds them."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 1] = torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, 3)


def tokenize(comps: dict[str, Any], prompts: Sequence[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(CLIP ids, T5 ids), each ``[B, TEXT_LEN]``, padded as the flux family pads them."""
    clip = comps["tokenizer"](list(prompts), padding="max_length", max_length=comps["tokenizer"].model_max_length,
                              truncation=True, return_tensors="pt").input_ids
    t5 = comps["tokenizer_2"](list(prompts), padding="max_length", max_length=TEXT_LEN, truncation=True,
                              return_tensors="pt").input_ids
    return clip.to(device), t5.to(device)


def encode_text(text: dict[str, Any], clip_ids: torch.Tensor, t5_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T5 states ``[B, L, D]``, CLIP pooled ``[B, D']``) — the family's ``encode_prompt`` on a batch."""
    pooled = text["text_encoder"](clip_ids, output_hidden_states=False).pooler_output
    states = text["text_encoder_2"](t5_ids, output_hidden_states=False)[0]
    return states, pooled


def predict(tf: Any, x: torch.Tensor, s: torch.Tensor, states: torch.Tensor, pooled: torch.Tensor,
            img_ids: torch.Tensor) -> torch.Tensor:
    txt_ids = torch.zeros(states.shape[1], 3, device=x.device)
    return tf(hidden_states=x, encoder_hidden_states=states, pooled_projections=pooled, timestep=s,
              img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]


class EMA:
    """Exponential moving average of several modules' parameters (fp32 copies)."""

    def __init__(self, modules: dict[str, Any], decay: float) -> None:
        self.decay = decay
        self.modules = {k: copy.deepcopy(m).float().eval().requires_grad_(False) for k, m in modules.items()}

    @torch.no_grad()
    def update(self, modules: dict[str, Any], decay: float | None = None) -> None:
        d = self.decay if decay is None else decay
        for k, m in modules.items():
            ema_p = list(self.modules[k].parameters())
            src = [p.detach().float() for p in m.parameters()]
            torch._foreach_lerp_(ema_p, src, 1.0 - d)


def train_dit(comps: dict[str, Any], latents: torch.Tensor, prompts: Sequence[str], *, seconds: float, batch: int,
              lr: float = 5e-4, warmup: int = 200, ema: EMA | None = None, ema_decay: float = 0.999,
              drop_prompt: float = 0.1, seed: int = 0, max_steps: int | None = None, log: Log = print,
              step0: int = 0, tick: Callable[[int, EMA], dict[str, Any]] | None = None,
              tick_seconds: float = 60.0) -> tuple[EMA, dict[str, Any]]:
    """Train transformer + text encoders of ``comps`` in place on normalized ``latents`` and their
    ``prompts``; returns the EMA (fresh unless ``ema``) and a log. ``tick(step, ema)`` (a quick
    evaluation) runs every ``tick_seconds`` of the time box (its time counts in the box)."""
    device = latents.device
    train_names = ("transformer", "text_encoder", "text_encoder_2")
    mods = {k: comps[k].to(device).float().train().requires_grad_(True) for k in train_names}
    if ema is None:
        ema = EMA(mods, ema_decay)
    else:
        for m in ema.modules.values():
            m.to(device)
    params = [p for m in mods.values() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    g = torch.Generator(device=device).manual_seed(seed + 7)
    # the prompts of the pool, tokenized once; "" (dropped) tokenized once
    clip_all, t5_all = tokenize(comps, prompts, device)
    clip_null, t5_null = tokenize(comps, [""], device)
    _, _, h, w = latents.shape
    ids = image_ids(h, w, device)
    t0, step, losses, ticks = time.perf_counter(), 0, [], []
    next_tick = tick_seconds
    while True:
        elapsed = time.perf_counter() - t0
        frac = elapsed / max(seconds, 1e-6)
        if (max_steps is not None and step >= max_steps) or (max_steps is None and frac >= 1.0):
            break
        if tick is not None and elapsed >= next_tick and (max_steps is not None or frac < 0.97):
            next_tick += tick_seconds
            ticks.append({"step": step + step0, "elapsed_s": round(elapsed, 1), **tick(step + step0, ema)})
        idx = torch.randint(0, latents.shape[0], (batch,), device=device, generator=g)
        x0 = latents[idx]
        drop = torch.rand(batch, device=device, generator=g) < drop_prompt
        clip_ids = torch.where(drop[:, None], clip_null, clip_all[idx])
        t5_ids = torch.where(drop[:, None], t5_null, t5_all[idx])
        s = torch.sigmoid(torch.randn(batch, device=device, generator=g))
        noise = torch.randn(x0.shape, device=device, generator=g)
        xs = (1 - s[:, None, None, None]) * x0 + s[:, None, None, None] * noise
        for group in opt.param_groups:
            group["lr"] = lr_at(step + step0, frac, lr, warmup)
        with _autocast(device):
            states, pooled = encode_text(mods, clip_ids, t5_ids)
            pred = predict(mods["transformer"], pack(xs), s, states, pooled, ids)
        loss = F.mse_loss(pred.float(), pack(noise - x0))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        # EMA warm-up: a short average while the model is young, the full decay later
        ema.update(mods, min(ema.decay, (1 + step + step0) / (10 + step + step0)))
        if step % 100 == 0:
            losses.append(round(float(loss.detach()), 5))
        if step % 500 == 0:
            log(f"dit step {step + step0} loss {float(loss.detach()):.4f} grad {float(gn):.3f} lr {opt.param_groups[0]['lr']:.2e} "
                f"({time.perf_counter() - t0:.0f} s)")
        step += 1
    for m in mods.values():
        m.eval().requires_grad_(False)
    return ema, {"steps": step, "total_steps": step + step0, "seconds": round(time.perf_counter() - t0, 1),
                 "batch": batch, "lr": lr, "warmup": warmup, "ema_decay": ema.decay, "drop_prompt": drop_prompt,
                 "steps_per_s": round(step / max(time.perf_counter() - t0, 1e-6), 2), "loss_every_100": losses,
                 "evals": ticks}


# ------------------------------------------------------------------------------------------
# Sampling (what the family's denoise does: flow-Euler, sigmas linspace(1, 1/n, n), shift 1)
# ------------------------------------------------------------------------------------------


@torch.no_grad()
def sample(comps: dict[str, Any], prompts: Sequence[str], seeds: Sequence[int], *, steps: int = 20,
           cfg_scale: float | None = None, batch: int = 256, size: int = 64) -> torch.Tensor:
    """Images ``[N, 3, size, size]`` in [0, 1] (float, CPU) for ``prompts`` with per-image ``seeds``.

    The initial noise per image is drawn as FluxPipeline draws it (a CPU generator seeded with the
    seed, shape ``[1, C, H/f, W/f]``); ``cfg_scale`` None: one conditional forward per step (the
    family's default ``embedded`` CFG on a model without guidance embedding), else true CFG on ""."""
    tf, vae = comps["transformer"], comps["vae"]
    device = next(tf.parameters()).device
    f = 2 ** (len(vae.config.block_out_channels) - 1)
    h = w = size // f
    c = vae.config.latent_channels
    sigmas = [*torch.linspace(1.0, 1.0 / steps, steps).tolist(), 0.0]
    ids = image_ids(h, w, device)
    out = []
    for i in range(0, len(prompts), batch):
        ps, ss = list(prompts[i:i + batch]), list(seeds[i:i + batch])
        noise = torch.cat([torch.randn(1, c, h, w, generator=torch.Generator().manual_seed(int(sd))) for sd in ss])
        x = pack(noise.to(device))
        states, pooled = encode_text(comps, *tokenize(comps, ps, device))
        if cfg_scale is not None:
            n_states, n_pooled = encode_text(comps, *tokenize(comps, [""], device))
        for k in range(steps):
            s = torch.full((len(ps),), sigmas[k], device=device)
            v = predict(tf, x, s, states, pooled, ids)
            if cfg_scale is not None:
                vu = predict(tf, x, s, n_states.expand(len(ps), -1, -1), n_pooled.expand(len(ps), -1), ids)
                v = vu + cfg_scale * (v - vu)
            x = x + (sigmas[k + 1] - sigmas[k]) * v
        z = unpack(x, h, w) / vae.config.scaling_factor + vae.config.shift_factor
        img = vae.decode(z.to(next(vae.parameters()).dtype)).sample.float()
        out.append((img * 0.5 + 0.5).clamp(0, 1).cpu())
    return torch.cat(out)
