"""Fine-tune the VAE's decoder against the specks it draws from generated latents (issue 41's "no ghost").

What is left of wan-demo-fast's ghosts once duplicates are gone are *specks*: 8-20 pixel blobs in
the complementary tint of the object (green beside a red or yellow object, magenta beside a green
one), one or two frames long, a dozen pixels behind the object, mostly in the last frame of a latent
frame (4, 12, 16). ``scripts/speck_probe.py`` shows they are the decoder's reading of latents the
student draws: the latent cell under a speck is no outlier among the clip's background cells, and the
decoder's round trip of a generated clip (decode, encode, decode) draws *more* of them. The decoder
was trained on the encoder's latents of rendered clips only, where it is 99 % speck-free.

The recipe here trains the decoder (and ``post_quant_conv``; the encoder and so the DiT's latent
space untouched, as ``vae_decoder``) on three kinds of examples per step:

* **speck clips**: student latents whose decode holds a ghost in fewer than
  ``train_dit.DUPLICATE_FRAMES`` frames (a speck or a short trail, not a second object — that is the
  student's layout, not the decoder's), with a target that is the decode itself where the speck's
  pixels (dilated by ``DILATE`` px) are taken from the nearest frame in which those pixels are
  background: the backgrounds of the data are static, so that is what the frame would show there;
* **other student latents**, target = the starting decoder's own output (keeps everything else);
* **rendered clips** with ``vae_decoder``'s loss on posterior samples (keeps the reconstruction).

``--focus red`` (or ``red:star``) draws ``--focus-frac`` of the rendered clips with that label: both
demos' shape misses are mostly red (fast: 64 of 71 on the GPU clips) and the VAE alone reads ~1 in 3
red stars back as circles. With the latents' prompts (``speck_probe.py latents`` stores them), a
student clip whose decode misreads its prompt's shape is not kept (its own decode would be the
target). A focused run needs no speck clip.

Which pixels are specks is the evaluator's ``ghosts`` (the detector the figures use); the held-out
check decodes other seeds' latents, so a decoder that only learned its training clips gains nothing.

    python -m omniloop_wan_demo_training.decoder_specks --latents lat_train.pt --out /tmp/decsp --seconds 1200
    python demos/wan-demo/scripts/speck_probe.py score lat_heldout.pt --variants shipped,vae:/tmp/decsp/vae
    python -m omniloop_wan_demo_training.decoder_specks --latents lat_train.pt --out /tmp/decred --focus red --focus-frac 0.75
    python -m omniloop_wan_demo_training.decoder_specks --ship /tmp/decsp     # after its GPU evaluation
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

#: speck pixels are widened by this many pixels before they are replaced (their faint rim counts too)
DILATE = 2


def _dilate(mask: np.ndarray, r: int) -> np.ndarray:
    t = torch.from_numpy(mask.astype(np.float32))[:, None]
    return (torch.nn.functional.max_pool2d(t, 2 * r + 1, 1, r)[:, 0] > 0).numpy()


def speck_target(video: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """For a decoded clip (``[T, H, W, 3]`` uint8): ``(target, speck mask)`` with every speck pixel
    replaced by the same pixel of the temporally nearest frame where it is background (neither
    object nor speck; the frame's median colour where no frame is), or ``None`` when the clip has no
    speck or holds a duplicate object (a ghost in ``DUPLICATE_FRAMES`` frames or more)."""
    from omniloop_wan_demo.evaluate import _as_float_frames, ghosts, object_masks, regions

    from .train_dit import DUPLICATE_FRAMES

    f = _as_float_frames(video)
    objm = object_masks(f)
    T = f.shape[0]
    speck = np.zeros(objm.shape, dtype=bool)
    for t in range(T):
        for r in ghosts(regions(objm[t])):
            speck[t, r[:, 0], r[:, 1]] = True
    n = int(speck.reshape(T, -1).any(1).sum())
    if n == 0 or n >= DUPLICATE_FRAMES:
        return None
    speck = _dilate(speck, DILATE)
    busy = speck | _dilate(objm, 1)
    target = f.copy()
    for t in np.nonzero(speck.reshape(T, -1).any(1))[0]:
        ys, xs = np.nonzero(speck[t])
        fill = np.broadcast_to(np.median(f[t].reshape(-1, 3), axis=0), (len(ys), 3)).copy()
        todo = np.ones(len(ys), dtype=bool)
        for dt in range(1, T):
            for u in (t - dt, t + dt):
                if 0 <= u < T and todo.any():
                    free = todo & ~busy[u, ys, xs]
                    fill[free] = f[u, ys[free], xs[free]]
                    todo &= ~free
        target[t, ys, xs] = fill
    return target, speck


def _to_tensor(frames: np.ndarray) -> torch.Tensor:
    """``[T, H, W, 3]`` float in [0, 1] -> ``[3, T, H, W]`` in [-1, 1]."""
    return torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2).float() * 2 - 1


@torch.no_grad()
def build_examples(vae, latents: torch.Tensor, *, prompts: list[str] | None = None, batch: int = 48,
                   device: str = "cpu") -> dict[str, Any]:
    """Decode ``latents`` (normalised, as the samplers leave them) with ``vae``; split them into speck
    clips (with :func:`speck_target`'s target and mask) and the rest (target = this decode). With
    ``prompts`` (one per latent), a clip of the rest whose shape the detector reads other than its
    prompt's is left out (counted in ``misread``): keeping its decode would teach the decoder its miss."""
    from omniloop_wan_demo.evaluate import detect
    from omniloop_wan_demo.prompts import parse_prompt

    from .distill import _stats
    from .render import to_uint8_frames

    if prompts is not None and len(prompts) != len(latents):
        raise ValueError(f"build_examples: {len(prompts)} prompts for {len(latents)} latents")
    mean, std = _stats(vae, device)
    sp_z, sp_x, sp_m, ok_z, ok_x = [], [], [], [], []
    misread = 0
    for i in range(0, len(latents), batch):
        z = latents[i : i + batch]
        xr = vae.decode(z.to(device) * std + mean).sample.float().clamp(-1, 1).cpu()
        for j in range(len(z)):
            u8 = to_uint8_frames((xr[j] + 1) / 2)
            got = speck_target(u8)
            if got is not None:
                sp_z.append(z[j])
                sp_x.append(_to_tensor(got[0]))
                sp_m.append(torch.from_numpy(got[1])[None].float())
            elif prompts is not None and detect(u8).shape != parse_prompt(prompts[i + j])[1]:
                misread += 1
            else:
                ok_z.append(z[j])
                ok_x.append(xr[j])
    stack = lambda xs: torch.stack(xs) if xs else torch.empty(0)  # noqa: E731
    return {"speck_z": stack(sp_z), "speck_x": stack(sp_x), "speck_m": stack(sp_m), "ok_z": stack(ok_z), "ok_x": stack(ok_x),
            "misread": misread}


def parse_focus(text: str) -> tuple[str, str | None]:
    """``"red"`` or ``"red:star"`` -> ``("red", None)`` / ``("red", "star")``; unknown names raise ``ValueError``."""
    from .render import COLOR_NAMES, SHAPES

    color, _, shape = text.partition(":")
    if color not in COLOR_NAMES:
        raise ValueError(f"--focus {text!r}: colour must be one of {', '.join(COLOR_NAMES)}")
    if shape and shape not in SHAPES:
        raise ValueError(f"--focus {text!r}: shape must be one of {', '.join(SHAPES)}")
    return color, shape or None


def render_batch(batch: int, seed: int, *, focus: tuple[str, str | None] | None = None, focus_frac: float = 0.0,
                 device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` rendered clips (``[-1, 1]``) and their coverage: ``round(batch * focus_frac)`` of them
    of ``focus``'s colour (and shape, when given), the rest drawn over every label."""
    from .render import render, sample_params

    n_focus = round(batch * focus_frac) if focus else 0
    parts = []
    if n_focus:
        parts.append(render(sample_params(n_focus, seed * 7 + 3, color=focus[0], shape=focus[1]),
                            device=device, return_mask=True))
    if batch - n_focus:
        parts.append(render(sample_params(batch - n_focus, seed), device=device, return_mask=True))
    x = torch.cat([q[0] for q in parts])
    cov = torch.cat([q[1] for q in parts])
    return x * 2 - 1, cov


def finetune(vae, ex: dict[str, Any], *, seconds: float, batch: int, lr: float, speck_weight: float, trail_weight: float,
             seed: int = 0, max_steps: int | None = None, log_every: int = 10, device: str = "cpu",
             focus: tuple[str, str | None] | None = None, focus_frac: float = 0.0) -> dict[str, Any]:
    """Train ``vae``'s decoder on :func:`build_examples`' clips and rendered ones (``batch`` of each
    kind per step) for ``seconds`` or ``max_steps``; returns the log. The rendered clips' loss is
    ``vae_decoder``'s (object / outline / frame-0 / trail weights); the speck clips' is MSE weighted
    ``1 + speck_weight`` on the speck pixels; the others' plain MSE to the starting decode.
    ``focus`` (a colour and optionally a shape) draws ``focus_frac`` of the rendered clips with that
    label (the VAE loses ~1 in 3 red stars on rendered clips, every other colour's shapes 0-1 in 128)."""
    from .distill import _stats
    from .v2 import loss_weights
    from .vae_decoder import ENCODER_PREFIXES

    for name, p in vae.named_parameters():
        p.requires_grad_(not name.startswith(ENCODER_PREFIXES))
    params = [p for p in vae.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=1e-4)
    mean, std = _stats(vae, device)
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device).manual_seed(seed + 1)
    ex = {k: v.to(device) for k, v in ex.items() if isinstance(v, torch.Tensor)}
    n_sp, n_ok = len(ex["speck_z"]), len(ex["ok_z"])
    if n_sp == 0 and focus is None:
        raise SystemExit("decoder_specks: no speck clip among the latents (nothing to learn; --focus trains on rendered clips)")
    if n_ok == 0:
        raise SystemExit("decoder_specks: no clip to keep among the latents (every decode holds a speck or a misread shape)")
    log: list[dict[str, Any]] = []
    t0, step = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds and (max_steps is None or step < max_steps):
        vae.train()
        b_sp = batch if n_sp else 0
        i = torch.randint(0, max(n_sp, 1), (b_sp,), generator=g).to(device)
        j = torch.randint(0, n_ok, (batch,), generator=g).to(device)
        z = torch.cat([ex["speck_z"][i], ex["ok_z"][j]]) if b_sp else ex["ok_z"][j]
        out = vae.decode(z * std + mean).sample.float()
        if b_sp:
            w_sp = 1 + speck_weight * ex["speck_m"][i]
            l_sp = (((out[:b_sp] - ex["speck_x"][i]) ** 2) * w_sp).mean() / w_sp.mean()
        else:
            l_sp = out.new_zeros(())
        l_ok = ((out[b_sp:] - ex["ok_x"][j]) ** 2).mean()
        x, cov = render_batch(batch, (seed + 31) * 1_000_003 + step, focus=focus, focus_frac=focus_frac, device=device)
        with torch.no_grad():
            zr = vae.encode(x).latent_dist.sample(generator=gd)
        w = loss_weights(cov, object_weight=20.0, edge_weight=30.0, frame0_weight=3.0, trail_weight=trail_weight)
        l_gt = (((vae.decode(zr).sample.float() - x) ** 2) * w).mean() / w.mean()
        loss = l_sp + l_ok + l_gt
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % log_every == 0 or step == 1:
            rec = {"step": step, "t": round(time.perf_counter() - t0, 1), "speck": round(float(l_sp.detach()), 6),
                   "keep": round(float(l_ok.detach()), 6), "render": round(float(l_gt.detach()), 6)}
            log.append(rec)
            print("decoder-specks", json.dumps(rec), flush=True)
        if not math.isfinite(float(loss.detach())):
            raise SystemExit(f"decoder_specks: loss is not finite at step {step}")
    vae.eval()
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "log": log}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latents", type=Path, help="student latents (scripts/speck_probe.py latents)")
    ap.add_argument("--out", type=Path, help="folder for vae/ (fp16, diffusers layout) and decoder_specks.json")
    ap.add_argument("--ship", type=Path, metavar="DIR",
                    help="install DIR (a trained vae/ folder or its --out) as wan-demo's decoder instead of training "
                         "(ship.ship_decoder: the encoder must be the shipped one; wan-demo-causal keeps the old decoder)")
    ap.add_argument("--vae-from", type=Path, help="a vae/ folder to start from (default: the shipped wan-demo decoder)")
    ap.add_argument("--seconds", type=float, default=1200.0)
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--batch", type=int, default=4, help="clips of each kind per step (speck, other student, rendered)")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--speck-weight", type=float, default=30.0)
    ap.add_argument("--trail-weight", type=float, default=60.0, help="the rendered clips' trail weight (the shipped decoder's)")
    ap.add_argument("--focus", metavar="COLOUR[:SHAPE]",
                    help="draw --focus-frac of the rendered clips with this label (e.g. red or red:star)")
    ap.add_argument("--focus-frac", type=float, default=0.5)
    ap.add_argument("--recon-check", type=int, default=128, help="held-out rendered clips checked before and after (0: none)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--examples", type=Path,
                    help="a file for the decoded examples: loaded when it exists (from the same latents and starting "
                         "decoder), else written after they are built (decoding thousands of clips is the slow part on CPU)")
    a = ap.parse_args(argv)
    if a.ship is not None:
        from .ship import ship_decoder

        try:
            print(json.dumps(ship_decoder(a.ship)))
        except (ValueError, OSError) as e:
            ap.error(str(e))
        return 0
    if a.latents is None or a.out is None:
        ap.error("--latents and --out are required (or --ship DIR)")
    for k in ("seconds", "lr", "speck_weight", "trail_weight"):
        v = getattr(a, k)
        if not math.isfinite(v) or v < 0 or (k in ("seconds", "lr") and v == 0):
            ap.error(f"--{k.replace('_', '-')} must be a finite number > 0 (>= 0 for weights), got {v}")
    if a.batch < 1:
        ap.error(f"--batch must be >= 1, got {a.batch}")
    if not (math.isfinite(a.focus_frac) and 0 <= a.focus_frac <= 1):
        ap.error(f"--focus-frac must be a number in [0, 1], got {a.focus_frac}")
    try:
        focus = parse_focus(a.focus) if a.focus else None
    except ValueError as e:
        ap.error(str(e))
    if not a.latents.is_file():
        ap.error(f"--latents {a.latents}: no such file")
    from diffusers import AutoencoderKLWan

    from omniloop_wan_demo.checkpoint_path import checkpoint_dir

    from .v2 import recon_report

    src = a.vae_from or checkpoint_dir() / "vae"
    vae = AutoencoderKLWan.from_pretrained(str(src), torch_dtype=torch.float32).to(a.device).eval()
    saved = torch.load(a.latents)
    lat = saved["latents"]
    if a.examples and a.examples.is_file():
        ex = torch.load(a.examples)
    else:
        ex = build_examples(vae, lat, prompts=saved.get("prompts"), device=a.device)
        if a.examples:
            torch.save(ex, a.examples)
    info: dict[str, Any] = {"from": str(src), "latents": str(a.latents), "speck_clips": len(ex["speck_z"]),
                            "other_clips": len(ex["ok_z"]),
                            "misread_clips_left_out": ex.get("misread", 0), "args": {k: str(v) for k, v in vars(a).items()}}
    print("decoder-specks examples", json.dumps({k: info[k] for k in ("speck_clips", "other_clips", "misread_clips_left_out")}),
          flush=True)
    if a.recon_check:
        info["recon_before"] = recon_report(vae, n=a.recon_check, device=a.device)
        print("decoder-specks recon before", json.dumps(info["recon_before"]), flush=True)
    info.update(finetune(vae, ex, seconds=a.seconds, batch=a.batch, lr=a.lr, speck_weight=a.speck_weight,
                         trail_weight=a.trail_weight, max_steps=a.max_steps, device=a.device,
                         focus=focus, focus_frac=a.focus_frac))
    vae = vae.half().float().eval()
    if a.recon_check:
        info["recon_after"] = recon_report(vae, n=a.recon_check, device=a.device)
        print("decoder-specks recon after", json.dumps(info["recon_after"]), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    vae.cpu().half().save_pretrained(str(a.out / "vae"))
    (a.out / "decoder_specks.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
