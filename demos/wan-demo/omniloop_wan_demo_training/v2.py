"""wan-demo v2 and wan-demo-fast: one time-boxed GPU session whose phases are picked by flags.

    python -m omniloop_wan_demo_training.v2 --out $OUT --phases vae,dit,eval --vae-seconds 150 --dit-seconds 250
    python -m omniloop_wan_demo_training.v2 --out $OUT --resume .ckpt/v2-run1 --phases dit,eval --dit-seconds 380
    python -m omniloop_wan_demo_training.v2 --out $OUT --resume .ckpt/v2-run2 --phases distill,eval --distill-seconds 240
    python -m omniloop_wan_demo_training.v2 --out /tmp/v2-smoke --smoke            # every phase on a CPU, < 2 min
    python -m omniloop_wan_demo_training.v2 --ship DIR                             # install DIR's weights (CPU)

Phases (in this order, each skipped unless named in ``--phases``):

``vae``
    The v1 VAE (same architecture, the 14.5 MB budget) trained further on the 4-shape data with a
    loss up-weighted on object pixels, on object *edges* (a 3x3 max-min of the coverage) and on
    frame 0 (Wan's causal VAE codes frame 0 alone, and v1's frame 0 came out blurred). Every
    ``--vae-check-every`` seconds a held-out reconstruction check (W1's detector on 128 clips:
    color / direction / shape, PSNR of all frames and of frame 0) runs; training stops early once
    the gate passes (shape >= ``--gate-shape``, color and direction >= 0.98, frame-0 PSNR >=
    ``--gate-psnr0``) after ``--vae-min-seconds``. Starting from v1's weights keeps the latent space
    close to v1's, which is what makes the DiT warm start useful.
``dit``
    Latents of ``--n-clips`` fresh clips (posterior mode, the fp16-rounded VAE), normalized with
    their own statistics; the transformer and text encoder start from ``--resume`` (raw weights, or
    the pipeline's EMA weights) or else from v1's shipped weights (the text encoder's embedding
    grown by one row per new word, :func:`~.common.grow_text_encoder`). Rectified flow exactly as
    v1 (``train_dit``), but batch 1024 by default (v1's 256 ran launch-bound at ~8 steps/s, so a
    4x batch costs about the same per step), fused AdamW, text padded to two fixed lengths (512 as
    the pipelines pad, or 64), optional ``--compile``. ``--dit-reflow-clips N`` (an experiment
    against duplicate objects, 2026-12-02: it did not remove them, see the wan-demo README) first
    makes ``N`` reflow pairs with the starting weights (:mod:`.reflow`: the teacher's clip
    re-rendered clean where it put its object) and draws ``--dit-reflow-share`` of each batch from
    them (their own noise, no prompt drop), ``--dit-reflow-ghost-share`` of those from the pairs
    whose teacher clip held a ghost.
``decoder``
    The pipeline's (``dit``'s or ``--resume``'s) VAE decoder fine-tuned alone (encoder frozen, so
    the DiT stays valid; :mod:`.vae_decoder`) for ``--decoder-seconds``, with the loss also
    weighted ``--trail-weight`` on the object's path away from the object — where the decoder leaves
    the trails the evaluator counts as ghosts. Held-out checks report ghost-free clips beside
    color / direction / shape / PSNR; ``pipeline.tar`` gets the new VAE and a history entry.
``distill``
    wan-demo-fast (:mod:`.distill`): a student initialised from the v2 transformer, trained to map
    the few-step sampler's inputs at its 4 timesteps straight to the teacher's CFG-5 ODE solution
    (guidance baked in: it runs at guidance 1.0, one forward per step).
``eval``
    On the GPU with W1's detector (color / direction / shape, and ghost-free clips): v2's
    ``--eval-v2`` runs (``STEPS/CFG[/SHIFT][@SAMPLER]``: UniPC through diffusers' WanPipeline, or
    ``@euler`` / ``@euler-sde`` -- the runtime's ``flow-euler`` sampler without / with
    ``stochastic_sampling``, the preset's default since session J -- through
    :class:`.sampling.FlowEulerGenerator`) and wan-demo-fast with the few-step sampler at its 4
    timesteps, guidance 1 (this session's student, ``--resume``'s ``fast.tar``, or with ``--resume
    package`` the shipped one; ``--no-fast-eval`` skips it), on ``full_prompts() x --eval-seeds``
    (96 prompts x 4 seeds = 384 clips by default; ``0-15`` = 16 seeds). Each run records its
    duplicate objects (a ghost in >= 8 frames) in all and per seed.

Files written to ``--out`` (the run tool returns at most 8 files of <= 16 MiB, two folders deep):
``pipeline.tar`` (v2, diffusers format, fp16 EMA weights), ``raw-0.safetensors`` (raw weights,
fp16, to resume from), ``fast.tar`` (the student transformer + ``omniloop.json``), ``run.json``
(args, recipe, timings, logs, VAE gate, state), ``eval.json``, ``preview.png``; the shell script
adds ``log.txt``. ``--resume DIR`` reads ``pipeline.tar`` (or ``pipeline/``), ``raw-*.safetensors``
(optional: without them the raw weights restart from the EMA weights) and ``run.json``;
``--resume package`` continues from the shipped ``checkpoint/`` itself (EMA weights; step count and
history from its ``omniloop.json``), so a GPU session needs nothing carried but the wheels.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

PHASES = ("vae", "dit", "decoder", "distill", "eval")

#: ``--smoke`` with ``--vae-init fresh`` / ``--dit-init fresh``: models small enough for a CI check
TINY_VAE = {"base_dim": 8, "dim_mult": [1, 2, 2]}
TINY_DIT = {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 64, "freq_dim": 32}


def _dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, default=str))


def _log(*args: Any) -> None:
    print(*args, flush=True)


# ------------------------------------------------------------------------------------------
# VAE
# ------------------------------------------------------------------------------------------


def loss_weights(cov: torch.Tensor, *, object_weight: float, edge_weight: float, frame0_weight: float,
                 trail_weight: float = 0.0) -> torch.Tensor:
    """Per-pixel reconstruction weights ``[B, 1, T, H, W]``: ``(1 + object_weight * coverage +
    edge_weight * edge + trail_weight * trail) * (frame0_weight on frame 0, else 1)``; ``edge`` is
    1 within a pixel of the shape's outline (3x3 max minus min of the coverage), ``trail`` is the
    object's path over the clip where the object is not in this frame (the clip's max coverage
    minus the frame's): where the causal VAE's decoder leaves the trails the evaluator counts as
    ghosts (a latent frame codes 4 video frames, the object at 4 places)."""
    b, c, t, h, w = cov.shape
    flat = cov.transpose(1, 2).reshape(b * t, c, h, w)
    hi = torch.nn.functional.max_pool2d(flat, 3, 1, 1)
    lo = -torch.nn.functional.max_pool2d(-flat, 3, 1, 1)
    edge = (hi - lo).clamp(0, 1).reshape(b, t, c, h, w).transpose(1, 2)
    wts = 1.0 + object_weight * cov + edge_weight * edge
    if trail_weight:
        wts = wts + trail_weight * (cov.amax(dim=2, keepdim=True) - cov).clamp(0, 1)
    fw = torch.ones(t, device=cov.device)
    fw[0] = frame0_weight
    return wts * fw.view(1, 1, t, 1, 1)


@torch.no_grad()
@torch.no_grad()
def recon_report(vae, *, n: int = 128, seed: int = 999, device: str = "cuda", batch: int = 64) -> dict[str, Any]:
    """Held-out reconstructions (posterior mode): detector accuracy (``clean``: the share of clips
    with no ghost, :func:`~..evaluate.ghost_regions`), ghost frames in all, PSNR, PSNR of frame 0,
    the shape read per label and per colour (right / all), and the shape misses as
    ``"colour shape->read"`` counts (the demos' shape misses are mostly red: issue 41)."""
    from collections import Counter

    from omniloop_wan_demo.evaluate import detect

    from .render import render, sample_params, to_uint8_frames

    p = sample_params(n, seed)
    labels = p.labels()
    ok = {"color": 0, "direction": 0, "shape": 0, "clean": 0}
    ghost_frames = 0
    per_shape: dict[str, list[int]] = {}
    right: Counter = Counter()
    total: Counter = Counter()
    misses: Counter = Counter()
    se = se0 = 0.0
    for i in range(0, n, batch):
        sub = type(p)(*[getattr(p, f)[i : i + batch] for f in p.__dataclass_fields__])
        x = render(sub, device=device) * 2 - 1
        z = vae.encode(x).latent_dist.mode()
        xr = vae.decode(z).sample.float().clamp(-1, 1)
        se += float(((xr - x) ** 2).mean(dim=(1, 2, 3, 4)).sum())
        se0 += float(((xr[:, :, 0] - x[:, :, 0]) ** 2).mean(dim=(1, 2, 3)).sum())
        for j in range(len(sub)):
            d = detect(to_uint8_frames((xr[j] + 1) / 2))
            lab = labels[i + j]
            for k in ("color", "direction", "shape"):
                ok[k] += getattr(d, k) == lab[k]
            ok["clean"] += d.ghost_frames == 0
            ghost_frames += d.ghost_frames
            per_shape.setdefault(lab["shape"], []).append(int(d.shape == lab["shape"]))
            total[lab["color"]] += 1
            right[lab["color"]] += d.shape == lab["shape"]
            if d.shape != lab["shape"]:
                misses[f"{lab['color']} {lab['shape']}->{d.shape}"] += 1

    def psnr(mse: float) -> float:
        return round(float(10 * np.log10(4.0 / max(mse, 1e-12))), 2)

    return {"n": n, "psnr": psnr(se / n), "psnr_frame0": psnr(se0 / n),
            "accuracy": {k: v / n for k, v in ok.items()}, "ghost_frames": ghost_frames,
            "shape_by_label": {k: round(sum(v) / len(v), 3) for k, v in sorted(per_shape.items())},
            "shape_by_colour": {c: f"{right[c]}/{total[c]}" for c in sorted(total)},
            "misses": dict(misses.most_common())}


def gate_passes(rep: dict[str, Any], *, shape: float, psnr0: float) -> bool:
    acc = rep["accuracy"]
    return acc["shape"] >= shape and acc["color"] >= 0.98 and acc["direction"] >= 0.98 and rep["psnr_frame0"] >= psnr0


def vae_phase(a: argparse.Namespace, init_vae, dev: str) -> tuple[Any, dict[str, Any]]:
    """Train ``init_vae`` (v1's weights or a fresh model) with the weighted loss, gated."""
    from .render import render, sample_params
    from .train_vae import lr_at, vae_loss

    vae = init_vae.to(dev).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=a.vae_lr, betas=(0.9, 0.99), weight_decay=1e-4,
                            fused=dev.startswith("cuda"))
    gen = torch.Generator(dev).manual_seed(a.seed + 1)
    info: dict[str, Any] = {"init": a.vae_init, "batch": a.vae_batch, "lr": a.vae_lr, "object_weight": a.object_weight,
                            "edge_weight": a.edge_weight, "frame0_weight": a.frame0_weight, "kl_weight": 1e-5,
                            "gate": {"shape": a.gate_shape, "color": 0.98, "direction": 0.98, "psnr_frame0": a.gate_psnr0},
                            "log": [], "checks": []}
    n_check = 4 if a.smoke else 128
    if not a.smoke:
        rep = recon_report(vae.eval(), n=n_check, device=dev)
        rep.update(step=0, t=0.0)
        info["checks"].append(rep)
        _log("vae check", json.dumps(rep))
        vae.train()
    t0 = time.perf_counter()
    last_check = t0
    step = 0
    max_steps = 1 if a.smoke else None
    amp = dev.startswith("cuda")
    while True:
        el = time.perf_counter() - t0
        if el >= a.vae_seconds or (max_steps is not None and step >= max_steps):
            break
        frac = el / a.vae_seconds if max_steps is None else step / max_steps
        for g in opt.param_groups:
            g["lr"] = lr_at(step, frac, a.vae_lr, warmup=50)
        p = sample_params(a.vae_batch, (a.seed + 11) * 1_000_003 + step)
        x, cov = render(p, device=dev, return_mask=True)
        x = x * 2 - 1
        w = loss_weights(cov, object_weight=a.object_weight, edge_weight=a.edge_weight, frame0_weight=a.frame0_weight)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            # vae_loss weights by 1 + object_weight * coverage: pass (w - 1) with weight 1
            loss, parts = vae_loss(vae, x, w - 1.0, object_weight=1.0, kl_weight=1e-5, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or a.smoke:
            rec = dict(step=step, t=round(time.perf_counter() - t0, 1), lr=opt.param_groups[0]["lr"],
                       **{k: round(float(v), 6) for k, v in parts.items()})
            info["log"].append(rec)
            _log("vae", json.dumps(rec))
        if time.perf_counter() - last_check >= a.vae_check_every and time.perf_counter() - t0 < a.vae_seconds:
            tc = time.perf_counter()
            rep = recon_report(vae.eval(), n=n_check, device=dev)
            vae.train()
            rep.update(step=step, t=round(tc - t0, 1))
            info["checks"].append(rep)
            _log("vae check", json.dumps(rep))
            t0 += time.perf_counter() - tc  # checks do not eat the training budget
            last_check = time.perf_counter()
            if time.perf_counter() - t0 >= a.vae_min_seconds and gate_passes(rep, shape=a.gate_shape, psnr0=a.gate_psnr0):
                info["stopped_early"] = True
                break
    info["steps"], info["seconds"] = step, round(time.perf_counter() - t0, 1)
    # what ships is fp16: check and encode with exactly those weights
    vae = vae.half().float().eval()
    rep = recon_report(vae, n=n_check, device=dev)
    rep.update(step=step, final=True, fp16_rounded=True)
    info["checks"].append(rep)
    info["final"] = rep
    info["gate_passed"] = gate_passes(rep, shape=a.gate_shape, psnr0=a.gate_psnr0)
    _log("vae final", json.dumps(rep), "gate", "PASSED" if info["gate_passed"] else "NOT passed")
    return vae, info


# ------------------------------------------------------------------------------------------
# DiT
# ------------------------------------------------------------------------------------------


def dit_phase(a: argparse.Namespace, vae, tok, *, stats, init: dict[str, Any], dev: str) -> tuple[dict[str, Any], dict[str, Any]]:
    from .common import encode_tokens, param_count, tokenize
    from .train_dit import EMA, PROMPTS, encode_dataset, normalize_latents, sample_sigmas

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    info: dict[str, Any] = {"log": [], "init": init["note"]}
    t_enc = time.perf_counter()
    lat, pid, cov = encode_dataset(vae, n=a.n_clips, seed=a.seed + 17 + 1000 * a.data_round, device=dev,
                                   batch=256, max_seconds=a.encode_seconds, coverage=True)
    info["encode_seconds"] = round(time.perf_counter() - t_enc, 1)
    info["n_clips"] = int(lat.shape[0])
    lat, stats = normalize_latents(vae, lat, stats)
    info["latents_mean"], info["latents_std"] = stats
    _log(f"dit: {lat.shape[0]} latents in {info['encode_seconds']}s; normalized std {float(lat.std()):.3f}")

    transformer, text_encoder = init["transformer"].to(dev).train(), init["text_encoder"].to(dev).train()
    pairs = None
    if a.dit_reflow_clips:
        # reflow pairs from the starting weights (the EMA ones when resuming): reflow.py says why
        from .reflow import make_pairs

        teacher = init["ema_transformer"] if init.get("ema_transformer") is not None else transformer
        teacher_te = init["ema_text_encoder"] if init.get("ema_text_encoder") is not None else text_encoder
        teacher, teacher_te = teacher.to(dev).eval(), teacher_te.to(dev).eval()
        pairs = make_pairs(teacher, teacher_te, tok, vae, n=a.dit_reflow_clips, guidance=a.dit_reflow_guidance,
                           steps=a.dit_reflow_steps, device=dev, seed=a.seed + 31337 + 1000 * a.data_round,
                           budget_s=a.dit_reflow_seconds, stats=stats, workers=a.workers)
        teacher.train(transformer is teacher)
        teacher_te.train(text_encoder is teacher_te)
        info["reflow"] = pairs.pop("info")
        info["reflow"]["pairs"] = int(pairs["x0"].shape[0])
        _log("dit: reflow pairs", json.dumps(info["reflow"]))
        if not info["reflow"]["pairs"]:
            _log("dit: WARNING no reflow pair (no generated clip could be fitted): plain training")
            pairs = None
    ema = EMA({"transformer": transformer, "text_encoder": text_encoder}, a.ema_decay)
    if init.get("ema_transformer") is not None:
        ema.shadow["transformer"].load_state_dict(init["ema_transformer"].state_dict())
        ema.shadow["text_encoder"].load_state_dict(init["ema_text_encoder"].state_dict())
    info["params"] = {"transformer": param_count(transformer), "text_encoder": param_count(text_encoder)}
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=a.dit_lr, betas=(0.9, 0.99), weight_decay=0.01, fused=dev.startswith("cuda"))
    fwd = transformer
    if a.compile:
        fwd = torch.compile(transformer, dynamic=False)
    ids, mask = tokenize(tok, [*PROMPTS, ""])
    ids, mask = ids.to(dev), mask.to(dev)
    uncond = len(PROMPTS)
    start_step = int(init.get("step", 0))
    gen = torch.Generator(dev).manual_seed(a.seed + 1000 + start_step)
    host = np.random.default_rng(a.seed + start_step)
    batch = a.dit_batch
    max_steps = 2 if a.smoke else None
    amp = dev.startswith("cuda")
    shifts = torch.tensor(a.dit_shift_list, device=dev)
    n_pairs = 0 if pairs is None else max(1, round(batch * a.dit_reflow_share))
    ghost_idx = None if pairs is None else torch.nonzero(pairs["ghost"]).flatten()
    n_ghost = 0 if ghost_idx is None or not len(ghost_idx) else round(n_pairs * a.dit_reflow_ghost_share)

    def one_step(step: int, fwd_fn) -> torch.Tensor:
        el = time.perf_counter() - t0
        frac = el / a.dit_seconds if max_steps is None else step / max_steps
        w = min(1.0, (step + 1) / a.warmup)
        dec = 1.0 if frac < 0.8 else max(0.1, (1 - frac) / 0.2)
        for g in opt.param_groups:
            g["lr"] = a.dit_lr * w * dec
        idx = torch.randint(0, lat.shape[0], (batch - n_pairs,), device=dev, generator=gen)
        x0, p, c = lat[idx], pid[idx], cov[idx]
        drop = torch.rand(batch - n_pairs, device=dev, generator=gen) < 0.1
        p = torch.where(drop, torch.full_like(p, uncond), p)
        noise = torch.randn(x0.shape, device=dev, generator=gen)
        if n_pairs:  # reflow pairs: their own noise and prompt (no prompt drop)
            j = torch.randint(0, pairs["x0"].shape[0], (n_pairs,), device=dev, generator=gen)
            if n_ghost:  # the first n_ghost of them from the pairs that correct a ghost
                j[:n_ghost] = ghost_idx[torch.randint(0, ghost_idx.shape[0], (n_ghost,), device=dev, generator=gen)]
            x0 = torch.cat([x0, pairs["x0"][j].float()])
            noise = torch.cat([noise, pairs["noise"][j].float()])
            p, c = torch.cat([p, pairs["pid"][j]]), torch.cat([c, pairs["cov"][j]])
        wts = 1.0 + a.dit_object_weight * c.to(x0.dtype)  # [B, 1, T, H, W]
        pad_to = 512 if host.random() < a.pad512 else 64  # two fixed lengths: no recompiles, no sync
        # each sample's flow shift drawn from --dit-shifts (one value: plain shifted logit-normal)
        sh = shifts[0] if len(shifts) == 1 else shifts[torch.randint(0, len(shifts), (batch,), device=dev, generator=gen)]
        s = sample_sigmas(batch, mode="logit_normal", shift=sh, device=dev, gen=gen)
        sb = s.view(-1, 1, 1, 1, 1)
        xt = (1 - sb) * x0 + sb * noise
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            emb = encode_tokens(text_encoder, ids[p], mask[p], pad_to)
            pred = fwd_fn(hidden_states=xt, timestep=s * 1000.0, encoder_hidden_states=emb, return_dict=False)[0]
        # object cells up-weighted (shape lives in a few cells); normalised so the scale matches plain MSE
        loss = (wts * (pred.float() - (noise - x0)).square()).mean() / wts.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema.update(start_step + step)
        return loss.detach()

    t0 = time.perf_counter()
    step = 0
    run_loss, run_n = torch.zeros((), device=dev), 0
    t_last, s_last = t0, 0
    while True:
        el = time.perf_counter() - t0
        if el >= a.dit_seconds or (max_steps is not None and step >= max_steps):
            break
        if step == 0 and a.compile:
            try:
                tc = time.perf_counter()
                run_loss += one_step(step, fwd)
                info["compile_first_step_s"] = round(time.perf_counter() - tc, 1)
            except Exception as e:  # fall back to eager rather than lose the session
                info["compile_error"] = f"{type(e).__name__}: {e}"[:500]
                _log("torch.compile failed, eager from here:", info["compile_error"])
                fwd = transformer
                run_loss += one_step(step, fwd)
        else:
            run_loss += one_step(step, fwd)
        run_n += 1
        step += 1
        if step % a.log_every == 0 or a.smoke:
            now = time.perf_counter()
            rec = {"step": start_step + step, "t": round(now - t0, 1), "lr": opt.param_groups[0]["lr"],
                   "loss": round(float(run_loss) / run_n, 5),
                   "steps_per_s": round((step - s_last) / max(now - t_last, 1e-9), 2),
                   "samples_per_s": round((step - s_last) * batch / max(now - t_last, 1e-9), 1)}
            t_last, s_last = now, step
            run_loss, run_n = torch.zeros((), device=dev), 0
            info["log"].append(rec)
            _log("dit", json.dumps(rec))
    info["steps"] = step
    info["total_steps"] = start_step + step
    info["seconds"] = round(time.perf_counter() - t0, 1)
    info["samples"] = step * batch
    info["recipe"] = dict(batch=batch, lr=a.dit_lr, cfg_drop=0.1,
                          shift=a.dit_shift_list[0] if len(a.dit_shift_list) == 1 else list(a.dit_shift_list),
                          timestep_sampling="logit_normal",
                          object_weight=a.dit_object_weight, ema_decay=a.ema_decay, warmup=a.warmup, decay_frac=0.2, pad512=a.pad512,
                          compile=a.compile, n_clips=info["n_clips"],
                          reflow=None if pairs is None else dict(pairs=info["reflow"]["pairs"], share=a.dit_reflow_share,
                                                                   ghost_share=a.dit_reflow_ghost_share if n_ghost else 0.0,
                                                                   guidance=a.dit_reflow_guidance,
                                                                   teacher_steps=a.dit_reflow_steps))
    modules = {"transformer": transformer.eval(), "text_encoder": text_encoder.eval(),
               "ema_transformer": ema.shadow["transformer"], "ema_text_encoder": ema.shadow["text_encoder"]}
    return modules, info


# ------------------------------------------------------------------------------------------
# Initial weights
# ------------------------------------------------------------------------------------------


def v1_dir() -> Path:
    """v1's weights: the shipped checkpoint until v2 is installed, then ``checkpoint_causal``'s
    own copy of v1's VAE / text encoder while the causal variant kept them (:func:`ship`). Since
    issue 41 the causal variant is trained on v2 and links v2's parts, so this is ``checkpoint/``
    (v2) again: v1's VAE / text encoder are only in git history (``checkpoint_causal/`` before the
    issue-41 retrain); export them to a folder and give ``--v1-from`` for a v1 warm start."""
    from omniloop_wan_demo.checkpoint_path import causal_checkpoint_dir, checkpoint_dir

    own = causal_checkpoint_dir() / "vae"
    if own.is_dir() and not own.is_symlink():
        return causal_checkpoint_dir()
    return checkpoint_dir()


def previous_run(rdir: Path) -> dict[str, Any]:
    """``{"state": {"step": N}, "history": [...]}`` of the run being resumed: its ``run.json``, else
    the ``training`` record a shipped checkpoint's ``omniloop.json`` keeps (``--resume package``)."""
    if (rdir / "run.json").exists():
        prev = json.loads((rdir / "run.json").read_text())
        return {"state": prev.get("state") or {}, "history": list(prev.get("history") or [])}
    meta = rdir / "pipeline" / "omniloop.json"
    training = json.loads(meta.read_text()).get("training", {}) if meta.exists() else {}
    return {"state": {"step": int(training.get("trained_steps", 0))}, "history": list(training.get("history") or [])}


def load_init(a: argparse.Namespace, rdir: Path | None) -> dict[str, Any]:
    """Transformer / text encoder to start from: ``--resume`` (raw + EMA), else v1's shipped
    weights (``--dit-init v1``), else fresh."""
    from diffusers import WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from omniloop_wan_demo.checkpoint_path import checkpoint_dir

    from .common import build_text_encoder, build_transformer, grow_text_encoder, load_split

    if rdir is not None:
        pdir = rdir / "pipeline"
        ema_t = WanTransformer3DModel.from_pretrained(str(pdir / "transformer"), torch_dtype=torch.float32)
        ema_te = UMT5EncoderModel.from_pretrained(str(pdir / "text_encoder"), torch_dtype=torch.float32)
        t, te = copy.deepcopy(ema_t), copy.deepcopy(ema_te)
        note = f"resumed from {rdir}: EMA from pipeline/"
        if list(rdir.glob("raw-*.safetensors")):
            raw = load_split(rdir / "raw")
            t.load_state_dict({k[len("transformer."):]: v.float() for k, v in raw.items() if k.startswith("transformer.")})
            te.load_state_dict({k[len("text_encoder."):]: v.float() for k, v in raw.items() if k.startswith("text_encoder.")},
                               strict=False)
            note += ", raw weights from raw-*.safetensors"
        else:
            note += ", raw weights restarted from the EMA weights (no raw-*.safetensors)"
        step = previous_run(rdir)["state"].get("step", 0)
        return {"transformer": t, "text_encoder": te, "ema_transformer": ema_t, "ema_text_encoder": ema_te,
                "step": step, "note": note}
    if a.dit_init == "v1":
        # the v1 transformer is the shipped one until v2 is installed
        src = checkpoint_dir() if a.v1_from is None else Path(a.v1_from)
        t = WanTransformer3DModel.from_pretrained(str(src / "transformer"), torch_dtype=torch.float32)
        te_dir = v1_dir() / "text_encoder" if a.v1_from is None else src / "text_encoder"
        te = grow_text_encoder(UMT5EncoderModel.from_pretrained(str(te_dir), torch_dtype=torch.float32))
        return {"transformer": t, "text_encoder": te, "step": 0, "note": f"warm start from v1 ({src}); text encoder grown"}
    from .common import DIT_CONFIG

    cfg = dict(DIT_CONFIG, **TINY_DIT) if a.smoke else None
    return {"transformer": build_transformer(cfg), "text_encoder": build_text_encoder(), "step": 0,
            "note": "fresh (tiny: --smoke)" if a.smoke else "fresh"}


# ------------------------------------------------------------------------------------------
# Evaluation
# ------------------------------------------------------------------------------------------


def eval_phase(a: argparse.Namespace, ckpt: Path | None, fast: Path | None, dev: str, out: Path) -> dict[str, Any]:
    from diffusers import WanPipeline

    from omniloop_wan_demo.evaluate import evaluate, full_prompts

    from .distill import FewStepGenerator
    from .train_dit import clip_records, duplicates, pipeline_eval

    res: dict[str, Any] = {"detector": "omniloop_wan_demo.evaluate.detect (color, direction, shape)", "runs": []}
    prompts = full_prompts()[:2] if a.smoke else full_prompts()
    seeds = [0] if a.smoke else a.eval_seed_list
    t0 = time.perf_counter()
    previews: list[np.ndarray] = []
    if ckpt is None:
        return res
    pipe = WanPipeline.from_pretrained(str(ckpt), torch_dtype=torch.float32).to(dev)
    shipped_scheduler = pipe.scheduler
    plan: list[tuple[str, int, float, float | None, str]] = [
        ("v2", 2 if a.smoke else steps, g, shift, sampler) for steps, g, shift, sampler in a.eval_v2_plan]
    if fast is not None and not a.no_fast_eval:
        plan.insert(1, ("fast", 4, 1.0, None, "few-step"))
    for name, steps, g, shift, sampler in plan:
        if time.perf_counter() - t0 > a.eval_seconds and res["runs"]:
            res["truncated"] = True
            break
        t1 = time.perf_counter()
        if name == "v2" and sampler == "unipc":
            from .common import build_scheduler

            pipe.scheduler = shipped_scheduler if shift is None else build_scheduler("unipc", shift)
            r = pipeline_eval(pipe, prompts=prompts, seeds=seeds, steps=steps, guidance=g)
            r.update(model="v2", sampler="unipc", flow_shift=float(pipe.scheduler.config.flow_shift))
        elif name == "v2":
            from .common import load_tokenizer
            from .sampling import FlowEulerGenerator

            flow_shift = float(shipped_scheduler.config.flow_shift) if shift is None else shift
            gen = FlowEulerGenerator(pipe, load_tokenizer(ckpt / "tokenizer"), device=dev, shift=flow_shift,
                                     stochastic=sampler == "euler-sde")
            rep = evaluate(gen, prompts=prompts, seeds=seeds, steps=steps, guidance_scale=g,
                           backend=f"{sampler} (GPU, diffusers modules)")
            r = rep.to_dict(with_clips=False) | {"clips": clip_records(rep)}
            r.update(model="v2", sampler=sampler, flow_shift=flow_shift)
        else:
            from .common import load_tokenizer
            from .distill import load_student

            student = load_student(fast, dev)
            gen = FewStepGenerator(student, pipe.text_encoder, load_tokenizer(ckpt / "tokenizer"), pipe.vae, device=dev,
                                   timesteps=a.fast_timesteps_list)
            rep = evaluate(gen, prompts=prompts, seeds=seeds, steps=len(a.fast_timesteps_list), guidance_scale=1.0,
                           backend="few-step (GPU, diffusers modules)")
            r = rep.to_dict(with_clips=False) | {"clips": clip_records(rep)}
            r.update(model="fast", sampler="few-step", timesteps=list(a.fast_timesteps_list))
            if len(previews) < 2:
                vids = gen(prompts[:: max(1, len(prompts) // 8)][:8], [0] * min(8, len(prompts)), steps=4, guidance_scale=1.0)
                previews.append(np.concatenate([np.concatenate([v[i] for i in (0, 4, 8, 12, 16)], axis=1) for v in vids], axis=0))
        r["wall_s"] = round(time.perf_counter() - t1, 2)
        r.update(duplicates(r["clips"]))
        if name == "v2" and len(previews) < 1:
            from omniloop_wan_demo.evaluate import DiffusersGenerator

            sub = prompts[:: max(1, len(prompts) // 8)][:8]
            vids = DiffusersGenerator(pipe, batch_size=8)(sub, [0] * len(sub), steps=steps, guidance_scale=g)
            previews.append(np.concatenate([np.concatenate([v[i] for i in (0, 4, 8, 12, 16)], axis=1) for v in vids], axis=0))
        res["runs"].append(r)
        _log("eval", name, sampler, steps, g, shift, r["n"], json.dumps(r["accuracy"]), "duplicates", r["duplicate_clips"],
             r["wall_s"])
    if previews:
        from PIL import Image

        h = min(p.shape[0] for p in previews)
        Image.fromarray(np.concatenate([p[:h] for p in previews], axis=1)).save(out / "preview.png")
    return res


# ------------------------------------------------------------------------------------------
# The session
# ------------------------------------------------------------------------------------------


def parse_eval_plan(text: str, error: Callable[[str], Any]) -> list[tuple[int, float, float | None, str]]:
    """``"20/5,50/5/1,20/3@euler-sde"`` -> ``[(20, 5.0, None, "unipc"), (50, 5.0, 1.0, "unipc"),
    (20, 3.0, None, "euler-sde")]`` (steps, guidance, flow shift, sampler: ``sampling.EVAL_SAMPLERS``)."""
    from .sampling import EVAL_SAMPLERS

    plan = []
    for item in (t.strip() for t in text.split(",")):
        body, _, sampler = item.partition("@")
        sampler = sampler or "unipc"
        parts = body.split("/")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            steps, g = int(parts[0]), float(parts[1])
            shift = float(parts[2]) if len(parts) == 3 else None
        except ValueError:
            error(f"--eval-v2: {item!r} is not STEPS/GUIDANCE[/SHIFT][@SAMPLER]")
            raise
        if steps < 1 or not math.isfinite(g) or g < 0 or (shift is not None and (not math.isfinite(shift) or shift <= 0)):
            error(f"--eval-v2: {item!r}: steps >= 1, guidance >= 0 and shift > 0, all finite")
        if sampler not in EVAL_SAMPLERS:
            error(f"--eval-v2: {item!r}: unknown sampler {sampler!r} (known: {', '.join(EVAL_SAMPLERS)})")
        plan.append((steps, g, shift, sampler))
    if not plan:
        error("--eval-v2: at least one STEPS/GUIDANCE entry")
    return plan


def parse_seeds(text: str, error: Callable[[str], Any]) -> list[int]:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]`` (``--eval-seeds``; seeds >= 0, no repeats)."""
    seeds: list[int] = []
    for item in (t.strip() for t in text.split(",")):
        lo, dash, hi = item.partition("-")
        try:
            seeds.extend(range(int(lo), int(hi) + 1) if dash else [int(item)])
        except ValueError:
            error(f"--eval-seeds: {item!r} is not a seed or a LO-HI range")
            raise
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        error(f"--eval-seeds: {text!r}: at least one seed, all >= 0, none twice")
    return seeds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="wan-demo v2 / wan-demo-fast GPU session (see module docstring)")
    ap.add_argument("--out", help="output folder ($OUT)")
    ap.add_argument("--ship", metavar="DIR", help="install DIR's pipeline.tar / fast.tar into the package and exit")
    ap.add_argument("--phases", default="vae,dit,eval", help=f"comma list of {', '.join(PHASES)}")
    ap.add_argument("--resume", help="folder with pipeline.tar (or pipeline/), optional raw-*.safetensors, run.json; "
                                     "'package': the checkpoint/ this package ships (its EMA weights and training history)")
    ap.add_argument("--smoke", action="store_true", help="every phase tiny (CPU check, < 2 min)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--radius", help="LO,HI object radius range in px (default: data.RADIUS_RANGE)")
    ap.add_argument("--session-seconds", type=float, default=None,
                    help="whole-session budget: the DiT (or, with distill, the student) trains for what is left "
                         "after the earlier phases, keeping --eval-seconds for the evaluation (overrides "
                         "--dit-seconds / --distill-seconds)")
    g = ap.add_argument_group("vae")
    g.add_argument("--vae-init", default="v1", choices=["v1", "fresh"])
    g.add_argument("--vae-seconds", type=float, default=150)
    g.add_argument("--vae-min-seconds", type=float, default=90)
    g.add_argument("--vae-check-every", type=float, default=45)
    g.add_argument("--vae-batch", type=int, default=32)
    g.add_argument("--vae-lr", type=float, default=3e-4)
    g.add_argument("--object-weight", type=float, default=20.0)
    g.add_argument("--edge-weight", type=float, default=30.0)
    g.add_argument("--frame0-weight", type=float, default=3.0)
    g.add_argument("--gate-shape", type=float, default=0.95)
    g.add_argument("--gate-psnr0", type=float, default=26.0)
    g = ap.add_argument_group("dit")
    g.add_argument("--dit-init", default="v1", choices=["v1", "fresh"], help="without --resume")
    g.add_argument("--v1-from", help="(tests) a folder holding v1's transformer/ and text_encoder/")
    g.add_argument("--dit-seconds", type=float, default=250)
    g.add_argument("--dit-batch", type=int, default=1024)
    g.add_argument("--dit-lr", type=float, default=4e-4)
    g.add_argument("--warmup", type=int, default=100)
    g.add_argument("--dit-object-weight", type=float, default=4.0,
                   help="loss weight 1 + W on latent cells the object covers (dilated one cell); 0 = plain MSE")
    g.add_argument("--dit-shifts", default="3",
                   help="flow shift(s) of the training timesteps (logit-normal, then shifted), comma list: "
                        "each sample draws one; smaller values train more on the low-noise steps")
    g.add_argument("--ema-decay", type=float, default=0.999)
    g.add_argument("--n-clips", type=int, default=49152)
    g.add_argument("--encode-seconds", type=float, default=45)
    g.add_argument("--data-round", type=int, default=None, help="data seed offset (default: 1 when resuming, else 0)")
    g.add_argument("--pad512", type=float, default=0.75, help="share of batches with text padded to 512 (else 64)")
    g.add_argument("--dit-reflow-clips", type=int, default=0,
                   help="reflow pairs from the starting weights with re-rendered endpoints (training/reflow.py; 0: off)")
    g.add_argument("--dit-reflow-share", type=float, default=0.25, help="share of each DiT batch drawn from the reflow pairs")
    g.add_argument("--dit-reflow-ghost-share", type=float, default=0.0,
                   help="share of the reflow samples drawn from the pairs whose teacher clip held a ghost")
    g.add_argument("--dit-reflow-guidance", type=float, default=3.0, help="the teacher's CFG scale for the reflow pairs")
    g.add_argument("--dit-reflow-steps", type=int, default=20, help="flow-Euler steps of the teacher for the reflow pairs")
    g.add_argument("--dit-reflow-seconds", type=float, default=150, help="cap on making the reflow pairs")
    g.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                   help="processes that fit the reflow clips (CPU)")
    g.add_argument("--compile", action="store_true", help="torch.compile the transformer (eager fallback)")
    g.add_argument("--log-every", type=int, default=100)
    g = ap.add_argument_group("decoder")
    g.add_argument("--decoder-seconds", type=float, default=240)
    g.add_argument("--decoder-batch", type=int, default=96)
    g.add_argument("--decoder-lr", type=float, default=2e-4)
    g.add_argument("--decoder-check-every", type=float, default=60)
    g.add_argument("--trail-weight", type=float, default=20.0,
                   help="decoder loss weight on the object's path away from the object (where trails, "
                        "i.e. ghosts, appear); 0 = sessions B and C's loss")
    g = ap.add_argument_group("distill")
    g.add_argument("--distill-seconds", type=float, default=240)
    g.add_argument("--distill-gen-seconds", type=float, default=90, help="cap on generating teacher targets")
    g.add_argument("--distill-clips", type=int, default=12288)
    g.add_argument("--distill-batch", type=int, default=512)
    g.add_argument("--distill-lr", type=float, default=1e-4)
    g.add_argument("--teacher-steps", type=int, default=32, help="Euler steps of the teacher ODE from sigma 1")
    g.add_argument("--teacher-guidance", type=float, default=5.0)
    g.add_argument("--fast-timesteps", default="1000,750,500,250")
    g = ap.add_argument_group("eval")
    g.add_argument("--eval-seconds", type=float, default=60)
    g.add_argument("--eval-seeds", default="0,1,2,3", help="comma list of seeds and LO-HI ranges, e.g. 0-15")
    g.add_argument("--no-fast-eval", action="store_true", help="evaluate v2's runs only (not wan-demo-fast)")
    g.add_argument("--eval-v2", default="20/5,4/5",
                   help="v2's runs, comma list of STEPS/GUIDANCE[/SHIFT][@SAMPLER] (SAMPLER: unipc (default), "
                        "euler or euler-sde, the runtime's flow-euler with stochastic_sampling; SHIFT defaults to "
                        "the pipeline scheduler's flow shift); wan-demo-fast runs after the first")
    a = ap.parse_args(argv)
    a.phase_list = [p.strip() for p in a.phases.split(",") if p.strip()]
    bad = [p for p in a.phase_list if p not in PHASES]
    if bad:
        ap.error(f"--phases: unknown phase {bad[0]!r} (known: {', '.join(PHASES)})")
    a.fast_timesteps_list = tuple(int(t) for t in a.fast_timesteps.split(","))
    if a.data_round is None:
        a.data_round = 1 if a.resume else 0
    try:
        a.dit_shift_list = tuple(float(v) for v in a.dit_shifts.split(","))
    except ValueError:
        ap.error(f"--dit-shifts: a comma list of numbers, got {a.dit_shifts!r}")
    if not all(math.isfinite(v) and v > 0 for v in a.dit_shift_list):
        ap.error(f"--dit-shifts: every shift must be a finite number > 0, got {a.dit_shifts!r}")
    a.eval_v2_plan = parse_eval_plan(a.eval_v2, ap.error)
    a.eval_seed_list = parse_seeds(a.eval_seeds, ap.error)
    if not math.isfinite(a.trail_weight) or a.trail_weight < 0:
        ap.error(f"--trail-weight: must be a finite number >= 0, got {a.trail_weight}")
    if a.decoder_batch < 1:
        ap.error(f"--decoder-batch: must be >= 1, got {a.decoder_batch}")
    if not math.isfinite(a.dit_object_weight) or a.dit_object_weight < 0:
        ap.error(f"--dit-object-weight: must be a finite number >= 0, got {a.dit_object_weight}")
    if a.dit_reflow_clips < 0:
        ap.error(f"--dit-reflow-clips: must be >= 0, got {a.dit_reflow_clips}")
    if not math.isfinite(a.dit_reflow_share) or not 0 < a.dit_reflow_share < 1:
        ap.error(f"--dit-reflow-share: must be a finite number in (0, 1), got {a.dit_reflow_share}")
    if not math.isfinite(a.dit_reflow_ghost_share) or not 0 <= a.dit_reflow_ghost_share <= 1:
        ap.error(f"--dit-reflow-ghost-share: must be a finite number in [0, 1], got {a.dit_reflow_ghost_share}")
    if not math.isfinite(a.dit_reflow_guidance) or a.dit_reflow_guidance < 1:
        ap.error(f"--dit-reflow-guidance: must be a finite number >= 1, got {a.dit_reflow_guidance}")
    if a.dit_reflow_steps < 1 or a.workers < 1:
        ap.error("--dit-reflow-steps and --workers: must be >= 1")
    for k in ("vae_seconds", "dit_seconds", "dit_reflow_seconds", "decoder_seconds", "decoder_lr", "distill_seconds", "distill_gen_seconds",
              "eval_seconds", "dit_lr", "vae_lr"):
        v = getattr(a, k)
        if not math.isfinite(v) or v <= 0:
            ap.error(f"--{k.replace('_', '-')}: must be a finite number > 0, got {v}")
    if a.session_seconds is not None and (not math.isfinite(a.session_seconds) or a.session_seconds <= 0):
        ap.error(f"--session-seconds: must be a finite number > 0, got {a.session_seconds}")
    if not a.ship and not a.out:
        ap.error("--out is required (or --ship DIR)")
    if a.smoke:
        a.vae_batch, a.dit_batch, a.n_clips, a.distill_clips, a.distill_batch = 2, 2, 8, 4, 2
        a.teacher_steps, a.log_every = 2, 1
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.ship:
        from .ship import ship

        print(json.dumps(ship(Path(a.ship)), indent=1))
        return 0
    from diffusers import AutoencoderKLWan

    from omniloop_wan_demo.checkpoint_path import checkpoint_dir, fast_checkpoint_dir

    from .common import VAE_CONFIG, build_tokenizer, build_vae, load_split, save_pipeline, save_split, tar_dir, untar
    from .train_dit import make_pipeline

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="wan_demo_v2_"))
    dev = a.device
    if a.radius:
        from . import render as data

        lo, hi = (float(v) for v in a.radius.split(","))
        data.RADIUS_RANGE = (lo, hi)
    t_start = time.perf_counter()
    run: dict[str, Any] = {"args": {k: v for k, v in vars(a).items()}, "torch": torch.__version__,
                           "device": torch.cuda.get_device_name(0) if dev.startswith("cuda") else "cpu", "phases": {}}
    from . import render as _data

    run["data"] = {"shapes": list(_data.SHAPES), "radius_range": list(_data.RADIUS_RANGE)}
    try:
        import diffusers
        import transformers

        run["diffusers"], run["transformers"] = diffusers.__version__, transformers.__version__
    except Exception:
        pass
    rdir = Path(a.resume) if a.resume else None
    if a.resume == "package":
        rdir = work / "resume"  # the shipped checkpoint/ (wan-demo v2's EMA weights), read in place
        rdir.mkdir()
        (rdir / "pipeline").symlink_to(checkpoint_dir().resolve(), target_is_directory=True)
    if rdir is not None and not (rdir / "pipeline").exists():
        if not (rdir / "pipeline.tar").exists():
            raise SystemExit(f"--resume {rdir}: neither pipeline/ nor pipeline.tar there")
        untar(rdir / "pipeline.tar", rdir)
    if rdir is not None:
        run["previous"] = previous_run(rdir)
    history = list((run.get("previous") or {}).get("history") or [])
    tok = build_tokenizer(work / "tokenizer")
    ckpt: Path | None = rdir / "pipeline" if rdir is not None else None
    fast: Path | None = None

    def save_run() -> None:
        _dump(out / "run.json", run)

    def phase_done() -> None:
        """The history so far into run.json; the phase's cached GPU memory released."""
        run["history"] = history
        save_run()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()

    # ---- VAE -------------------------------------------------------------------------------
    stats = None
    if "vae" in a.phase_list:
        init = (AutoencoderKLWan.from_pretrained(str(v1_dir() / "vae"), torch_dtype=torch.float32)
                if a.vae_init == "v1" else build_vae(dict(VAE_CONFIG, **TINY_VAE) if a.smoke else None))
        vae, vinfo = vae_phase(a, init, dev)
        run["phases"]["vae"] = vinfo
        history.append({"phase": "vae", "steps": vinfo["steps"], "seconds": vinfo["seconds"], "gate_passed": vinfo["gate_passed"]})
    elif rdir is not None:
        vae = AutoencoderKLWan.from_pretrained(str(rdir / "pipeline" / "vae"), torch_dtype=torch.float32).to(dev).eval()
        stats = (list(vae.config.latents_mean), list(vae.config.latents_std))
    else:
        vae = AutoencoderKLWan.from_pretrained(str(v1_dir() / "vae"), torch_dtype=torch.float32).to(dev).eval()
        stats = (list(vae.config.latents_mean), list(vae.config.latents_std))
    run["vae_done_s"] = round(time.perf_counter() - t_start, 1)
    save_run()

    # ---- DiT -------------------------------------------------------------------------------
    if "dit" in a.phase_list:
        if "vae" in a.phase_list:
            stats = None  # a new VAE: new latent statistics
        init = load_init(a, rdir if "vae" not in a.phase_list else None)
        if a.session_seconds and "distill" not in a.phase_list:
            # the DiT takes what the session has left (a VAE gate passed early gives it more);
            # encoding (<= --encode-seconds), saving and the evaluation are kept aside
            left = a.session_seconds - (time.perf_counter() - t_start) - a.encode_seconds - 20
            left -= a.eval_seconds if "eval" in a.phase_list else 0
            a.dit_seconds = max(30.0, left)
            _log(f"dit: {a.dit_seconds:.0f}s left in the {a.session_seconds:.0f}s session")
        modules, dinfo = dit_phase(a, vae, tok, stats=stats, init=init, dev=dev)
        run["phases"]["dit"] = dinfo
        history.append({"phase": "dit", "steps": dinfo["steps"], "seconds": dinfo["seconds"], "batch": a.dit_batch,
                        "total_steps": dinfo["total_steps"]})
        pipe = make_pipeline(vae, modules["ema_transformer"], modules["ema_text_encoder"], tok)
        ckpt = save_pipeline(pipe, work / "pipeline", meta={"trained_steps": dinfo["total_steps"], "history": history,
                                                            "recipe": dinfo["recipe"]})
        _fix_omniloop_json(ckpt, history)
        tar_dir(ckpt, out / "pipeline.tar")
        state = {f"transformer.{k}": v.half() for k, v in modules["transformer"].state_dict().items()}
        seen: set[int] = set()
        for k, v in modules["text_encoder"].state_dict().items():
            if v.data_ptr() not in seen:  # UMT5 ties its embedding: save it once
                seen.add(v.data_ptr())
                state[f"text_encoder.{k}"] = v.half()
        for p in save_split(state, work / "raw"):
            shutil.copy(p, out / p.name)
        run["state"] = {"step": dinfo["total_steps"]}
        del modules, pipe
    elif "vae" in a.phase_list:
        # a VAE alone: ship it as a pipeline folder around v1's transformer (not a usable model)
        run["note"] = "vae only: pipeline.tar not written; the VAE is in vae.tar"
        vdir = work / "vae"
        vae.half().save_pretrained(str(vdir))
        vae.float()
        tar_dir(vdir, out / "vae.tar")
    run["history"] = history  # (first here: run.json's key order as before)
    run["dit_done_s"] = round(time.perf_counter() - t_start, 1)
    phase_done()

    # ---- decoder ----------------------------------------------------------------------------
    if "decoder" in a.phase_list:
        if ckpt is None:
            raise SystemExit("--phases decoder needs a pipeline: the dit phase or --resume DIR")
        ckpt, entry = decoder_phase(a, ckpt, work / "decoder" / "pipeline", dev)  # tarred as pipeline/
        run["phases"]["decoder"] = entry.pop("info")
        history.append(entry)
        _set_history(ckpt, history)
        tar_dir(ckpt, out / "pipeline.tar")
        phase_done()

    # ---- distill -----------------------------------------------------------------------------
    if "distill" in a.phase_list:
        if ckpt is None:
            raise SystemExit("--phases distill needs a teacher: the dit phase or --resume DIR")
        from .distill import distill_phase

        if a.session_seconds:
            left = a.session_seconds - (time.perf_counter() - t_start) - a.distill_gen_seconds - 20
            left -= a.eval_seconds if "eval" in a.phase_list else 0
            a.distill_seconds = max(30.0, left)
            _log(f"distill: {a.distill_seconds:.0f}s of training left in the {a.session_seconds:.0f}s session")
        fast, finfo = distill_phase(a, ckpt, work / "fast", dev)
        tar_dir(fast, out / "fast.tar")
        if "dit" not in a.phase_list and rdir is not None and (rdir / "pipeline.tar").is_file():
            shutil.copy(rdir / "pipeline.tar", out / "pipeline.tar")  # the teacher, so that $OUT ships alone
        run["phases"]["distill"] = finfo
        history.append({"phase": "distill", "steps": finfo["steps"], "seconds": finfo["seconds"]})
        run["history"] = history
        save_run()
    elif rdir is not None and (rdir / "fast.tar").exists():
        untar(rdir / "fast.tar", work)
        fast = work / "fast"
    elif a.resume == "package" and (fast_checkpoint_dir() / "transformer").is_dir():
        fast = fast_checkpoint_dir()  # the shipped student (the eval decodes it with ckpt's VAE)

    # ---- eval --------------------------------------------------------------------------------
    if "eval" in a.phase_list and ckpt is not None:
        try:
            res = eval_phase(a, ckpt, fast, dev, out)
            _dump(out / "eval.json", res)
        except Exception:
            traceback.print_exc()
            run["eval_error"] = traceback.format_exc()[-2000:]
    run["total_s"] = round(time.perf_counter() - t_start, 1)
    save_run()
    _log(f"done in {run['total_s']}s; files: {sorted(p.name for p in out.iterdir())}")
    del checkpoint_dir, load_split
    return 0


def decoder_phase(a: argparse.Namespace, ckpt: Path, dest: Path, dev: str) -> tuple[Path, dict[str, Any]]:
    """Fine-tune ``ckpt``'s VAE decoder (:func:`.vae_decoder.finetune_decoder`: encoder frozen, so
    the DiT's latents stay valid) with ``--trail-weight``; ``dest`` = a copy of ``ckpt`` (links
    followed) with that VAE. Returns ``dest`` and the history entry (its ``info``: the full log)."""
    from diffusers import AutoencoderKLWan

    from .vae_decoder import finetune_decoder

    vae = AutoencoderKLWan.from_pretrained(str(ckpt / "vae"), torch_dtype=torch.float32)
    info = finetune_decoder(vae, seconds=a.decoder_seconds, batch=2 if a.smoke else a.decoder_batch, lr=a.decoder_lr,
                            seed=a.seed, device=dev, check_every=0 if a.smoke else a.decoder_check_every,
                            max_steps=2 if a.smoke else None, n_check=4 if a.smoke else 256,
                            trail_weight=a.trail_weight)
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ckpt, dest, symlinks=False)
    shutil.rmtree(dest / "vae")
    vae.half().save_pretrained(str(dest / "vae"))
    final = info["final"]
    entry = {"phase": "vae_decoder", "steps": info["steps"], "seconds": info["seconds"], "batch": info["batch"],
             "lr": a.decoder_lr, "trail_weight": a.trail_weight, "trained": "decoder + post_quant_conv (encoder frozen)",
             "recon_shape": final["accuracy"]["shape"], "recon_clean": final["accuracy"]["clean"],
             "recon_psnr_frame0": final["psnr_frame0"], "info": info}
    _log("decoder: recon before", json.dumps(info["checks"][0]["accuracy"]), "after", json.dumps(final["accuracy"]))
    return dest, entry


def _set_history(ckpt: Path, history: list[dict[str, Any]]) -> None:
    """Write ``history`` into ``ckpt/omniloop.json``'s training record."""
    f = ckpt / "omniloop.json"
    info = json.loads(f.read_text())
    info.setdefault("training", {})["history"] = history
    f.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def _fix_omniloop_json(ckpt: Path, history: list[dict[str, Any]]) -> None:
    from .common import V2_SAMPLING

    f = ckpt / "omniloop.json"
    info = json.loads(f.read_text())
    info["version"] = 2
    info["defaults"].update(V2_SAMPLING)
    f.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.exit(main())
