"""Train the tone-demo checkpoint: the Oobleck VAE, then the DiT (with the T5 encoder and the
projection model) in its latent space, then ship and score it.

    python -m omniloop_tone_demo_training.train --out OUT --device cuda --vae-seconds 110 --dit-seconds 230

The DiT objective is the one diffusers' ``StableAudioPipeline`` + ``CosineDPMSolverMultistepScheduler``
sample with: for ``t`` in (0, 1), ``sigma = tan(t pi / 2)``; the model sees
``cos(t pi/2) z + sin(t pi/2) n`` (the scheduler's ``x * c_in`` for ``x = z + sigma n``) and the
timestep ``t`` (its ``precondition_noise``: ``atan(sigma) 2 / pi``) and predicts
``v = cos(t pi/2) n - sin(t pi/2) z``, so that the scheduler's ``c_skip x + c_out v`` (sigma_data 1,
``c_out = -sigma / sqrt(sigma^2 + 1)``) is ``z``. Classifier-free guidance: with probability
``cfg_drop`` the whole cross-attention input (text and seconds tokens) is zero, which is the
pipeline's unconditional branch when no negative prompt is given; the global (seconds) input stays.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from omniloop_tone_demo.evaluate import clip_seed, evaluate_clips
from omniloop_tone_demo.grammar import CLIP_SECONDS, Spec, eval_specs, random_specs, synthesize
from omniloop_tone_demo.linear_vae import wn_weight

from .build import FULL, TOY, assemble, build_parts, load_parts, param_count, save


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- data
def make_bank(n: int, device: str, seed: int = 0, chunk: int = 2048,
              drum_share: float | None = None) -> tuple[torch.Tensor, list[Spec]]:
    """``n`` random clips (a quarter per timbre; ``drum_share``: that share of noise drums, the rest
    split evenly over the tonal timbres) and their specs."""
    gen = torch.Generator().manual_seed(seed)
    specs = random_specs(n, gen)
    if drum_share is not None:
        tonal = [s for s in specs if s.timbre != "noise"]
        drums = random_specs(4 * n, gen)
        drums = [s for s in drums if s.timbre == "noise"]
        k = round(drum_share * n)
        specs = drums[:k] + tonal[:n - k]
        if len(specs) < n:
            specs += random_specs(n - len(specs), gen)
        order = torch.randperm(n, generator=gen).tolist()
        specs = [specs[i] for i in order]
    clips = [synthesize(specs[i:i + chunk], gen=gen, device=device) for i in range(0, n, chunk)]
    return torch.cat(clips), specs


# ---------------------------------------------------------------- VAE
def stft_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Multi-resolution STFT loss (log-magnitude L1 + spectral convergence) at 3 window sizes."""
    total = x.new_zeros(())
    for n_fft in (128, 512, 2048):
        win = torch.hann_window(n_fft, device=x.device)
        X = torch.stft(x.flatten(0, 1), n_fft, n_fft // 4, window=win, return_complex=True).abs()
        Y = torch.stft(y.flatten(0, 1), n_fft, n_fft // 4, window=win, return_complex=True).abs()
        total = total + (torch.log(X + 1e-5) - torch.log(Y + 1e-5)).abs().mean()
        total = total + torch.linalg.norm(X - Y) / (torch.linalg.norm(Y) + 1e-7)
    return total


def budget_used(t0: float, step: int, *, seconds: float, max_steps: int | None) -> float | None:
    """The fraction of a training budget used at ``step`` (by wall time since ``t0``, or by steps
    when ``max_steps`` is set), or None once ``seconds`` have passed or ``max_steps`` ran."""
    elapsed = time.time() - t0
    if elapsed >= seconds or (max_steps is not None and step >= max_steps):
        return None
    return min(1.0, elapsed / seconds) if max_steps is None else step / max_steps


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, *, clip: Any = None) -> float:
    """One update: gradients reset, ``loss`` backpropagated, their norm over the parameters
    ``clip`` (if given) clipped to 1.0, the step taken; returns the loss as a float."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(clip, 1.0)
    opt.step()
    return float(loss.detach())


def train_vae(vae, bank: torch.Tensor, *, seconds: float, max_steps: int | None, batch: int, lr: float = 1e-3,
              kl_weight: float = 1e-4) -> dict[str, Any]:
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, betas=(0.8, 0.99), weight_decay=0.0)
    gen = torch.Generator(device=bank.device).manual_seed(1)
    t0, step, last = time.time(), 0, {}
    while True:
        frac = budget_used(t0, step, seconds=seconds, max_steps=max_steps)
        if frac is None:
            break
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        idx = torch.randint(0, bank.shape[0], (batch,), generator=gen, device=bank.device)
        x = bank[idx]
        post = vae.encode(x).latent_dist
        z = post.sample()
        y = vae.decode(z).sample
        rec = F.l1_loss(y, x) + stft_loss(y, x)
        kl = post.kl().mean()
        loss = rec + kl_weight * kl
        optimizer_step(opt, loss, clip=vae.parameters())
        step += 1
        if step % 200 == 1:
            log(f"vae step {step} rec {rec.item():.4f} kl {kl.item():.2f}")
        last = {"rec": float(rec.item()), "kl": float(kl.item())}
    vae.eval()
    return {"phase": "vae", "steps": step, "seconds": round(time.time() - t0, 1), "batch": batch, "lr": lr,
            "kl_weight": kl_weight, **last}


@torch.no_grad()
def encode(vae, clips: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    return torch.cat([vae.encode(clips[i:i + chunk]).latent_dist.mode() for i in range(0, clips.shape[0], chunk)])


@torch.no_grad()
def decode(vae, latents: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    return torch.cat([vae.decode(latents[i:i + chunk]).sample for i in range(0, latents.shape[0], chunk)])


@torch.no_grad()
def normalize_latents(vae, scale: torch.Tensor) -> None:
    """Fold a per-channel latent scale into the VAE so that its latents come out divided by
    ``scale`` and its decoder expects them so: the encoder's mean channels (the first half of
    ``encoder.conv2``'s outputs) are divided, the decoder's first conv multiplies its inputs back.
    Decoding ``encode(x).mode()`` is unchanged (float round-off); the posterior's std channels are
    left as they are (the pipeline never encodes)."""
    c = scale.numel()
    conv = vae.encoder.conv2
    conv.weight_g[:c] /= scale.view(-1, 1, 1)
    conv.bias[:c] /= scale
    conv = vae.decoder.conv1
    w = wn_weight(conv) * scale.view(1, -1, 1)
    conv.weight_v.copy_(w)
    conv.weight_g.copy_(w.flatten(1).norm(dim=1).view(-1, 1, 1))


# ---------------------------------------------------------------- DiT
class Conditioner(torch.nn.Module):
    """Text and seconds conditioning exactly as ``StableAudioPipeline.encode_prompt`` /
    ``encode_duration`` build them (start 0, end = the clip length)."""

    def __init__(self, text_encoder, projection_model):
        super().__init__()
        self.text_encoder, self.projection_model = text_encoder, projection_model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.text_encoder(ids, attention_mask=mask)[0]
        h = self.projection_model(text_hidden_states=h).text_hidden_states
        h = h * mask.unsqueeze(-1).to(h.dtype)
        b = ids.shape[0]
        start = torch.zeros(b, device=ids.device)
        end = torch.full((b,), float(CLIP_SECONDS), device=ids.device)
        p = self.projection_model(start_seconds=start, end_seconds=end)
        s, e = p.seconds_start_hidden_states, p.seconds_end_hidden_states
        return torch.cat([h, s, e], dim=1), torch.cat([s, e], dim=2)


def sample_t(n: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """Half uniform in (0, 1), half log-uniform in sigma over the sampler's range [0.3, 500]."""
    u = torch.rand(n, generator=gen, device=device)
    log_sigma = math.log(0.3) + (math.log(500.0) - math.log(0.3)) * torch.rand(n, generator=gen, device=device)
    t_log = torch.atan(log_sigma.exp()) * 2 / math.pi
    pick = torch.rand(n, generator=gen, device=device) < 0.5
    return torch.where(pick, u, t_log).clamp(1e-4, 1 - 1e-4)


def v_loss(transformer, cond: Conditioner, z: torch.Tensor, ids, mask, gen, *, cfg_drop: float, rotary) -> torch.Tensor:
    b = z.shape[0]
    t = sample_t(b, gen, z.device)
    a, s = torch.cos(t * math.pi / 2).view(-1, 1, 1), torch.sin(t * math.pi / 2).view(-1, 1, 1)
    n = torch.randn(z.shape, generator=gen, device=z.device)
    x = a * z + s * n
    v = a * n - s * z
    enc, glob = cond(ids, mask)
    drop = (torch.rand(b, generator=gen, device=z.device) < cfg_drop).view(-1, 1, 1)
    enc = torch.where(drop, torch.zeros_like(enc), enc)
    pred = transformer(x, t, encoder_hidden_states=enc, global_hidden_states=glob, rotary_embedding=rotary,
                       return_dict=False)[0]
    return F.mse_loss(pred.float(), v)


def rotary_for(transformer, device: str):
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    cos, sin = get_1d_rotary_pos_embed(transformer.config.attention_head_dim // 2, transformer.config.sample_size + 1,
                                       use_real=True, repeat_interleave_real=False)
    return cos.to(device), sin.to(device)


def train_dit(parts: dict[str, Any], latents: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, *, seconds: float,
              max_steps: int | None, batch: int, lr: float = 5e-4, cfg_drop: float = 0.1, ema_decay: float = 0.999,
              bf16: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    transformer = parts["transformer"]
    cond = Conditioner(parts["text_encoder"], parts["projection_model"])
    model = torch.nn.ModuleDict({"transformer": transformer, "cond": cond}).train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    ema_params, model_params = list(ema.parameters()), list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    device = latents.device.type
    gen = torch.Generator(device=latents.device).manual_seed(2)
    rotary = rotary_for(transformer, latents.device)
    t0, step, last = time.time(), 0, float("nan")
    while True:
        frac = budget_used(t0, step, seconds=seconds, max_steps=max_steps)
        if frac is None:
            break
        # warm-up 200 steps, flat, linear decay over the last 25 % of the budget
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 200) * min(1.0, (1.0 - frac) / 0.25)
        idx = torch.randint(0, latents.shape[0], (batch,), generator=gen, device=latents.device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            loss = v_loss(transformer, cond, latents[idx], ids[idx], mask[idx], gen, cfg_drop=cfg_drop, rotary=rotary)
        optimizer_step(opt, loss, clip=params)
        step += 1
        d = min(ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, model_params, 1 - d)
        if step % 500 == 1:
            log(f"dit step {step} loss {loss.item():.4f}")
        last = float(loss.item())
    trained = {"transformer": ema["transformer"], "text_encoder": ema["cond"].text_encoder,
               "projection_model": ema["cond"].projection_model}
    return trained, {"phase": "dit", "steps": step, "seconds": round(time.time() - t0, 1), "batch": batch, "lr": lr,
                     "cfg_drop": cfg_drop, "ema_decay": ema_decay, "bf16": bf16, "last_loss": last}


@torch.no_grad()
def round_to(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round ``module``'s floating parameters and buffers to ``dtype`` and back (in place): the
    weights a checkpoint stored in ``dtype`` loads as."""
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_floating_point():
            t.copy_(t.to(dtype).to(t.dtype))


# ---------------------------------------------------------------- scoring
@torch.no_grad()
def generate(pipe, specs: list[Spec], seeds: list[int], *, steps: int, guidance: float, device: str,
             chunk: int = 96) -> tuple[list[np.ndarray], list[Spec]]:
    clips, used = [], []
    jobs = [(s, clip_seed(seed, i)) for seed in seeds for i, s in enumerate(specs)]  # every clip its own noise
    for i in range(0, len(jobs), chunk):
        part = jobs[i:i + chunk]
        gens = [torch.Generator(device=device).manual_seed(seed) for _, seed in part]
        out = pipe(prompt=[s.prompt for s, _ in part], num_inference_steps=steps, guidance_scale=guidance,
                   generator=gens, output_type="pt").audios
        clips += [a.float().cpu().numpy() for a in out]
        used += [s for s, _ in part]
    return clips, used


def run(out: Path, *, device: str, toy: bool, vae_seconds: float, dit_seconds: float, vae_steps: int | None,
        dit_steps: int | None, n_clips: int, vae_batch: int, dit_batch: int, sweeps: list[tuple[int, float]],
        eval_seeds: list[int], bf16: bool, eval_prompts: int = 96, vae_kind: str = "trained",
        transformer: dict[str, int] | None = None, lr: float = 5e-4, store: str = "float16",
        init: Path | None = None, drum_share: float | None = None, bank_seed: int = 0) -> dict[str, Any]:
    """Train and ship one checkpoint into ``out/checkpoint``; ``transformer`` overrides the DiT's
    config (e.g. ``num_layers``); ``store``: the dtype of the shipped weights (the trained modules
    are rounded to it before scoring, so the scores are the shipped model's); a linear VAE is
    shipped as its two projections (:mod:`omniloop_tone_demo.linear_vae`). ``init``: fine-tune that
    checkpoint folder instead of training from scratch (its VAE and configs are kept);
    ``drum_share``: the share of noise-drum clips in the training bank (default a quarter)."""
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": device, "toy": toy, "history": []}
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    configs = dict(TOY if toy else FULL)
    if vae_kind == "linear":  # the closed-form PCA Oobleck (linear_vae): 32 latent channels at hop 64
        from omniloop_tone_demo.linear_vae import LINEAR_VAE_CONFIG

        configs["vae"] = LINEAR_VAE_CONFIG
        latent = LINEAR_VAE_CONFIG["decoder_input_channels"]
        configs["transformer"] = {**configs["transformer"], "in_channels": latent, "out_channels": latent}
    if transformer:
        configs["transformer"] = {**configs["transformer"], **transformer}
    report["vae_kind"] = vae_kind
    if init is not None:  # fine-tune a checkpoint (e.g. the output of .shrink); its VAE is kept as it is
        parts = load_parts(init)
        init_meta = json.loads((Path(init) / "omniloop.json").read_text()) if (Path(init) / "omniloop.json").exists() else {}
        report["history"] += list((init_meta.get("training") or {}).get("history") or [])
        report["history"].append({"phase": "init", "from": str(init)})
        report["vae_kind"] = vae_kind = "linear" if (Path(init) / "vae" / "linear_oobleck.safetensors").exists() else vae_kind
    else:
        parts = build_parts(configs)
    report["params"] = {k: param_count(v) for k, v in parts.items() if isinstance(v, torch.nn.Module)}
    log(f"params {report['params']}")
    for k in ("vae", "text_encoder", "projection_model", "transformer"):
        parts[k].to(device)
    t0 = time.time()
    bank, specs = make_bank(n_clips, device, seed=bank_seed, drum_share=drum_share)
    log(f"bank {tuple(bank.shape)} in {time.time() - t0:.1f}s")
    if init is not None:
        pass
    elif vae_kind == "linear":
        from .linear_vae import fit

        t0 = time.time()
        report["history"].append({"phase": "vae", "kind": "linear (PCA)", **fit(parts["vae"], bank[:256]),
                                  "steps": 0, "seconds": round(time.time() - t0, 1)})
    else:
        report["history"].append(train_vae(parts["vae"], bank, seconds=vae_seconds, max_steps=vae_steps, batch=vae_batch))
    log(f"vae {report['history'][-1]}")
    if init is None:
        lat = encode(parts["vae"], bank)
        scale = lat.transpose(0, 1).flatten(1).std(dim=1).clamp_min(1e-3)
        report["latent_raw"] = {"std": scale.tolist(), "mean": lat.transpose(0, 1).flatten(1).mean(dim=1).tolist()}
        normalize_latents(parts["vae"], scale)
        if vae_kind == "linear":  # from here on the VAE is the one the checkpoint ships: rebuilt from its projections
            from omniloop_tone_demo import linear_vae

            parts["vae"] = linear_vae.build(dict(parts["vae"].config), linear_vae.projections(parts["vae"])).to(device)
    else:
        report["latent_raw"] = (init_meta.get("training") or {}).get("latent_raw")
    lat = encode(parts["vae"], bank)
    report["latent_normalized"] = {"std": float(lat.std()), "mean": float(lat.mean())}
    # the VAE's own adherence: reconstructions of fresh ground-truth clips, scored (a fine-tune keeps its VAE)
    if init is None:
        gt_specs = eval_specs(eval_prompts)
        gt = synthesize(gt_specs, gen=torch.Generator().manual_seed(123), device=device)
        rec = decode(parts["vae"], encode(parts["vae"], gt))
        r = evaluate_clips([c.float().cpu().numpy() for c in rec], gt_specs)
        report["vae_reconstruction_adherence"] = r.accuracy
        log(f"vae reconstructions {r.accuracy}")
    del bank
    tok = parts["tokenizer"]([s.prompt for s in specs], padding="max_length", max_length=tok_len(parts), truncation=True,
                             return_tensors="pt")
    ids, mask = tok.input_ids.to(device), tok.attention_mask.to(device)
    trained, hist = train_dit(parts, lat, ids, mask, seconds=dit_seconds, max_steps=dit_steps, batch=dit_batch, lr=lr,
                              bf16=bf16)
    report["history"].append(hist)
    log(f"dit {hist}")
    parts.update(trained)
    for k in ("vae", "text_encoder", "projection_model", "transformer"):
        parts[k].eval().requires_grad_(False)
    for k in ("text_encoder", "projection_model", "transformer"):
        round_to(parts[k], getattr(torch, store))
    report["store"] = store
    pipe = assemble(parts)
    meta = {"variant": "tone-demo", "version": 1, "tasks": ["t2a"], "adherence": {"kind": "audio"},
            "defaults": {"steps": 100, "guidance_scale": 7.0},
            "training": {"history": report["history"], "latent_raw": report["latent_raw"],
                         "vae_reconstruction_adherence": report.get("vae_reconstruction_adherence"), "n_clips": n_clips}}
    # saved before scoring: a run that is stopped while it scores still leaves its checkpoint
    save(pipe, out / "checkpoint", meta, store=getattr(torch, store), compact_vae=vae_kind == "linear")
    (out / "report.json").write_text(json.dumps(report, indent=1))
    log(f"saved {out / 'checkpoint'}")
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    report["scores"] = []
    for steps, g in sweeps:
        t0 = time.time()
        clips, used = generate(pipe, eval_specs(eval_prompts), eval_seeds, steps=steps, guidance=g, device=device)
        gen_s = time.time() - t0
        rep = evaluate_clips(clips, used)
        report["scores"].append({"steps": steps, "guidance": g, "n": rep.n, "accuracy": rep.accuracy,
                                 "counts": rep.counts, "generate_seconds": round(gen_s, 2)})
        (out / f"clips-{steps}-{g:g}.json").write_text(json.dumps([v.to_dict() for v in rep.verdicts]))
        log(f"score steps {steps} guidance {g}: {rep.accuracy} ({gen_s:.1f}s)")
        (out / "report.json").write_text(json.dumps(report, indent=1))
    if report["scores"]:
        best = max(report["scores"], key=lambda s: (s["accuracy"]["all"], -s["steps"]))
        meta["defaults"] = {"steps": best["steps"], "guidance_scale": best["guidance"]}
        meta["training"]["scores"] = report["scores"]
        (out / "checkpoint" / "omniloop.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return report


def tok_len(parts: dict[str, Any]) -> int:
    return int(parts["tokenizer"].model_max_length)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--toy", action="store_true", help="toy model sizes (the CPU smoke test)")
    ap.add_argument("--vae-seconds", type=float, default=110.0)
    ap.add_argument("--dit-seconds", type=float, default=230.0)
    ap.add_argument("--vae-steps", type=int, default=None)
    ap.add_argument("--dit-steps", type=int, default=None)
    ap.add_argument("--clips", type=int, default=16384)
    ap.add_argument("--vae-batch", type=int, default=32)
    ap.add_argument("--dit-batch", type=int, default=256)
    ap.add_argument("--sweep", default="25:4", help="steps:guidance pairs scored after training (the SDE sampler's Brownian "
                    "tree is slow: 100 steps over 192 clips took 118 s on an H200)")
    ap.add_argument("--eval-seeds", default="0,1")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--vae", default="trained", choices=["trained", "linear"],
                    help="trained: the Oobleck trained with L1 + STFT + KL; linear: fitted in closed form (linear_vae)")
    ap.add_argument("--eval-prompts", type=int, default=96, help="prompts scored (VAE reconstructions and samples)")
    ap.add_argument("--lr", type=float, default=5e-4, help="the DiT's peak learning rate")
    ap.add_argument("--layers", type=int, default=None, help="the DiT's num_layers (default: build.TRANSFORMER_CONFIG's)")
    ap.add_argument("--kv-heads", type=int, default=None, help="the DiT's num_key_value_attention_heads")
    ap.add_argument("--init", type=Path, default=None, help="fine-tune this checkpoint folder (e.g. from .shrink)")
    ap.add_argument("--drum-share", type=float, default=None, help="share of noise-drum clips in the bank (default 1/4)")
    ap.add_argument("--bank-seed", type=int, default=0, help="seed of the training bank")
    ap.add_argument("--store", default="float16", choices=["float16", "bfloat16", "float32"],
                    help="dtype of the shipped weights (the runtime loads them in its own dtype)")
    a = ap.parse_args(argv)
    sweeps = [(int(p.split(":")[0]), float(p.split(":")[1])) for p in a.sweep.split(",") if p]
    run(a.out, device=a.device, toy=a.toy, vae_seconds=a.vae_seconds, dit_seconds=a.dit_seconds, vae_steps=a.vae_steps,
        dit_steps=a.dit_steps, n_clips=a.clips, vae_batch=a.vae_batch, dit_batch=a.dit_batch, sweeps=sweeps,
        eval_seeds=[int(s) for s in a.eval_seeds.split(",") if s], bf16=a.bf16,
        eval_prompts=a.eval_prompts, vae_kind=a.vae, lr=a.lr, store=a.store, init=a.init, drum_share=a.drum_share,
        bank_seed=a.bank_seed,
        transformer={k: v for k, v in (("num_layers", a.layers), ("num_key_value_attention_heads", a.kv_heads))
                     if v is not None})


if __name__ == "__main__":
    main()
