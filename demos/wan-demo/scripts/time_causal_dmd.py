"""CPU cost of one causal DMD2 iteration of wan-demo-causal at the recipe's settings (issue 41):
per phase, in CPU seconds of the process (``time.process_time``, so other jobs on the cores do not
count), one thread, the last of ``--repeats`` repetitions (the first warms the allocator up).

    OMP_NUM_THREADS=1 python demos/wan-demo/scripts/time_causal_dmd.py --batch 16,64 [--json OUT.json]

The phases of :func:`omniloop_wan_demo_training.dmd.train_dmd` with
:class:`~omniloop_wan_demo_training.self_forcing.SelfForcingRollout` (5 one-latent-frame chunks,
4 Euler steps each, random exit step) on the shipped wan-demo-causal student, v2 as teacher (CFG 5)
and critic: a student update is the rollout with the exit steps' graph, the DM loss (teacher with
CFG + critic), its backward and that iteration's critic update; a critic-only iteration is a rollout
without gradient and the critic's flow-matching forward and backward. With ``critic_steps`` c, one
student update costs ``student_step + (c - 1) * critic_step``, or ``student_step + (c - 1) *
critic_forward_backward`` with ``DMDConfig.reuse_samples``. Optimizer steps are left out (small).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="CPU seconds of one causal DMD2 iteration (see the docstring)")
    ap.add_argument("--batch", default="16,64", help="comma list of batch sizes (clips per rollout)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--critic-steps", type=int, default=5, help="for the per-update total")
    ap.add_argument("--json", help="write the figures here too")
    a = ap.parse_args(argv)
    try:
        sizes = [int(b) for b in a.batch.split(",")]
    except ValueError:
        ap.error(f"--batch: a comma list of integers, got {a.batch!r}")
    if any(b < 1 for b in sizes) or a.repeats < 1 or a.critic_steps < 1:
        ap.error("--batch sizes, --repeats and --critic-steps must be >= 1")

    import torch
    from diffusers import WanTransformer3DModel

    from omniloop_kit.causal import CausalOptions
    from omniloop_wan_demo.checkpoint_path import causal_checkpoint_dir, checkpoint_dir
    from omniloop_wan_demo_training import dmd
    from omniloop_wan_demo_training.self_forcing import SelfForcingRollout
    from omniloop_wan_demo_training.train_causal import load_source, prompt_table
    from omniloop_wan_demo_training.train_causal_dmd import ROLLOUT_OPTIONS, prompt_batches

    torch.set_num_threads(1)
    comps = load_source(checkpoint_dir(), "cpu")
    table = prompt_table(comps["text_encoder"], comps["tokenizer"], "cpu")
    student = WanTransformer3DModel.from_pretrained(str(causal_checkpoint_dir() / "transformer"),
                                                    torch_dtype=torch.float32).train()
    teacher = comps["transformer"].eval().requires_grad_(False)
    critic = copy.deepcopy(teacher).train().requires_grad_(True)
    rollout = SelfForcingRollout(CausalOptions(**ROLLOUT_OPTIONS), exit="random")
    cfg = dmd.DMDConfig(teacher_guidance=5.0, critic_steps=a.critic_steps)
    gen = torch.Generator().manual_seed(0)
    vae = comps["vae"]
    shape = (int(student.config.in_channels), (17 - 1) // int(vae.config.scale_factor_temporal) + 1,
             64 // int(vae.config.scale_factor_spatial), 64 // int(vae.config.scale_factor_spatial))
    out: dict[str, object] = {"what": "CPU seconds (process time, 1 thread) per phase of one causal DMD2 iteration",
                              "torch": torch.__version__, "latent_shape": list(shape), "rollout": ROLLOUT_OPTIONS,
                              "critic_steps": a.critic_steps, "batches": {}}
    for b in sizes:
        it = prompt_batches(table, batch=b, latent_shape=shape, gen=gen, device="cpu")
        r: dict[str, float] = {}
        for _ in range(a.repeats):
            batch = next(it)
            t = time.process_time()
            x0 = rollout(student, batch.noise, batch.text, gen)
            r["rollout_with_grad"] = time.process_time() - t
            t = time.process_time()
            loss = dmd.distribution_matching_loss(x0, batch.text, teacher, critic, cfg, gen)
            r["dm_loss"] = time.process_time() - t
            t = time.process_time()
            loss.backward()
            r["student_backward"] = time.process_time() - t
            student.zero_grad(set_to_none=True)
            batch = next(it)
            t = time.process_time()
            with torch.no_grad():
                x0 = rollout(student, batch.noise, batch.text, gen)
            r["rollout_no_grad"] = time.process_time() - t
            t = time.process_time()
            dmd.critic_loss(critic, x0, batch.text, gen, cfg=cfg).backward()
            r["critic_forward_backward"] = time.process_time() - t
            critic.zero_grad(set_to_none=True)
        r["student_step"] = r["rollout_with_grad"] + r["dm_loss"] + r["student_backward"] + r["critic_forward_backward"]
        r["critic_step"] = r["rollout_no_grad"] + r["critic_forward_backward"]
        r["per_student_update"] = r["student_step"] + (a.critic_steps - 1) * r["critic_step"]
        # DMDConfig.reuse_samples: the critic-only iterations skip the rollout
        r["per_student_update_reusing_samples"] = r["student_step"] + (a.critic_steps - 1) * r["critic_forward_backward"]
        out["batches"][str(b)] = {k: round(v, 2) for k, v in r.items()}  # type: ignore[index]
        print(b, json.dumps(out["batches"][str(b)]), flush=True)  # type: ignore[index]
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
