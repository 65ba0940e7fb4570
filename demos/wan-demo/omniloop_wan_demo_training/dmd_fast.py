"""wan-demo-fast by DMD2 (:mod:`.dmd`): a 4-step student of wan-demo v2, time-boxed on one GPU.

    python -m omniloop_wan_demo_training.dmd_fast --out $OUT/lora --form lora --seconds 200
    python -m omniloop_wan_demo_training.dmd_fast --out $OUT/full --form full --seconds 200
    python -m omniloop_wan_demo_training.dmd_fast --out $OUT/v2 --eval-only v2          # wan-demo at its defaults
    python -m omniloop_wan_demo_training.dmd_fast --out $OUT/s --eval-only lora --lora-scales 0.9,1,1.1
    python -m omniloop_wan_demo_training.dmd_fast --out /tmp/dmd-smoke --smoke          # CPU check, ~1 min

Teacher: the shipped ``checkpoint/`` (v2) with CFG ``--teacher-guidance`` (the real score).
Student and critic start as v2. ``--form lora``: both are LoRA adapters (rank ``--rank``,
alpha = rank) of one frozen v2 (:func:`.dmd.lora_roles`; the teacher is v2 with adapters off) and
what ships is the student adapter, ``fast_lora.safetensors`` (diffusers keys
``transformer.blocks.N.<module>.lora_A/B.weight``, fp16), which ``--adapter fast`` loads on
wan-demo. ``--form full``: full copies; what ships is ``transformer/`` (fp16) plus a LoRA
extracted from ``student - v2`` by truncated SVD (rank ``--rank``; its relative error is
recorded).

The student's sample is the runtime's ``few-step`` sampler at ``--timesteps`` (grid shift 8,
guidance 1: one forward per step), through :class:`.dmd.FewStepRollout` (random exit step,
graph of that step only). ``--critic-steps`` critic updates per student update.

Evaluation (on the saved fp16 weights, the LoRA applied as ``W + B A``): the few-step sampler's
math batched on the GPU (``distill.FewStepGenerator``) on ``full_prompts() x --eval-seeds``, W1's
detector (colour, direction, shape, ghost-free = "clean") and duplicate objects (a ghost in >= 8
frames). ``--eval-only v2`` evaluates wan-demo v2 at its shipped defaults (stochastic flow Euler,
20 steps, guidance 2, shift 5; ``sampling.FlowEulerGenerator``) on the same clips. ``--eval-only lora``
trains nothing either: it evaluates v2 + ``scale * B A`` of a LoRA file (``--lora-from``, default
the shipped adapter) for each of ``--lora-scales`` — the adapter's strength as an inference setting
(a scale other than 1 ships as the file's ``B`` multiplied by it, so that ``--adapter fast`` and
``wan-demo-fast`` stay the same student).

``--snapshot-every N`` (``--form lora``) keeps the student adapter every N student updates and
the starting one, scores each on ``--pick-seeds`` (held out from ``--eval-seeds``; :func:`pick_score`:
shape + no ghost − 5 × duplicate share) and ships the best instead of the last — DMD2 on the shipped
adapter drifted away from it (session 6), so the pick can also return the start.

Writes ``result.json`` (args, training log, evaluation) and the weights (``fast_lora.safetensors``,
``transformer/`` for ``--form full``), and ``preview.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import dmd

#: the modules of each Wan block the LoRA covers (every Linear of the block but the norms' affine)
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
TINY_DIT = {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 64, "freq_dim": 32}


def _log(*args: Any) -> None:
    print(time.strftime("%H:%M:%S"), *args, flush=True)


def load_v2(dev: str, smoke: bool = False, vae_from: str | Path | None = None) -> dict[str, Any]:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from omniloop_wan_demo.checkpoint_path import checkpoint_dir

    from .common import load_tokenizer

    ck = checkpoint_dir()
    tr = WanTransformer3DModel.from_pretrained(str(ck / "transformer"), torch_dtype=torch.float32)
    if smoke:  # a tiny transformer of the same interface (CPU check of the plumbing only)
        cfg = dict(tr.config)
        cfg = {k: v for k, v in cfg.items() if not k.startswith("_")} | TINY_DIT
        torch.manual_seed(0)
        tr = WanTransformer3DModel(**cfg)
    return {
        "dir": ck,
        "transformer": tr.to(dev).eval(),
        "text_encoder": UMT5EncoderModel.from_pretrained(str(ck / "text_encoder"), torch_dtype=torch.float32).to(dev).eval(),
        "vae": AutoencoderKLWan.from_pretrained(str(vae_from or ck / "vae"), torch_dtype=torch.float32).to(dev).eval(),
        "tokenizer": load_tokenizer(ck / "tokenizer"),
    }


def batches(emb_all: torch.Tensor, emb_u: torch.Tensor, *, batch: int, dev: str, seed: int) -> Iterator[dmd.Batch]:
    """Endless batches: fresh noise ``[B, 16, 5, 16, 16]`` and random training prompts."""
    g = torch.Generator(dev).manual_seed(seed)
    while True:
        idx = torch.randint(0, emb_all.shape[0], (batch,), device=dev, generator=g)
        noise = torch.randn((batch, 16, 5, 16, 16), device=dev, generator=g)
        yield dmd.Batch(noise, dmd.Text(emb_all[idx], emb_u))


# --------------------------------------------------------------------------------------------------
# LoRA files: save, apply (merge), extract
# --------------------------------------------------------------------------------------------------


def adapter_state(base: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    """Adapter ``name``'s weights in diffusers' Wan LoRA layout (``transformer.<module>.lora_A.weight``)."""
    out = {}
    tag = f".{name}."
    for n, p in base.named_parameters():
        if "lora_" in n and tag in n:  # blocks.0.attn1.to_q.lora_A.student.weight
            out["transformer." + n.replace(tag, ".")] = p.detach().to("cpu", torch.float16).contiguous()
    return out


def save_lora(state: dict[str, torch.Tensor], path: Path, meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    save_file(state, str(path), metadata={"omniloop": json.dumps(meta, sort_keys=True)})


def lora_file_rank(path: Path) -> int:
    """The rank of a LoRA file in :func:`adapter_state`'s layout (its ``lora_A`` rows); ``ValueError``
    naming the file when it holds no ``lora_A`` weight or its ranks differ."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        ranks = {f.get_slice(k).get_shape()[0] for k in f.keys() if ".lora_A." in k}
    if len(ranks) != 1:
        raise ValueError(f"{path}: expected LoRA weights of one rank (transformer.<module>.lora_A.weight), got ranks {sorted(ranks)}")
    return ranks.pop()


def load_adapter_state(base: torch.nn.Module, name: str, state: dict[str, torch.Tensor]) -> int:
    """The inverse of :func:`adapter_state`: copy ``state`` into adapter ``name``'s LoRA weights of
    ``base`` (same rank); every file key must name one of them. Returns how many were loaded."""
    params = dict(base.named_parameters())
    tag = f".{name}."
    n = 0
    for k, v in state.items():
        head, _, tail = k.removeprefix("transformer.").rpartition(".")  # blocks.0.attn1.to_q.lora_A / weight
        target = params.get(f"{head}{tag}{tail}")
        if target is None or target.shape != v.shape:
            raise ValueError(f"LoRA file key {k}: no {name!r} adapter weight of shape {tuple(v.shape)} in the model")
        with torch.no_grad():
            target.copy_(v.to(target.dtype))
        n += 1
    return n


def merge_lora(transformer: torch.nn.Module, state: dict[str, torch.Tensor], scale: float = 1.0) -> torch.nn.Module:
    """``W += scale * B @ A`` for every pair (alpha = rank), in place; returns ``transformer``."""
    mods = dict(transformer.named_modules())
    with torch.no_grad():
        for k, a in state.items():
            if ".lora_A." not in k:
                continue
            mod = mods[k.removeprefix("transformer.").replace(".lora_A.weight", "")]
            b = state[k.replace(".lora_A.", ".lora_B.")]
            w = mod.weight
            w += scale * (b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)).to(w.dtype)
    return transformer


def extract_lora(student: torch.nn.Module, base: torch.nn.Module, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A rank-``rank`` LoRA of ``student - base`` on :data:`LORA_TARGETS` (truncated SVD,
    ``B = U S``, ``A = V^T``) and how much it misses: the relative Frobenius error of the Linear
    deltas, and the relative size of the deltas it cannot hold (every other parameter)."""
    s_params, b_params = dict(student.named_parameters()), dict(base.named_parameters())
    out: dict[str, torch.Tensor] = {}
    err2 = tot2 = other2 = other_tot2 = 0.0
    covered = set()
    for n, mod in student.named_modules():
        if not isinstance(mod, torch.nn.Linear) or not n.startswith("blocks.") or not n.endswith(LORA_TARGETS):
            continue
        d = (s_params[f"{n}.weight"].detach().float() - b_params[f"{n}.weight"].detach().float()).cpu()
        u, s, vh = torch.linalg.svd(d, full_matrices=False)
        r = min(rank, s.numel())
        bmat, amat = (u[:, :r] * s[:r]).contiguous(), vh[:r].contiguous()
        out[f"transformer.{n}.lora_A.weight"] = amat.half()
        out[f"transformer.{n}.lora_B.weight"] = bmat.half()
        err2 += float(((d - bmat.half().float() @ amat.half().float()) ** 2).sum())
        tot2 += float((d**2).sum())
        covered.add(f"{n}.weight")
    for n, p in s_params.items():
        if n not in covered:
            other2 += float(((p.detach().float() - b_params[n].detach().float()) ** 2).sum())
            other_tot2 += float((b_params[n].detach().float() ** 2).sum())
    info = {"rank": rank, "linear_delta_rel_error": math.sqrt(err2 / max(tot2, 1e-30)),
            "other_params_rel_change": math.sqrt(other2 / max(other_tot2, 1e-30))}
    return out, info


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


def eval_fast(transformer, v2: dict[str, Any], *, prompts: list[str], seeds: list[int], timesteps: tuple[int, ...],
              dev: str, preview: Path | None) -> dict[str, Any]:
    from omniloop_wan_demo.evaluate import evaluate

    from .distill import FewStepGenerator
    from .train_dit import clip_records, duplicates

    t0 = time.perf_counter()
    gen = FewStepGenerator(transformer, v2["text_encoder"], v2["tokenizer"], v2["vae"], device=dev, timesteps=timesteps)
    rep = evaluate(gen, prompts=prompts, seeds=seeds, steps=len(timesteps), guidance_scale=1.0,
                   backend="few-step (GPU, diffusers modules)")
    r = rep.to_dict(with_clips=False) | {"clips": clip_records(rep)}
    r.update(model="fast", sampler="few-step", timesteps=list(timesteps), wall_s=round(time.perf_counter() - t0, 2))
    r.update(duplicates(r["clips"]))
    if preview is not None:
        sub = prompts[:: max(1, len(prompts) // 8)][:8]
        _preview(gen(sub, [0] * len(sub), steps=len(timesteps), guidance_scale=1.0), preview)
    return r


def eval_v2(v2: dict[str, Any], *, prompts: list[str], seeds: list[int], steps: int, dev: str) -> dict[str, Any]:
    from omniloop_wan_demo.evaluate import evaluate

    from .common import V2_SAMPLING
    from .sampling import FlowEulerGenerator
    from .train_dit import clip_records, duplicates

    class Pipe:  # what FlowEulerGenerator reads
        transformer, text_encoder, vae = v2["transformer"], v2["text_encoder"], v2["vae"]

    t0 = time.perf_counter()
    g = float(V2_SAMPLING["guidance_scale"])
    gen = FlowEulerGenerator(Pipe, v2["tokenizer"], device=dev, shift=float(V2_SAMPLING["shift"]), stochastic=True)
    rep = evaluate(gen, prompts=prompts, seeds=seeds, steps=steps, guidance_scale=g, backend="euler-sde (GPU, diffusers modules)")
    r = rep.to_dict(with_clips=False) | {"clips": clip_records(rep)}
    r.update(model="v2", sampler="euler-sde", flow_shift=float(V2_SAMPLING["shift"]), wall_s=round(time.perf_counter() - t0, 2))
    r.update(duplicates(r["clips"]))
    return r


def pick_score(r: dict[str, Any]) -> float:
    """How a snapshot is judged (``--snapshot-every``): shape + no ghost (the two bars the fast student
    misses) minus 5x the duplicate share (a duplicate costs as much as five missed shapes)."""
    acc = r["accuracy"]
    return float(acc["shape"] + acc["clean"] - 5.0 * r["duplicate_clips"] / max(r["n"], 1))


def pick_snapshot(snapshots: list[tuple[int, dict[str, torch.Tensor]]], base: torch.nn.Module, v2: dict[str, Any],
                  a: argparse.Namespace, prompts: list[str], res: dict[str, Any]) -> tuple[int, dict[str, torch.Tensor]]:
    """Evaluate every snapshot (v2 + its LoRA, fp16 as shipped) on ``a.pick_seed_list`` and return the
    best by :func:`pick_score`; ``res["snapshots"]`` records each."""
    rows = []
    for step, state in snapshots:
        tr = merge_lora(copy.deepcopy(base).float(), state).eval()
        r = eval_fast(tr, v2, prompts=prompts, seeds=a.pick_seed_list, timesteps=a.timestep_list, dev=a.device, preview=None)
        rows.append({"student_step": step, "n": r["n"], "accuracy": r["accuracy"], "duplicate_clips": r["duplicate_clips"],
                     "score": round(pick_score(r), 5)})
        _log("snapshot", step, json.dumps(rows[-1]))
        del tr
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
    best = max(range(len(rows)), key=lambda i: rows[i]["score"])
    res["snapshots"] = {"seeds": a.pick_seed_list, "rows": rows, "picked_student_step": rows[best]["student_step"],
                        "score": "shape + clean - 5 x duplicate share (pick_score)"}
    return snapshots[best]


def eval_scales(v2: dict[str, Any], a: argparse.Namespace, prompts: list[str], res: dict[str, Any], dump: Any) -> None:
    """``--eval-only lora``: v2 + ``scale * B A`` of ``a.lora_from`` on the GPU protocol, per scale
    (``res["evals"]``, written after each)."""
    from safetensors.torch import load_file

    state = load_file(a.lora_from)
    base = v2["transformer"]
    if a.smoke:  # the tiny transformer: only the pairs that fit it (a plumbing check)
        weights = {n: m.weight.shape for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
        fits = {k for k in state if ".lora_A." in k
                and (w := weights.get(k.removeprefix("transformer.").replace(".lora_A.weight", ""))) is not None
                and state[k].shape[1] == w[1] and state[k.replace(".lora_A.", ".lora_B.")].shape[0] == w[0]}
        state = {k: v for k, v in state.items() if k in fits or k.replace(".lora_B.", ".lora_A.") in fits}
    res["evals"] = []
    for scale in a.scale_list:
        tr = merge_lora(copy.deepcopy(base).float(), state, scale=scale).eval()
        r = eval_fast(tr, v2, prompts=prompts, seeds=a.seed_list, timesteps=a.timestep_list, dev=a.device, preview=None)
        r["lora_scale"] = scale
        res["evals"].append(r)
        _log("eval lora scale", scale, r["n"], json.dumps(r["accuracy"]), "duplicates", r["duplicate_clips"],
             "ghost clips", r.get("clips_with_a_ghost"), r["wall_s"])
        del tr
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
        dump()


def _preview(vids: list[np.ndarray], path: Path) -> None:
    from PIL import Image

    Image.fromarray(np.concatenate([np.concatenate([v[i] for i in (0, 4, 8, 12, 16)], axis=1) for v in vids], axis=0)).save(path)


# --------------------------------------------------------------------------------------------------
# The session
# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from .v2 import parse_seeds

    ap = argparse.ArgumentParser(description="wan-demo-fast by DMD2 (see the module docstring)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--form", default="lora", choices=["lora", "full"])
    ap.add_argument("--eval-only", choices=["v2", "lora"],
                    help="train nothing: evaluate wan-demo v2 at its defaults (v2), or v2 + the --lora-from "
                         "adapter at each of --lora-scales (lora)")
    ap.add_argument("--snapshot-every", type=int, default=0,
                    help="--form lora: keep the student adapter every N student updates (and the starting one) and "
                         "ship the one --pick-seeds scores best instead of the last (0: ship the last)")
    ap.add_argument("--pick-seeds", default="100-107",
                    help="--snapshot-every: the seeds the snapshots are scored on (held out from --eval-seeds)")
    ap.add_argument("--lora-scales", default="1",
                    help="--eval-only lora: comma-separated adapter scales (W + scale * B A), each evaluated")
    ap.add_argument("--seconds", type=float, default=200, help="training time box")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--lora-from", metavar="SAFETENSORS",
                    help="--form lora: start the student adapter from this LoRA file (e.g. the shipped "
                         "families/wan-demo/omniloop_wan_demo/adapters/fast.safetensors; its rank is --rank)")
    ap.add_argument("--critic-warmup", type=int, default=0, help="critic-only updates before the first student step")
    ap.add_argument("--teacher-guidance", type=float, default=3.0)
    ap.add_argument("--critic-steps", type=int, default=5)
    ap.add_argument("--student-lr", type=float, default=None, help="default: 3e-4 (lora), 5e-5 (full)")
    ap.add_argument("--critic-lr", type=float, default=None, help="default: 2x the student's")
    ap.add_argument("--timesteps", default="1000,750,500,250")
    ap.add_argument("--eval-seeds", default="0-31")
    ap.add_argument("--v2-steps", type=int, default=20)
    ap.add_argument("--vae-from", metavar="DIR",
                    help="decode every evaluated clip with this vae/ folder instead of the shipped one (e.g. a "
                         "decoder_specks fine-tune; the encoder must be the shipped one, training never decodes)")
    ap.add_argument("--smoke", action="store_true", help="tiny transformer, a few iterations, 2 clips (CPU check)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    a.seed_list = parse_seeds(a.eval_seeds, ap.error)
    a.timestep_list = tuple(int(t) for t in a.timesteps.split(","))
    if a.student_lr is None:
        a.student_lr = 3e-4 if a.form == "lora" else 5e-5
    if a.critic_lr is None:
        a.critic_lr = 2 * a.student_lr
    for k in ("seconds", "student_lr", "critic_lr", "teacher_guidance"):
        v = getattr(a, k)
        if not math.isfinite(v) or v <= 0:
            ap.error(f"--{k.replace('_', '-')}: must be a finite number > 0, got {v}")
    a.pick_seed_list = parse_seeds(a.pick_seeds, ap.error)
    if a.snapshot_every < 0 or (a.snapshot_every and a.form != "lora"):
        ap.error("--snapshot-every: a count >= 0, with --form lora")
    if a.snapshot_every and set(a.pick_seed_list) & set(a.seed_list):
        ap.error("--pick-seeds: must not overlap --eval-seeds (the pick would be judged on the clips it was picked on)")
    if a.batch < 1 or a.rank < 1 or a.critic_steps < 1 or a.critic_warmup < 0:
        ap.error("--batch, --rank and --critic-steps: must be >= 1, --critic-warmup >= 0")
    if a.lora_from:
        if a.form != "lora":
            ap.error("--lora-from: only with --form lora")
        if not Path(a.lora_from).is_file():
            ap.error(f"--lora-from: no file {a.lora_from}")
        try:
            a.rank = lora_file_rank(Path(a.lora_from))
        except Exception as e:  # not a safetensors file, or not a LoRA
            ap.error(f"--lora-from: {e}")
    try:
        a.scale_list = [float(x) for x in a.lora_scales.split(",")]
    except ValueError:
        ap.error(f"--lora-scales: expected comma-separated numbers, got {a.lora_scales!r}")
    if any(not math.isfinite(x) or x <= 0 for x in a.scale_list):
        ap.error(f"--lora-scales: each must be a finite number > 0, got {a.lora_scales!r}")
    if a.eval_only == "lora":
        if a.form != "lora":
            ap.error("--eval-only lora: only with --form lora")
        if not a.lora_from:
            from omniloop_wan_demo.checkpoint_path import fast_lora_path

            a.lora_from = str(fast_lora_path())
            a.rank = lora_file_rank(fast_lora_path())
    if a.vae_from and not (Path(a.vae_from) / "config.json").is_file():
        ap.error(f"--vae-from: {a.vae_from} is not a vae/ folder (no config.json)")
    if a.smoke:
        a.batch, a.seconds, a.seed_list, a.v2_steps = 2, 1e9, [0], 2
        a.pick_seed_list = a.pick_seed_list[:1]
    return a


def main(argv: list[str] | None = None) -> int:
    from omniloop_policies.samplers import FewStepSampler
    from omniloop_wan_demo.evaluate import full_prompts

    from .distill import GRID_SHIFT, _embed
    from .render import all_prompts

    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = a.device
    t_start = time.perf_counter()
    res: dict[str, Any] = {"args": {k: v for k, v in vars(a).items()}, "torch": torch.__version__,
                           "device": torch.cuda.get_device_name(0) if dev.startswith("cuda") else "cpu"}

    def dump() -> None:
        (out / "result.json").write_text(json.dumps(res, indent=1, default=str))

    v2 = load_v2(dev, smoke=a.smoke, vae_from=a.vae_from)
    eval_prompts = full_prompts()[:2] if a.smoke else full_prompts()
    if a.eval_only == "v2":
        res["eval"] = eval_v2(v2, prompts=eval_prompts, seeds=a.seed_list, steps=a.v2_steps, dev=dev)
        _log("eval v2", res["eval"]["n"], json.dumps(res["eval"]["accuracy"]), "duplicates", res["eval"]["duplicate_clips"],
             res["eval"]["wall_s"])
        res["total_s"] = round(time.perf_counter() - t_start, 1)
        dump()
        return 0
    if a.eval_only == "lora":
        eval_scales(v2, a, eval_prompts, res, dump)
        res["total_s"] = round(time.perf_counter() - t_start, 1)
        dump()
        return 0

    emb_all = _embed(v2["text_encoder"], v2["tokenizer"], all_prompts(), dev)
    emb_u = _embed(v2["text_encoder"], v2["tokenizer"], [""], dev)
    if a.smoke:
        emb_all, emb_u = emb_all[:, :8, :], emb_u[:, :8, :]
    teacher = v2["transformer"]
    if a.form == "lora":
        base = copy.deepcopy(teacher)
        student, teacher_role, critic = dmd.lora_roles(base, rank=a.rank, target_modules=LORA_TARGETS)
        if a.lora_from:
            from safetensors.torch import load_file

            lora = load_file(a.lora_from)
            if a.smoke:  # the tiny transformer: only the file's keys that fit it (a plumbing check)
                shapes = {k: p.shape for k, p in base.named_parameters()}
                lora = {k: v for k, v in lora.items()
                        if shapes.get(k.removeprefix("transformer.").rpartition(".")[0] + ".student.weight") == v.shape}
            res["lora_from"] = {"path": a.lora_from, "rank": a.rank, "tensors": load_adapter_state(base, "student", lora)}
    else:
        student, critic = copy.deepcopy(teacher).train(), copy.deepcopy(teacher).train()
        teacher_role = teacher.requires_grad_(False)
    cfg = dmd.DMDConfig(teacher_guidance=a.teacher_guidance, critic_steps=a.critic_steps, student_lr=a.student_lr,
                        critic_lr=a.critic_lr, seed=a.seed)
    sampler = FewStepSampler(timesteps_list=a.timestep_list, grid_shift=GRID_SHIFT)
    rollout = dmd.FewStepRollout(sampler=sampler, exit_generator=torch.Generator().manual_seed(a.seed + 1))
    res["recipe"] = {"dmd": {k: v for k, v in __import__("attrs").asdict(cfg).items()}, "form": a.form,
                     "rank": a.rank if a.form == "lora" else None, "batch": a.batch, "timesteps": list(a.timestep_list),
                     "grid_shift": GRID_SHIFT, "rollout": "few-step sampler, random exit step, graph of that step only",
                     "teacher": "wan-demo v2 (checkpoint/), CFG", "critic_warmup": a.critic_warmup,
                     "init": f"student = v2 + {a.lora_from}, critic = v2" if a.lora_from else "student and critic = v2"}
    log: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    warm = 20 * a.critic_steps

    def lr_at(i: int) -> float:
        frac = (time.perf_counter() - t0) / a.seconds
        return min(1.0, (i + 1) / warm) * (1.0 if frac < 0.75 else max(0.1, (1.0 - frac) / 0.25))

    def record(r: dict[str, Any]) -> None:
        r = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()} | {"t": round(time.perf_counter() - t0, 1)}
        log.append(r)
        _log("dmd", json.dumps(r))

    gen = torch.Generator(dev).manual_seed(a.seed + 2)
    stream = batches(emb_all, emb_u, batch=a.batch, dev=dev, seed=a.seed + 3)
    if a.critic_warmup:
        res["critic_warmup"] = dmd.warm_critic(critic, student, rollout, stream, cfg, steps=a.critic_warmup, generator=gen,
                                               log_every=1 if a.smoke else 20, log=lambda r: _log("critic-warmup", json.dumps(r)))
        t0 = time.perf_counter()  # the time box is the DMD2 loop's
    snapshots: list[tuple[int, dict[str, torch.Tensor]]] = []
    on_step = None
    if a.snapshot_every:
        snapshots.append((0, adapter_state(base, "student")))

        def on_step(n: int) -> None:
            if n % a.snapshot_every == 0:
                snapshots.append((n, adapter_state(base, "student")))
    info = dmd.train_dmd(student, teacher_role, critic, rollout, stream,
                         cfg, 4 if a.smoke else 10**9, log=record, log_every=1 if a.smoke else 100, lr_at=lr_at,
                         on_student_step=on_step, generator=gen, stop=lambda: time.perf_counter() - t0 > a.seconds)
    res["training"] = {"seconds": round(time.perf_counter() - t0, 1), "student_steps": info["student_steps"],
                       "critic_steps": info["critic_steps"], "log": log}
    dump()

    # ---- save what ships, then evaluate exactly that (fp16 weights) ----------------------------
    from diffusers import WanTransformer3DModel

    meta = {"from": "wan-demo v2", "method": "DMD2 (omniloop_wan_demo_training.dmd)", "timesteps": list(a.timestep_list),
            "grid_shift": GRID_SHIFT, "teacher_guidance": a.teacher_guidance, "student_steps": info["student_steps"]}
    if a.form == "lora":
        state = adapter_state(base, "student")
        if a.snapshot_every:
            if not snapshots or snapshots[-1][0] != info["student_steps"]:
                snapshots.append((info["student_steps"], state))
            step, state = pick_snapshot(snapshots, teacher, v2, a, eval_prompts, res)
            meta["picked_student_step"] = step
            dump()
        save_lora(state, out / "fast_lora.safetensors", meta | {"rank": a.rank, "alpha": a.rank})
        fast_tr = merge_lora(copy.deepcopy(teacher).float(), state).eval()
    else:
        student.eval().to("cpu").half().save_pretrained(str(out / "transformer"), safe_serialization=True)
        fast_tr = WanTransformer3DModel.from_pretrained(str(out / "transformer"), torch_dtype=torch.float32).to(dev).eval()
        state, res["extraction"] = extract_lora(fast_tr, teacher, a.rank)
        save_lora(state, out / "fast_lora.safetensors", meta | {"rank": a.rank, "alpha": a.rank, "extracted": res["extraction"]})
        _log("extracted LoRA", json.dumps(res["extraction"]))
    del student, critic
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    r = eval_fast(fast_tr, v2, prompts=eval_prompts, seeds=a.seed_list, timesteps=a.timestep_list, dev=dev,
                  preview=out / "preview.png")
    res["eval"] = r
    _log("eval fast", a.form, r["n"], json.dumps(r["accuracy"]), "duplicates", r["duplicate_clips"], r["wall_s"])
    if a.form == "full":  # the extracted LoRA on v2, evaluated too
        lora_tr = merge_lora(copy.deepcopy(teacher).float(), state).eval()
        r2 = eval_fast(lora_tr, v2, prompts=eval_prompts, seeds=a.seed_list, timesteps=a.timestep_list, dev=dev, preview=None)
        res["eval_extracted_lora"] = r2
        _log("eval extracted lora", r2["n"], json.dumps(r2["accuracy"]), "duplicates", r2["duplicate_clips"], r2["wall_s"])
    res["total_s"] = round(time.perf_counter() - t_start, 1)
    dump()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
