"""wan-demo-fast: a 4-step student distilled from wan-demo v2, run by the Wan family's ``few-step``
sampler at guidance 1.0 (one forward per step; the teacher's CFG 5 is baked in).

The sampler (``omniloop_policies.samplers.FewStepSampler``) at step ``i`` with model timestep
``t_i`` and sigma ``s_i`` (looked up on the flow-Euler grid of ``grid_shift``) computes
``x0 = x - s_i * v`` and, unless it is the last step, re-noises ``x = (1 - s_{i+1}) x0 + s_{i+1} n``
with fresh noise. So the student must turn *any* such input into a clean sample. Training pairs
(trajectory distillation with deterministic teacher targets):

* step 0 (``s = 1``): input pure noise ``z``, target the teacher's ODE solution ``x0_T(z)``
  (flow Euler, ``--teacher-steps`` steps, CFG ``--teacher-guidance``);
* step ``i > 0``: input ``(1 - s_i) x0_T + s_i n`` (fresh ``n``: what the sampler feeds it when
  the previous step's ``x0`` is a teacher-quality sample), target the teacher's ODE solution from
  that input down to 0.

Loss: MSE between the student's ``x0 = x - s_i * v`` and the target. The student starts from the
teacher's weights; the text encoder, VAE and tokenizer are the teacher's (``checkpoint_fast/``
links them).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: the few-step sampler's default grid (FastWan's): only the timesteps differ from its defaults
GRID_SHIFT = 8.0
FAST_TIMESTEPS = (1000, 750, 500, 250)


def fast_sigmas(timesteps: Sequence[int] = FAST_TIMESTEPS, grid_shift: float = GRID_SHIFT) -> list[float]:
    """The sigmas the few-step sampler uses for ``timesteps`` (nearest point of the flow-Euler
    training grid with ``grid_shift``; ``FewStepSampler.schedule`` without the terminal 0)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=grid_shift)
    grid_t, grid_s = sched.timesteps.float(), sched.sigmas.float()
    q = torch.tensor([float(t) for t in timesteps])
    idx = torch.argmin((grid_t[None] - q[:, None]).abs(), dim=1)
    return [float(s) for s in grid_s[idx].tolist()]


def _embed(text_encoder, tok, prompts: list[str], device: str) -> torch.Tensor:
    from .common import encode_tokens, tokenize

    ids, mask = tokenize(tok, prompts)
    with torch.no_grad():
        return encode_tokens(text_encoder, ids.to(device), mask.to(device), 512).float()


def _stats(vae, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    return mean, std


@torch.no_grad()
def teacher_ode(transformer, x: torch.Tensor, sigma0: float, emb_c: torch.Tensor, emb_u: torch.Tensor, *,
                steps: int, guidance: float, shift: float = 3.0) -> torch.Tensor:
    """Flow-Euler ODE with CFG from ``sigma0`` to 0 on the shifted grid (``shift``), ``x`` at
    ``sigma0``; returns the clean latents. bf16 autocast on CUDA."""
    u0 = sigma0 / (shift - (shift - 1) * sigma0)  # unshift
    us = torch.linspace(u0, 0.0, steps + 1, dtype=torch.float64)
    sig = (shift * us / (1 + (shift - 1) * us)).tolist()
    amp = x.is_cuda
    b = x.shape[0]
    emb = torch.cat([emb_c, emb_u])
    for s, s_next in itertools.pairwise(sig):
        t = torch.full((2 * b,), s * 1000.0, device=x.device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            v = transformer(hidden_states=torch.cat([x, x]), timestep=t, encoder_hidden_states=emb, return_dict=False)[0]
        v = v.float()
        vc, vu = v[:b], v[b:]
        x = x + (s_next - s) * (vu + guidance * (vc - vu))
    return x


def make_targets(teacher, emb_all: torch.Tensor, emb_u: torch.Tensor, *, n: int, sigmas: list[float], steps: int,
                 guidance: float, device: str, seed: int, budget_s: float, chunk: int = 1024) -> dict[str, torch.Tensor]:
    """``inputs`` / ``targets`` ``[N, K, 16, 5, 16, 16]`` (K = len(sigmas)) and prompt ids ``[N]``."""
    gen = torch.Generator(device).manual_seed(seed)
    ins, tgs, pids = [], [], []
    t0 = time.perf_counter()
    done = 0
    while done < n and (time.perf_counter() - t0 < budget_s or done == 0):
        b = min(chunk, n - done)
        p = torch.randint(0, emb_all.shape[0], (b,), device=device, generator=gen)
        ec, eu = emb_all[p], emb_u.expand(b, -1, -1)
        z = torch.randn((b, 16, 5, 16, 16), device=device, generator=gen)
        x0 = teacher_ode(teacher, z, 1.0, ec, eu, steps=steps, guidance=guidance)
        row_in, row_tg = [z], [x0]
        for s in sigmas[1:]:
            xi = (1 - s) * x0 + s * torch.randn(x0.shape, device=device, generator=gen)
            k = max(2, round(steps * s / (3.0 - 2.0 * s)))  # as many steps as the full grid has below s
            row_in.append(xi)
            row_tg.append(teacher_ode(teacher, xi, s, ec, eu, steps=k, guidance=guidance))
        ins.append(torch.stack(row_in, 1).to(torch.float16 if device.startswith("cuda") else torch.float32))
        tgs.append(torch.stack(row_tg, 1).to(ins[-1].dtype))
        pids.append(p)
        done += b
    return {"inputs": torch.cat(ins), "targets": torch.cat(tgs), "pids": torch.cat(pids),
            "seconds": torch.tensor(time.perf_counter() - t0)}


def distill_phase(a: argparse.Namespace, ckpt: Path, out_dir: Path, dev: str) -> tuple[Path, dict[str, Any]]:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from .common import DEMO_DEFAULTS, load_tokenizer
    from .render import all_prompts
    from .train_dit import EMA

    teacher = WanTransformer3DModel.from_pretrained(str(ckpt / "transformer"), torch_dtype=torch.float32).to(dev).eval()
    te = UMT5EncoderModel.from_pretrained(str(ckpt / "text_encoder"), torch_dtype=torch.float32).to(dev).eval()
    tok = load_tokenizer(ckpt / "tokenizer")
    prompts = all_prompts()
    emb_all = _embed(te, tok, prompts, dev)
    emb_u = _embed(te, tok, [""], dev)
    timesteps = tuple(a.fast_timesteps_list)
    sigmas = fast_sigmas(timesteps)
    info: dict[str, Any] = {"timesteps": list(timesteps), "grid_shift": GRID_SHIFT, "sigmas": sigmas,
                            "teacher_steps": a.teacher_steps, "teacher_guidance": a.teacher_guidance, "log": []}
    data = make_targets(teacher, emb_all, emb_u, n=a.distill_clips, sigmas=sigmas, steps=a.teacher_steps,
                        guidance=a.teacher_guidance, device=dev, seed=a.seed + 4242, budget_s=a.distill_gen_seconds,
                        chunk=a.distill_batch * 2)
    n = int(data["pids"].shape[0])
    info["pairs"] = {"trajectories": n, "per_trajectory": len(sigmas), "seconds": round(float(data["seconds"]), 1)}
    print("distill: teacher targets", json.dumps(info["pairs"]), flush=True)

    student = copy.deepcopy(teacher).train().requires_grad_(True)
    del teacher
    ema = EMA({"transformer": student}, 0.998)
    opt = torch.optim.AdamW(student.parameters(), lr=a.distill_lr, betas=(0.9, 0.99), weight_decay=0.0,
                            fused=dev.startswith("cuda"))
    sig = torch.tensor(sigmas, device=dev)
    tst = torch.tensor([float(t) for t in timesteps], device=dev)
    gen = torch.Generator(dev).manual_seed(a.seed + 77)
    batch = a.distill_batch
    max_steps = 2 if a.smoke else None
    amp = dev.startswith("cuda")
    t0 = time.perf_counter()
    step = 0
    run_loss = torch.zeros((), device=dev)
    per_k = torch.zeros(len(sigmas), device=dev)
    cnt_k = torch.zeros(len(sigmas), device=dev)
    while True:
        el = time.perf_counter() - t0
        if el >= a.distill_seconds or (max_steps is not None and step >= max_steps):
            break
        frac = el / a.distill_seconds if max_steps is None else step / max_steps
        lr = a.distill_lr * min(1.0, (step + 1) / 50) * (1.0 if frac < 0.7 else max(0.1, (1 - frac) / 0.3))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, n, (batch,), device=dev, generator=gen)
        k = torch.randint(0, len(sigmas), (batch,), device=dev, generator=gen)
        x = data["inputs"][idx, k].float()
        tgt = data["targets"][idx, k].float()
        s = sig[k].view(-1, 1, 1, 1, 1)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            v = student(hidden_states=x, timestep=tst[k], encoder_hidden_states=emb_all[data["pids"][idx]],
                        return_dict=False)[0]
        x0 = x - s * v.float()
        err = ((x0 - tgt) ** 2).mean(dim=(1, 2, 3, 4))
        loss = err.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        ema.update(step + 1000)  # full decay from the start: the EMA starts at the teacher
        run_loss += loss.detach()
        per_k.index_add_(0, k, err.detach())
        cnt_k.index_add_(0, k, torch.ones_like(err))
        step += 1
        if step % (1 if a.smoke else 100) == 0:
            rec = {"step": step, "t": round(time.perf_counter() - t0, 1), "lr": lr,
                   "loss": round(float(run_loss) / (1 if a.smoke else 100), 5),
                   "loss_by_step": [round(float(v), 5) for v in (per_k / cnt_k.clamp(min=1)).tolist()]}
            run_loss.zero_()
            per_k.zero_()
            cnt_k.zero_()
            info["log"].append(rec)
            print("distill", json.dumps(rec), flush=True)
    info["steps"], info["seconds"], info["batch"], info["lr"] = step, round(time.perf_counter() - t0, 1), batch, a.distill_lr
    del data
    out_dir.mkdir(parents=True, exist_ok=True)
    ema.shadow["transformer"].to("cpu").half().save_pretrained(str(out_dir / "transformer"), safe_serialization=True)
    meta = {
        "variant": "wan-demo-fast",
        # the Wan family reads a checkpoint's default sampler and its options from here
        "defaults": dict(DEMO_DEFAULTS, steps=len(timesteps), guidance_scale=1.0, sampler="few-step",
                         sampler_options={"few-step": {"timesteps": list(timesteps), "grid_shift": GRID_SHIFT}}),
        "training": {"from": "wan-demo v2", "method": "trajectory distillation (teacher CFG ODE targets at the "
                     "few-step sampler's inputs), guidance baked in", **{k: v for k, v in info.items() if k != "log"}},
    }
    (out_dir / "omniloop.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    del AutoencoderKLWan
    return out_dir, info


def load_student(fast_dir: Path, device: str):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(str(Path(fast_dir) / "transformer"), torch_dtype=torch.float32).to(device).eval()


class FewStepGenerator:
    """Clips from a student with the few-step sampler's math (``x0 = x - s_i v``, re-noise to
    ``s_{i+1}``), guidance 1 (conditional forward only), batched on one device; for the
    evaluator (``evaluate.evaluate``). Initial noise per clip from ``torch.Generator(seed)`` as
    WanPipeline draws it."""

    def __init__(self, transformer, text_encoder, tokenizer, vae, *, device: str, timesteps: Sequence[int] = FAST_TIMESTEPS,
                 batch_size: int = 192):
        self.tr, self.te, self.tok, self.vae = transformer, text_encoder, tokenizer, vae
        self.device, self.batch_size = device, batch_size
        self.timesteps = tuple(timesteps)
        self.sigmas = fast_sigmas(self.timesteps)

    @torch.no_grad()
    def latents(self, prompts: Sequence[str], seeds: Sequence[int], *, steps: int) -> torch.Tensor:
        """The sampled latents, normalised as the DiT sees them (``[N, 16, 5, 16, 16]`` on the device),
        batch by batch of ``batch_size`` (a batch's re-noising generator is seeded by its first seed + 1)."""
        if steps != len(self.timesteps):
            raise ValueError(f"the few-step schedule has {len(self.timesteps)} steps, {steps} asked")
        out: list[torch.Tensor] = []
        for i in range(0, len(prompts), self.batch_size):
            ps, ss = list(prompts[i : i + self.batch_size]), list(seeds[i : i + self.batch_size])
            emb = _embed(self.te, self.tok, ps, self.device)
            x = torch.cat([torch.randn((1, 16, 5, 16, 16), generator=torch.Generator().manual_seed(int(s))) for s in ss]).to(self.device)
            gen = torch.Generator(self.device).manual_seed(int(ss[0]) + 1)
            for j, (t, s) in enumerate(zip(self.timesteps, self.sigmas, strict=True)):
                tt = torch.full((len(ps),), float(t), device=self.device)
                v = self.tr(hidden_states=x, timestep=tt, encoder_hidden_states=emb, return_dict=False)[0].float()
                x0 = x - s * v
                if j + 1 < len(self.timesteps):
                    sn = self.sigmas[j + 1]
                    x = (1 - sn) * x0 + sn * torch.randn(x0.shape, device=self.device, generator=gen)
                else:
                    x = x0
            out.append(x)
        return torch.cat(out)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], seeds: Sequence[int], *, steps: int, guidance_scale: float) -> list[np.ndarray]:
        from .render import to_uint8_frames

        lat = self.latents(prompts, seeds, steps=steps)
        mean, std = _stats(self.vae, self.device)
        out: list[np.ndarray] = []
        for i in range(0, len(lat), self.batch_size):
            video = self.vae.decode((lat[i : i + self.batch_size] * std + mean).to(self.vae.dtype)).sample.float().clamp(-1, 1)
            out.extend(to_uint8_frames((v + 1) / 2) for v in video)
        return out
