"""Flow-GRPO or DiffusionNFT with a LoRA on ``flux-demo``: rollouts through the runtime, the update in torch.

Each iteration:

1. **Rollouts through the serving runtime.** ``prompts`` training prompts, ``group`` samples each
   (one request with ``diffusion.num_outputs = group``; the step scheduler batches the group), as
   SDE rollouts (``rollout: {kind: sde, sde_steps: a window}``) with the current LoRA (``adapters:
   [{name: policy}]``). Each output carries its trajectory (latents before every step, per-step
   log-probs, sigmas, timesteps; only latents for ``--method nft``) and the weight version it ran on.
2. **Reward**, verifiable, from the demo's detector (``omniloop_wan_demo.evaluate.detect_image``):
   ``placement`` (default) — 0 unless the detected colour and shape are the requested ones, else
   ``max(0, 1 - d / --placement-radius)``, ``d`` the object's centroid distance in px from the
   requested position's grid point; ``saturation`` — the HSV saturation of the detected object's
   mean colour; ``saturation_shape`` — the same but 0 unless the shape is right; ``shape`` — 1 when
   the detected shape is the requested one. (examples/rl/README.md says what each did.)
3. **Advantages** per prompt group: ``(r - mean) / (std + 1e-4)``, clipped to ±``adv_clip``.
4. **Policy update in torch** on the trainer's own copy of the transformer with LoRA layers.
   ``--method grpo`` (Flow-GRPO's clipped objective): the velocity at every recorded stochastic
   transition, with gradients, and its log-prob with :func:`omniloop_rl.trainer.step_log_prob`; ``ratio =
   exp(logp - logp_rollout)``, loss ``mean(max(-A·ratio, -A·clip(ratio, 1 ± clip)))``; before the
   first gradient step the recomputed log-probs equal the rollout's (consistency C1; the largest
   difference is logged). ``--method nft`` (DiffusionNFT): the rollouts' clean latents noised
   afresh at ``--nft-times`` schedule sigmas, :func:`omniloop_rl.trainer.nft_loss` against the rollout
   policy's velocity there, optimality :func:`omniloop_rl.trainer.nft_optimality` of the advantages. AdamW.
5. **Weights pushed** to the runtime: the LoRA saved as a diffusers/PEFT file and registered with
   ``Runtime.update_weights(file, version=..., adapter="policy")``.

At the start and end (and every ``eval_every`` iterations) the same reward is measured on held-out
prompts (never trained on) with fixed seeds. Writes ``log.json`` (after every iteration) and
``reward.png`` (training reward per iteration, held-out reward) into ``--out``.

Run: ``python examples/rl/flow_grpo.py --out out/rl --method nft --seed 0`` (CPU: ~26 min for 15
iterations on a shared 2-core machine, one thread; ``--device cuda`` on a GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

COLORS = ("red", "green", "blue", "yellow", "cyan", "magenta")
SHAPES = ("circle", "square", "triangle", "star")
POSITIONS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
#: the transformer linears the LoRA adapts (attention projections of every block)
TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
           "attn.add_v_proj", "attn.to_add_out")


def all_prompts() -> list[tuple[str, str, str]]:
    return [(c, s, p) for c in COLORS for s in SHAPES for p in POSITIONS]


def prompt_text(c: str, s: str, p: str) -> str:
    return f"a {c} {s} at the {p}"


# ---------------------------------------------------------------------------------------------
# reward
# ---------------------------------------------------------------------------------------------


def reward_of(pixels: np.ndarray, want: tuple[str, str, str], kind: str, radius: float = 4.0) -> tuple[float, dict[str, Any]]:
    from omniloop_wan_demo.evaluate import detect_image
    from omniloop_wan_demo.prompts import POSITIONS

    d = detect_image(pixels)
    info: dict[str, Any] = {"color": d.color == want[0], "shape": d.shape == want[1], "position": d.position == want[2],
                            "offset_px": None}
    if d.centroid is not None:
        gx, gy = POSITIONS[want[2]]
        size = pixels.shape[1]
        info["offset_px"] = float(math.hypot(d.centroid[0] - gx, d.centroid[1] - gy) * size)
    if kind == "shape":
        return float(info["shape"]), info
    if kind == "placement":
        # the requested object (colour and shape right) centred on its grid point: 1 at 0 px, 0 from `radius` px
        if info["offset_px"] is None or not (info["color"] and info["shape"]):
            return 0.0, info
        return max(0.0, 1.0 - info["offset_px"] / radius), info
    if d.mean_rgb is None or (kind == "saturation_shape" and not info["shape"]):
        return 0.0, info
    rgb = np.asarray(d.mean_rgb, dtype=np.float64)
    hi, lo = float(rgb.max()), float(rgb.min())
    return (hi - lo) / hi if hi > 0 else 0.0, info


# ---------------------------------------------------------------------------------------------
# the trainer's LoRA (the same op as the runtime's unfused adapter hook: out + B(A(x)) * alpha/r)
# ---------------------------------------------------------------------------------------------


class Lora:
    def __init__(self, transformer: torch.nn.Module, rank: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rank = rank
        self.layers: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
        for name, mod in transformer.named_modules():
            if isinstance(mod, torch.nn.Linear) and name.endswith(TARGETS):
                a = torch.nn.Parameter(torch.randn(rank, mod.in_features, generator=g) / math.sqrt(mod.in_features))
                b = torch.nn.Parameter(torch.zeros(mod.out_features, rank))  # B = 0: starts as the base model
                self.layers[name] = (a, b)
                mod.register_forward_hook(self._hook(a, b))

    @staticmethod
    def _hook(a: torch.nn.Parameter, b: torch.nn.Parameter) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            return out + torch.nn.functional.linear(torch.nn.functional.linear(args[0], a), b) * 1.0

        return hook

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for ab in self.layers.values() for p in ab]

    def save(self, path: Path) -> Path:
        """diffusers/PEFT layout (``transformer.<module>.lora_A/B.weight``; alpha = rank: scale 1)."""
        from safetensors.torch import save_file

        sd = {}
        for name, (a, b) in self.layers.items():
            sd[f"transformer.{name}.lora_A.weight"] = a.detach().cpu().contiguous()
            sd[f"transformer.{name}.lora_B.weight"] = b.detach().cpu().contiguous()
        save_file(sd, str(path))
        return path


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--method", choices=("grpo", "nft"), default="grpo",
                    help="grpo: Flow-GRPO (log-probs of the SDE steps); nft: DiffusionNFT (clean samples only)")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=8, help="training prompts per iteration")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (diffusion.num_outputs)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sde-window", type=int, default=3, help="stochastic steps per rollout (a random window)")
    ap.add_argument("--noise-level", type=float, default=0.7)
    ap.add_argument("--reward", choices=("placement", "saturation", "saturation_shape", "shape"), default="placement")
    ap.add_argument("--placement-radius", type=float, default=4.0, help="px at which the placement reward reaches 0")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=0.01, help="ratio clip range (grpo)")
    ap.add_argument("--adv-clip", type=float, default=5.0)
    ap.add_argument("--nft-beta", type=float, default=1.0, help="DiffusionNFT's beta (nft)")
    ap.add_argument("--nft-times", type=int, default=4, help="noise levels drawn per sample and iteration (nft)")
    ap.add_argument("--inner", type=int, default=2, help="gradient steps per iteration")
    ap.add_argument("--heldout", type=int, default=12, help="held-out prompts (never trained on)")
    ap.add_argument("--train-pool", type=int, default=24, help="training prompts (each iteration draws --prompts of them)")
    ap.add_argument("--eval-seeds", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="stop after the iteration that passes this many seconds of training (0: run --iterations); "
                         "the final held-out evaluation runs either way")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="runtime and trainer device (cpu, cuda)")
    ap.add_argument("--model", default="flux-demo")
    args = ap.parse_args(argv)
    for name in ("iterations", "prompts", "group", "steps", "sde_window", "rank", "inner", "eval_seeds", "eval_every",
                 "threads", "train_pool", "nft_times"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.group < 2:
        ap.error("--group must be >= 2 (advantages are relative to the group)")
    if args.sde_window > args.steps:
        ap.error("--sde-window must be <= --steps")
    if not 0 < args.noise_level <= 1:
        ap.error("--noise-level must be in (0, 1]")
    if not (math.isfinite(args.budget_s) and args.budget_s >= 0):
        ap.error("--budget-s must be a finite number >= 0")
    for name in ("lr", "clip", "adv_clip", "nft_beta", "placement_radius"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            ap.error(f"--{name.replace('_', '-')} must be a finite number > 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import copy

    from omniloop import Runtime
    from omniloop_flux.denoise import image_ids, pack_latents
    from omniloop_flux.stages import encode_prompt
    from omniloop_rl.trainer import nft_loss, nft_noisy, nft_optimality, step_log_prob

    dev = torch.device(args.device)
    if dev.type == "cuda":  # the trainer recomputes the runtime's float32 forward: no TF32 on either side
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    prompts = all_prompts()
    order = np.random.default_rng(1234).permutation(len(prompts))  # the split is the same for every seed
    heldout = [prompts[i] for i in order[: args.heldout]]
    train = [prompts[i] for i in order[args.heldout:args.heldout + args.train_pool]]
    if len(train) < args.prompts:
        raise SystemExit(f"--train-pool {args.train_pool} leaves {len(train)} prompts, fewer than --prompts {args.prompts}")

    rt = Runtime.from_model(args.model, device=args.device, scheduler="step")
    comps = rt.model.components
    policy_tf = copy.deepcopy(comps["transformer"]).float().to(dev)
    for p in policy_tf.parameters():
        p.requires_grad_(False)
    lora = Lora(policy_tf, args.rank, args.seed)
    for a, b in lora.layers.values():
        a.data, b.data = a.data.to(dev), b.data.to(dev)
    opt = torch.optim.AdamW(lora.parameters(), lr=args.lr, weight_decay=0.0)
    max_len = int(rt.defaults("t2i").get("max_sequence_length", 16) or 16)
    tmp = Path(tempfile.mkdtemp(prefix="flow-grpo-"))

    def push(version: str) -> float:
        t0 = time.perf_counter()
        rt.update_weights(lora.save(tmp / f"{version}.safetensors"), version=version, adapter="policy")
        return time.perf_counter() - t0

    embeds: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def embed(text: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if text not in embeds:
            with torch.no_grad():
                embeds[text] = tuple(t.float() for t in encode_prompt(comps, text, max_len, dev))  # type: ignore[assignment]
        return embeds[text]

    def rollouts(items: list[tuple[str, str, str]], seeds: list[int], sde_steps: list[int]) -> list[dict[str, Any]]:
        rows = []
        capture = ["latents", "log_probs", "timesteps"] if args.method == "grpo" else ["latents"]
        for want, seed in zip(items, seeds, strict=True):
            out = rt.generate({
                "task": "t2i", "prompt": prompt_text(*want),
                "diffusion": {"steps": args.steps, "seed": seed, "num_outputs": args.group},
                "rollout": {"kind": "sde", "noise_level": args.noise_level, "sde_steps": sde_steps, "capture": capture},
                "adapters": [{"name": "policy"}],
            })
            if not out.ok:
                raise RuntimeError(f"rollout failed: {out.error}")
            for s in out.samples:
                r, info = reward_of(s.artifacts["image"].pixels.cpu().numpy(), want, args.reward, args.placement_radius)
                rows.append({"want": want, "reward": r, "info": info, "traj": s.artifacts["trajectory"],
                             "version": s.metrics["weight_version"]})
        return rows

    def evaluate(tag: str) -> dict[str, Any]:
        """The held-out prompts, ``eval_seeds`` samples each (one group request per prompt, the same
        seeds at every evaluation: start and end compare the same initial noises)."""
        rewards, offsets, ok = [], [], {"color": 0, "shape": 0, "position": 0}
        for k, want in enumerate(heldout):
            out = rt.generate({"task": "t2i", "prompt": prompt_text(*want),
                               "diffusion": {"steps": args.steps, "seed": 10_000 + 97 * k, "num_outputs": args.eval_seeds},
                               "rollout": {"kind": "sde", "noise_level": args.noise_level, "capture": []},
                               "adapters": [{"name": "policy"}]})
            if not out.ok:
                raise RuntimeError(f"evaluation failed: {out.error}")
            for s in out.samples or [out]:  # (one output is no group: no samples list)
                r, info = reward_of(s.artifacts["image"].pixels.cpu().numpy(), want, args.reward, args.placement_radius)
                rewards.append(r)
                if info["offset_px"] is not None:
                    offsets.append(info["offset_px"])
                for key in ok:
                    ok[key] += bool(info[key])
        n = len(rewards)
        return {"at": tag, "reward": float(np.mean(rewards)), "reward_se": float(np.std(rewards) / math.sqrt(n)),
                "rewards": [round(float(r), 4) for r in rewards], "n": n,
                "offset_px_mean": float(np.mean(offsets)) if offsets else None,
                **{f"{k}_acc": v / n for k, v in ok.items()}}

    def velocity(x: torch.Tensor, t5: torch.Tensor, pooled: torch.Tensor, txt_ids: torch.Tensor,
                 img_ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return policy_tf(hidden_states=x, encoder_hidden_states=t5, pooled_projections=pooled, timestep=t,
                         img_ids=img_ids, txt_ids=txt_ids, guidance=None, return_dict=False)[0]

    log: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "command": " ".join([sys.executable, *sys.argv]) if argv is None else f"main({argv})",
                           "torch": torch.__version__, "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                           "heldout_prompts": [prompt_text(*w) for w in heldout], "iterations": [], "heldout": []}

    def write_log() -> None:
        (args.out / "log.json").write_text(json.dumps(log, indent=1))

    push_s = push("iter-0")
    log["heldout"].append({"iteration": 0, **evaluate("start")})
    write_log()
    t_start = time.perf_counter()
    for it in range(args.iterations):
        t0 = time.perf_counter()
        start = int(rng.integers(0, args.steps - args.sde_window + 1))
        window = list(range(start, start + args.sde_window))
        picks = [train[int(i)] for i in rng.choice(len(train), args.prompts, replace=False)]
        seeds = [int(s) for s in rng.integers(0, 2**31 - 1, args.prompts)]
        rows = rollouts(picks, seeds, window)
        t_roll = time.perf_counter() - t0
        rewards = np.array([r["reward"] for r in rows]).reshape(args.prompts, args.group)
        adv = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-4)
        adv = np.clip(adv, -args.adv_clip, args.adv_clip).reshape(-1)

        trajs = [r["traj"] for r in rows]
        texts = [prompt_text(*r["want"]) for r in rows]
        t5 = torch.cat([embed(t)[0] for t in texts])
        pooled = torch.cat([embed(t)[1] for t in texts])
        txt_ids = embed(texts[0])[2]
        lat0 = trajs[0].latents
        img_ids = image_ids(lat0.shape[-2] // 2, lat0.shape[-1] // 2, dev, torch.float32)
        sig = trajs[0].sigmas
        A = torch.tensor(adv, dtype=torch.float32, device=dev)
        c1_gap = 0.0
        stats: dict[str, Any] = {"loss": [], "ratio_min": 1.0, "ratio_max": 1.0, "clipped": 0, "n": 0}
        t1 = time.perf_counter()
        if args.method == "nft":
            # DiffusionNFT: noise the clean samples afresh at --nft-times levels from the schedule, the
            # rollout policy's velocity there (no gradient, before any step) as v_old
            x0 = pack_latents(torch.stack([t.latents[-1] for t in trajs]).to(dev))
            r_opt = nft_optimality(A, args.adv_clip)
            g = torch.Generator(device="cpu").manual_seed(int(rng.integers(0, 2**31 - 1)))
            levels = []
            for _ in range(args.nft_times):
                idx = torch.randint(0, args.steps, (len(rows),), generator=g)
                sigma = sig[idx].float().to(dev)
                noisy = nft_noisy(x0, torch.randn(x0.shape, generator=g).to(dev), sigma)
                with torch.no_grad():
                    v_old = velocity(noisy, t5, pooled, txt_ids, img_ids, sigma)
                levels.append((sigma, noisy, v_old))
        for inner in range(args.inner):
            opt.zero_grad()
            total = 0.0
            if args.method == "nft":
                for sigma, noisy, v_old in levels:
                    v = velocity(noisy, t5, pooled, txt_ids, img_ids, sigma)
                    loss = nft_loss(v, v_old, noisy, x0, sigma, r_opt, beta=args.nft_beta).mean() / len(levels)
                    loss.backward()
                    total += float(loss.detach())
                opt.step()
                stats["loss"].append(total)
                continue
            for i in window:
                x = pack_latents(torch.stack([t.latents[i] for t in trajs]).to(dev))
                xn = pack_latents(torch.stack([t.latents[i + 1] for t in trajs]).to(dev))
                old = torch.stack([t.log_probs[i] for t in trajs]).to(dev)
                ts = torch.stack([t.timesteps[i] for t in trajs]).to(dev)
                v = velocity(x, t5, pooled, txt_ids, img_ids, ts / 1000)
                lp = step_log_prob(v, x, xn, sig[i], sig[i + 1], kind="sde", noise_level=args.noise_level,
                                   sigma_max=sig[1])
                if inner == 0:
                    c1_gap = max(c1_gap, float((lp.detach() - old).abs().max()))
                ratio = torch.exp(lp - old)
                unclipped = -A * ratio
                clipped = -A * torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
                loss = torch.maximum(unclipped, clipped).mean() / len(window)
                loss.backward()
                total += float(loss.detach())
                stats["ratio_min"] = min(stats["ratio_min"], float(ratio.detach().min()))
                stats["ratio_max"] = max(stats["ratio_max"], float(ratio.detach().max()))
                stats["clipped"] += int(((ratio.detach() - 1).abs() > args.clip).sum())
                stats["n"] += ratio.numel()
            opt.step()
            stats["loss"].append(total)
        t_train = time.perf_counter() - t1
        push_s = push(f"iter-{it + 1}")
        versions = sorted({r["version"] for r in rows})
        offsets = [r["info"]["offset_px"] for r in rows if r["info"]["offset_px"] is not None]
        entry = {
            "iteration": it + 1, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "shape_acc": float(np.mean([r["info"]["shape"] for r in rows])),
            "color_acc": float(np.mean([r["info"]["color"] for r in rows])),
            "position_acc": float(np.mean([r["info"]["position"] for r in rows])),
            "offset_px_mean": float(np.mean(offsets)) if offsets else None,
            "sde_steps": window, "rollout_weight_versions": versions, "loss": stats["loss"],
            "seconds": {"rollouts": round(t_roll, 2), "update": round(t_train, 2), "push": round(push_s, 3)},
        }
        if args.method == "grpo":
            entry.update({"c1_max_abs_logprob_gap": c1_gap, "ratio_range": [stats["ratio_min"], stats["ratio_max"]],
                          "clip_fraction": stats["clipped"] / max(stats["n"], 1)})
        log["iterations"].append(entry)
        print(f"iter {it + 1:3d}  reward {entry['reward_mean']:.4f}  shape {entry['shape_acc']:.2f}  "
              f"offset {entry['offset_px_mean'] or float('nan'):.2f}px  C1 gap {c1_gap:.1e}  "
              f"({t_roll:.1f}s rollouts, {t_train:.1f}s update)", flush=True)
        out_of_time = bool(args.budget_s) and time.perf_counter() - t_start > args.budget_s
        if (it + 1) % args.eval_every == 0 or it + 1 == args.iterations or out_of_time:
            log["heldout"].append({"iteration": it + 1, **evaluate(f"iteration {it + 1}")})
            print(f"           held-out reward {log['heldout'][-1]['reward']:.4f}", flush=True)
        log["seconds"] = round(time.perf_counter() - t_start, 1)
        write_log()
        if out_of_time:
            log["stopped"] = f"--budget-s {args.budget_s:g} reached after iteration {it + 1}"
            break
    log["final_checksum"] = rt.weights_checksum()
    write_log()
    plot(log, args.out / "reward.png")
    return log


def plot(log: dict[str, Any], path: Path, curves: list[dict[str, Any]] | None = None,
         labels: list[str] | None = None, title: str | None = None) -> None:
    """A reward curve as a PNG (PIL only): training reward per iteration (dots, line) and the
    held-out reward (squares); several logs (seeds) in different colours when ``curves`` is given,
    named by ``labels``."""
    from PIL import Image, ImageDraw

    logs = curves or [log]
    w, h, m = 640, 400, 50
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    ys = [e["reward_mean"] for lg in logs for e in lg["iterations"]] + [e["reward"] for lg in logs for e in lg["heldout"]]
    lo, hi = min(ys), max(ys)
    pad = (hi - lo) * 0.1 + 1e-6
    lo, hi = lo - pad, hi + pad
    n = max(len(lg["iterations"]) for lg in logs)

    def xy(i: float, y: float) -> tuple[float, float]:
        return m + (w - 2 * m) * i / max(n, 1), h - m - (h - 2 * m) * (y - lo) / (hi - lo)

    d.rectangle([m, m, w - m, h - m], outline="black")
    for k in range(5):
        y = lo + (hi - lo) * k / 4
        d.text((4, xy(0, y)[1] - 6), f"{y:.3f}", fill="black")
    d.text((w // 2 - 40, h - m + 20), "iteration", fill="black")
    method = "DiffusionNFT" if log.get("args", {}).get("method") == "nft" else "Flow-GRPO"
    d.text((m, 10), title or f"{method} on flux-demo: train reward (line), held-out (squares)", fill="black")
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for c, lg in enumerate(logs):
        col = palette[c % len(palette)]
        if labels and c < len(labels):
            d.text((w - m - 150, m + 6 + 14 * c), labels[c], fill=col)
        pts = [xy(e["iteration"], e["reward_mean"]) for e in lg["iterations"]]
        if len(pts) > 1:
            d.line(pts, fill=col, width=2)
        for px, py in pts:
            d.ellipse([px - 2, py - 2, px + 2, py + 2], fill=col)
        for e in lg["heldout"]:
            px, py = xy(e["iteration"], e["reward"])
            d.rectangle([px - 4, py - 4, px + 4, py + 4], outline=col, width=2)
    img.save(path)


if __name__ == "__main__":
    main()
