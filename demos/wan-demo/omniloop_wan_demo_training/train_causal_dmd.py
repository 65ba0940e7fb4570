"""Retrain ``wan-demo-causal`` from wan-demo v2 with the DMD2 recipe, Self-Forcing style (issue 41).

Two stages on one GPU, one call:

1. **causal adaptation** (``--tf-seconds``, may be 0): v2's transformer fine-tuned block-causally by
   teacher forcing (:func:`.train_causal.train_causal`: clean data context, per-chunk noise levels),
   so that it runs chunk by chunk at all — Self-Forcing starts from such a causal initialisation;
2. **DMD2 with the student's own rollouts** (``--dmd-seconds``): the student makes whole clips
   chunk by chunk with its KV cache exactly as the runtime streams them
   (:class:`.self_forcing.SelfForcingRollout`: the runtime's chunk size, steps per chunk, shift and
   flow-Euler math, its own earlier chunks as context; gradient through one exit step per chunk);
   the clip goes into the recipe's distribution-matching loss (:mod:`.dmd`) against the
   **bidirectional** v2 transformer with CFG (the real score) and a critic (the fake score, a copy
   of v2 trained by flow matching on the student's clips, several critic steps per student step).

The student then runs without CFG (``guidance_scale`` 1 in ``omniloop.json``; the teacher's
guidance is distilled into it): one forward per step instead of two. VAE, text encoder and
tokenizer are v2's, frozen and shared: the output folder's own files are ``transformer/`` and
``omniloop.json`` (the rest are links, :func:`.train_causal.save_checkpoint`); ``--ship DIR``
installs it as ``checkpoint_causal/`` (:func:`.train_causal.ship`: links to ``checkpoint/``).

    # GPU (one call; see families/wan-demo/README.md, wan-demo-causal)
    python -m omniloop_wan_demo_training.train_causal_dmd --out $OUT/causal --tf-seconds 45 --dmd-seconds 150
    # resumed from the shipped student, critic warmed up first (scripts/gpu_causal_dmd.sh, one variant)
    python -m omniloop_wan_demo_training.train_causal_dmd --out $OUT/causal --tf-seconds 0 \
        --student-from families/wan-demo/omniloop_wan_demo/checkpoint_causal --critic-warmup 100 --dmd-seconds 280
    # CPU check of the whole script (tiny sizes; what the test runs)
    python -m omniloop_wan_demo_training.train_causal_dmd --out /tmp/causal-dmd --smoke --device cpu
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from omniloop_kit.causal import CausalOptions
from omniloop_wan_demo.checkpoint_path import CAUSAL_ROLLOUT_OPTIONS, checkpoint_dir

from .self_forcing import SelfForcingRollout
from .train_causal import PROMPTS, load_source, prompt_table, save_checkpoint, ship, train_causal

#: the student's rollout as shipped: the causal preset's chunks / steps / shift, no CFG
ROLLOUT_OPTIONS: dict[str, Any] = dict(CAUSAL_ROLLOUT_OPTIONS, guidance_scale=1.0)


class BudgetSpent(Exception):
    """Raised by the DMD loop's student-step hook once ``--dmd-seconds`` are spent (ends the loop)."""


def prompt_batches(table: torch.Tensor, *, batch: int, latent_shape: tuple[int, ...], gen: torch.Generator,
                   device: str) -> Iterator[Any]:
    """Endless :class:`.dmd.Batch` es: ``noise`` ``[B, *latent_shape]``, ``text.cond`` (a prompt of
    the vocabulary each, padded to 512 as the runtime's text encoder) and ``text.uncond`` (``""``'s
    states, the teacher's CFG branch); the last row of ``table`` is ``""``."""
    from .dmd import Batch, Text

    n = table.shape[0] - 1
    uncond = table[n:n + 1]
    while True:
        idx = torch.randint(0, n, (batch,), device=device, generator=gen)
        noise = torch.randn((batch, *latent_shape), device=device, generator=gen)
        yield Batch(noise, Text(table[idx], uncond))


@torch.no_grad()
def batched_eval(transformer: Any, vae: Any, table: torch.Tensor, *, prompts: list[str], seeds: list[int],
                 options: dict[str, Any], batch: int = 96) -> dict[str, Any]:
    """Adherence of ``transformer``'s causal rollout (:func:`.self_forcing.causal_rollout`, the
    runtime's noise per seed, no CFG), many clips per forward: a quick check on the GPU (the
    shipped figures are the runtime's, streamed on the CPU)."""
    import numpy as np

    from omniloop_wan.stages import denormalise, to_uint8_frames
    from omniloop_wan_demo.evaluate import score

    from .self_forcing import causal_rollout, stream_noise

    ro = CausalOptions(**{k: v for k, v in options.items() if k in {a.name for a in attrs_fields(CausalOptions)}})
    index = {p: i for i, p in enumerate(PROMPTS)}
    pairs = [(p, s) for s in seeds for p in prompts]
    dev = next(transformer.parameters()).device
    frames = (17 - 1) // int(vae.config.scale_factor_temporal) + 1
    hw = 64 // int(vae.config.scale_factor_spatial)
    chunk_shape = (1, int(transformer.config.in_channels), ro.chunk_frames, hw, hw)
    clips = []
    t0 = time.perf_counter()
    for i in range(0, len(pairs), batch):
        part = pairs[i:i + batch]
        noise = stream_noise([s for _, s in part], frames // ro.chunk_frames, chunk_shape).to(dev)
        text = table[torch.tensor([index[p] for p, _ in part], device=table.device)]
        lat = causal_rollout(transformer, noise, text, ro, seeds=[s for _, s in part])  # the runtime's noise
        video = vae.decode(denormalise(vae, lat.to(vae.dtype)), return_dict=False)[0].clamp(-1, 1)
        clips.extend(np.asarray(to_uint8_frames(v[None]), dtype=np.uint8) for v in video)
    acc, _ = score(clips, [p for p, _ in pairs], [s for _, s in pairs])
    return {"n": len(clips), "accuracy": acc, "wall_s": round(time.perf_counter() - t0, 1)}


def attrs_fields(cls: type) -> Any:
    import attrs

    return attrs.fields(cls)


def save_progress(path: Path, student: Any, ema: Any, info: dict[str, Any]) -> None:
    """A periodic checkpoint of a long run: the student's raw and EMA state dicts and where it got."""
    tmp = path.with_suffix(".tmp")
    torch.save({"transformer": student.state_dict(), "ema_transformer": ema.shadow["transformer"].state_dict(),
                "info": info}, tmp)
    tmp.replace(path)


def train(*, src: Path, out: Path, tf_seconds: float, dmd_seconds: float, max_dmd_steps: int | None, batch: int,
          tf_batch: int, n_clips: int, encode_seconds: float, exit: str, seed: int, device: str,
          dmd_overrides: dict[str, Any], ema_decay: float = 0.95, warmup: int = 10,
          smoke: bool = False, student_from: Path | None = None, critic_warmup: int = 0, renoise: str = "euler",
          save_every_s: float = 0.0, check_stage1: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stage 1 then stage 2 (module docstring). Returns ``(components, info)``: the components
    hold ``transformer`` (the student as trained) and ``ema_transformer`` (its EMA).

    ``student_from``: a causal checkpoint folder whose transformer starts the student (e.g. the
    shipped wan-demo-causal; stage 1 is then skipped); ``critic_warmup``: critic-only updates
    before the first student step (:func:`warm_critic`); ``renoise``: the rollout between a
    chunk's steps (:func:`.self_forcing.causal_rollout`); ``save_every_s`` > 0: the student's raw
    and EMA weights to ``out/progress.pt`` that often (:func:`save_progress`); ``check_stage1(student,
    comps)``: called once before DMD2 when stage 1 ran (the teacher-forced causal model, before any
    distribution matching), its result kept as ``info["check_after_teacher_forcing"]``."""
    from diffusers import WanTransformer3DModel

    from . import dmd
    from .train_dit import EMA

    info: dict[str, Any] = {"source": str(src)}
    t0 = time.perf_counter()
    if student_from is not None and tf_seconds > 0:
        raise ValueError("train_causal_dmd: --student-from starts from a causal student; give --tf-seconds 0")
    if tf_seconds > 0:
        comps, tf_info = train_causal(src=src, out=out, budget_s=tf_seconds, max_steps=3 if smoke else None,
                                      batch=tf_batch, n_clips=n_clips, encode_seconds=encode_seconds, seed=seed,
                                      device=device, log_every=1 if smoke else 50, warmup=1 if smoke else 50)
        raw = comps.pop("raw_transformer", None)
        info["teacher_forcing"] = {k: tf_info[k] for k in ("steps", "seconds", "encode_seconds", "n_clips", "recipe", "log")}
        if dmd_seconds <= 0:
            # stage 1 alone (--dmd-seconds 0): the teacher-forced model, raw and EMA, no distribution matching
            comps["ema_transformer"] = comps["transformer"].eval().requires_grad_(False)
            comps["transformer"] = raw.eval().requires_grad_(False) if raw is not None else comps["ema_transformer"]
            comps["prompt_table"] = prompt_table(comps["text_encoder"], comps["tokenizer"], device)
            info.update(stage1_wall_s=round(time.perf_counter() - t0, 1), steps=0,
                        seconds=round(time.perf_counter() - t0, 1))
            info["recipe"] = dict(method="teacher-forcing causal adaptation only (stage 1; no DMD2)",
                                  init="wan-demo v2 transformer", rollout=ROLLOUT_OPTIONS, tf_seconds=tf_seconds,
                                  frozen=["vae", "text_encoder"], prompts=len(PROMPTS))
            return comps, info
    else:
        comps = load_source(src, device)
        if student_from is not None:
            from diffusers import WanTransformer3DModel as _Wan

            comps["transformer"] = _Wan.from_pretrained(str(student_from / "transformer"),
                                                        torch_dtype=torch.float32).to(device)
            info["student_from"] = str(student_from)
    info["stage1_wall_s"] = round(time.perf_counter() - t0, 1)

    student = comps["transformer"].to(device).train().requires_grad_(True)
    teacher = WanTransformer3DModel.from_pretrained(str(src / "transformer"), torch_dtype=torch.float32).to(device)
    teacher.eval().requires_grad_(False)
    critic = copy.deepcopy(teacher).train().requires_grad_(True)

    vae = comps["vae"]
    frames = (17 - 1) // int(vae.config.scale_factor_temporal) + 1
    hw = 64 // int(vae.config.scale_factor_spatial)
    latent_shape = (int(student.config.in_channels), frames, hw, hw)
    table = prompt_table(comps["text_encoder"], comps["tokenizer"], device)
    comps["prompt_table"] = table
    if tf_seconds > 0 and check_stage1 is not None:
        student.eval()
        info["check_after_teacher_forcing"] = check_stage1(student, comps)
        student.train()
    gen = torch.Generator(device).manual_seed(seed + 977)
    batches = prompt_batches(table, batch=batch, latent_shape=latent_shape, gen=gen, device=device)
    rollout = SelfForcingRollout(CausalOptions(**ROLLOUT_OPTIONS), exit=exit, renoise=renoise)
    config = dmd.DMDConfig(**dmd_overrides)
    ema = EMA({"transformer": student}, ema_decay)
    log: list[dict[str, Any]] = []
    state = {"student_steps": 0, "saved_at": time.perf_counter()}
    if critic_warmup > 0:
        student.eval()
        info["critic_warmup"] = dmd.warm_critic(critic, student, rollout, batches, config, steps=critic_warmup,
                                                generator=gen, log_every=1 if smoke else 10,
                                                log=lambda r: print("critic-warmup", json.dumps(r), flush=True))
        student.train()
    progress = out / "progress.pt"
    deadline = time.perf_counter() + dmd_seconds  # the DMD2 loop's own time box (after the critic warm-up)

    def on_student_step(k: int) -> None:
        ema.update(k - 1)
        state["student_steps"] = k
        if save_every_s > 0 and time.perf_counter() - state["saved_at"] > save_every_s:
            out.mkdir(parents=True, exist_ok=True)
            save_progress(progress, student, ema, {"student_steps": k, "log": log})
            state["saved_at"] = time.perf_counter()
        if time.perf_counter() > deadline:
            raise BudgetSpent

    t1 = time.perf_counter()
    iters = (max_dmd_steps or 10**9) * config.critic_steps
    try:
        result = dmd.train_dmd(student, teacher, critic, rollout, batches, config, steps=iters, log=log.append,
                               log_every=2 if smoke else 25, lr_at=lambda i: min(1.0, (i + 1) / (warmup * config.critic_steps)),
                               on_student_step=on_student_step, generator=gen)
    except BudgetSpent:
        result = {"stopped": "dmd_seconds spent"}
    for r in log[-3:]:
        print("dmd", json.dumps(r), flush=True)
    info["dmd"] = {"seconds": round(time.perf_counter() - t1, 1), "student_steps": state["student_steps"], "log": log,
                   "config": _plain(config), "result": _plain(result), "ema_decay": ema_decay, "warmup": warmup}
    comps["transformer"] = student.eval().requires_grad_(False)
    comps["ema_transformer"] = ema.shadow["transformer"]
    info["steps"] = state["student_steps"]
    info["seconds"] = round(time.perf_counter() - t0, 1)
    info["recipe"] = dict(
        method=("Self-Forcing DMD2: " + ("a causal student resumed" if student_from is not None
                                          else "teacher-forcing causal adaptation") +
                ", then distribution matching of the student's own chunked KV-cached rollouts against the "
                "bidirectional v2 teacher with CFG"),
        init=f"causal student from {student_from}" if student_from is not None else "wan-demo v2 transformer",
        critic_warmup=critic_warmup, renoise=renoise, teacher="wan-demo v2 transformer (bidirectional, frozen)",
        critic="copy of the v2 transformer, flow matching on student clips", rollout=ROLLOUT_OPTIONS,
        exit_step=exit, batch=batch, tf_seconds=tf_seconds, dmd_seconds=dmd_seconds, dmd=_plain(config),
        ema_decay=ema_decay, frozen=["vae", "text_encoder"], prompts=len(PROMPTS))
    return comps, info


def _plain(obj: Any) -> Any:
    """JSON-able view of a config / result (attrs classes, tensors, modules)."""
    import attrs

    if attrs.has(type(obj)):
        return {k: _plain(v) for k, v in attrs.asdict(obj, recurse=False).items()}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items() if not isinstance(v, torch.nn.Module)}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist() if obj.numel() < 16 else f"tensor{list(obj.shape)}"
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return str(obj)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="retrain wan-demo-causal with Self-Forcing DMD2 (see the module docstring)")
    ap.add_argument("--out", help="output folder (the checkpoint + train_causal_dmd.json)")
    ap.add_argument("--from", dest="src", default=None, help="source checkpoint (default: the shipped wan-demo v2)")
    ap.add_argument("--tf-seconds", type=float, default=45.0, help="stage 1, teacher forcing (0: start from v2 as it is)")
    ap.add_argument("--dmd-seconds", type=float, default=150.0, help="stage 2, DMD2 on the student's own rollouts; 0 (with --tf-seconds > 0): stop after "
                         "stage 1 and save the teacher-forced model")
    ap.add_argument("--max-dmd-steps", type=int)
    ap.add_argument("--batch", type=int, default=64, help="DMD batch (clips per student rollout)")
    ap.add_argument("--tf-batch", type=int, default=128)
    ap.add_argument("--n-clips", type=int, default=16384)
    ap.add_argument("--encode-seconds", type=float, default=15.0)
    ap.add_argument("--exit", default="random", choices=["random", "last"], help="the step of each chunk with gradient")
    ap.add_argument("--dmd", default="{}", help="JSON object of DMDConfig overrides, e.g. '{\"teacher_guidance\": 3.0}'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--eval-seeds", default="0", help="seeds of the quick batched check that picks raw or EMA weights")
    ap.add_argument("--ema-decay", type=float, default=0.95)
    ap.add_argument("--student-from", metavar="CAUSAL_DIR",
                    help="start the student from this causal checkpoint's transformer (e.g. the shipped "
                         "wan-demo-causal; needs --tf-seconds 0)")
    ap.add_argument("--critic-warmup", type=int, default=0, help="critic-only updates before the first student step")
    ap.add_argument("--renoise", default="euler", choices=["euler", "fresh"],
                    help="the student's rollout between a chunk's steps: euler (the runtime's default sampler) or "
                         "fresh noise (DMD2's sampler; the checkpoint is then saved with rollout_options.sampler fresh)")
    ap.add_argument("--save-every-s", type=float, default=0.0, help="save raw + EMA weights to OUT/progress.pt this often")
    ap.add_argument("--eval-batch", type=int, default=96, help="clips per forward of the raw / EMA check")
    ap.add_argument("--smoke", action="store_true", help="CPU check: 2 DMD steps, batch 2, 3 teacher-forcing steps")
    ap.add_argument("--ship", metavar="TRAINED_DIR", help="install TRAINED_DIR as the package's checkpoint_causal/ and exit")
    a = ap.parse_args(argv)
    if a.ship:
        print(f"installed {ship(Path(a.ship))}")
        return 0
    if not a.out:
        ap.error("--out is required")
    try:
        overrides = json.loads(a.dmd)
    except ValueError as e:
        ap.error(f"--dmd: not JSON ({e})")
    if not isinstance(overrides, dict):
        ap.error("--dmd: expected a JSON object")
    if a.smoke:
        a.max_dmd_steps, a.batch, a.tf_batch, a.n_clips, a.encode_seconds = a.max_dmd_steps or 2, 2, 2, 8, 60.0
        a.tf_seconds = 60.0 if a.tf_seconds > 0 else 0.0  # capped by 3 steps
    if a.student_from:
        if a.tf_seconds > 0:
            ap.error("--student-from starts from a causal student: give --tf-seconds 0 too")
        if not (Path(a.student_from) / "transformer" / "config.json").is_file():
            ap.error(f"--student-from: {a.student_from} has no transformer/config.json")
    if a.dmd_seconds < 0 or (a.dmd_seconds == 0 and a.tf_seconds <= 0):
        ap.error("--dmd-seconds must be >= 0; 0 keeps the teacher-forced model, so give --tf-seconds > 0 with it")
    if a.critic_warmup < 0 or a.save_every_s < 0 or a.eval_batch < 1:
        ap.error("--critic-warmup and --save-every-s must be >= 0, --eval-batch >= 1")
    src = Path(a.src) if a.src else checkpoint_dir()
    out = Path(a.out)
    t_start = time.perf_counter()
    # the quick batched check of a model's own rollout (full prompts, --eval-seeds): the teacher-forced
    # model after stage 1 (so a run tells how much shape the causal adaptation keeps before DMD2), then
    # the student and its EMA, which picks the weights saved
    from omniloop_wan_demo.evaluate import default_prompts, full_prompts

    prompts = default_prompts()[:2] if a.smoke else full_prompts()
    seeds = [int(s) for s in a.eval_seeds.split(",")]
    # a student trained with --renoise fresh is checked and served with the fresh-noise sampler
    served = dict(ROLLOUT_OPTIONS, sampler="fresh") if a.renoise == "fresh" else dict(ROLLOUT_OPTIONS)
    opts = dict(served, steps=2) if a.smoke else dict(served)

    def check(model: Any, comps: dict[str, Any], name: str) -> dict[str, Any]:
        try:
            r = batched_eval(model, comps["vae"], comps["prompt_table"], prompts=prompts, seeds=seeds, options=opts,
                             batch=a.eval_batch)
        except Exception as e:  # never lose a trained checkpoint to an evaluation bug
            r = {"error": f"{type(e).__name__}: {e}"}
        print("check", name, json.dumps(r), flush=True)
        return r

    comps, info = train(src=src, out=out, tf_seconds=a.tf_seconds, dmd_seconds=a.dmd_seconds, max_dmd_steps=a.max_dmd_steps,
                        batch=a.batch, tf_batch=a.tf_batch, n_clips=a.n_clips, encode_seconds=a.encode_seconds, exit=a.exit,
                        seed=a.seed, device=a.device, dmd_overrides=overrides, ema_decay=a.ema_decay,
                        smoke=a.smoke, student_from=Path(a.student_from) if a.student_from else None,
                        critic_warmup=a.critic_warmup, renoise=a.renoise, save_every_s=a.save_every_s,
                        check_stage1=lambda model, comps: check(model, comps, "after_teacher_forcing"))
    info["args"] = vars(a)
    info["device"] = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    info["torch"] = torch.__version__
    # pick the student or its EMA by the same check
    checks: dict[str, Any] = {name: check(comps[name], comps, name) for name in ("transformer", "ema_transformer")}

    def merit(r: dict[str, Any]) -> float:
        acc = r.get("accuracy") or {}
        return sum(acc.get(k, 0.0) for k in ("color", "direction", "shape", "clean"))

    chosen = "ema_transformer" if merit(checks["ema_transformer"]) > merit(checks["transformer"]) else "transformer"
    info["checks"] = checks
    info["shipped_weights"] = "ema" if chosen == "ema_transformer" else "raw"
    info["recipe"]["shipped_weights"] = info["shipped_weights"]
    save_checkpoint(dict(comps, transformer=comps[chosen]), src, out, info, served)
    (out / "train_causal_dmd.json").write_text(json.dumps(info, indent=1, default=str))
    print(f"saved {out} ({chosen}) at {time.perf_counter() - t_start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
