"""Step scheduler vs serial (request-level FIFO): latency of short requests behind a long one,
total throughput, and image batching — side by side in one process, interleaved and repeated.

Scenario A (latency): one long request (``--long-steps``) is submitted; while it runs, ``--shorts``
short requests (``--short-steps``) arrive at a fixed interval spread over ``--arrival-span`` of the
long request's solo duration (measured first). Reported per scheduler (median over repeats): p50
and p95 latency of the short requests (submit → final event), makespan and throughput (requests
and loop steps per second). Ratios: short p50/p95 serial ÷ step (target ≥ 5), throughput
step ÷ serial (target ≥ 0.95).

With ``--roles vae`` (comma-separated components) a third variant runs in the same repeats: the
step scheduler on a role-pool runtime (omniloop-parallel's ``RolePoolRuntime``, deploy
``placement: {vae: {devices: [cpu]}}``): the placed stages (VAE decode) run in one worker process
while the scheduler's process keeps stepping other requests. Ratios: short p95 serial ÷ roles
(issue 18 target ≥ 3), throughput roles ÷ serial (target ≥ 0.95). Serial (FIFO) and step run
in-process, as before.

Scenario B (image batching): ``--images`` same-size t2i requests submitted at once; throughput with
the step scheduler (co-batched forwards, ``max_batch`` = images) vs sequential (serial), and vs
step with ``max_batch=1`` (interleaved, unbatched) to separate batching from interleaving.

    python bench/scheduler_latency.py                   # toy family, CPU; writes bench/results/scheduler_latency-<date>.json
    python bench/scheduler_latency.py --model wan-demo  # the demo checkpoint (preset), when installed
    python bench/scheduler_latency.py --model wan-demo --roles vae --skip-images   # + the role-pool variant
    python bench/scheduler_latency.py --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from omniloop.runtime import Runtime
from omniloop_scheduler import AsyncEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (also when loaded by file path)
import _common as common

HERE = Path(__file__).resolve().parent


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def make_runtime(model: str, tmp: Path, max_steps: int) -> Runtime:
    limits = {"max_steps": max(max_steps, 200), "max_queue": 1024}
    if model == "toy":
        from omniloop.testing import build_toy_checkpoint, make_manager
        from omniloop_scheduler import plugin

        ckpt = build_toy_checkpoint(tmp / "toy")
        return Runtime.from_model(ckpt, manager=make_manager(("scheduler", plugin), scheduler=False), limits=limits)
    return Runtime.from_model(model, limits=limits)


def video_req(args: argparse.Namespace, steps: int, seed: int, task: str = "t2v") -> dict[str, Any]:
    d: dict[str, Any] = {"steps": steps, "seed": seed}
    if args.size:
        w, h = (int(x) for x in args.size.lower().split("x"))
        d.update(width=w, height=h)
    if args.frames:
        d["frames"] = args.frames
    return {"task": task, "prompt": f"a bench request {seed}", "diffusion": d, "outputs": {"stream_progress": False}}


IMAGE_TASK = "t2i"  # set to "t2v" (one frame) for families without a t2i pipeline (Wan)


def image_req(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    w, h = (int(x) for x in args.image_size.lower().split("x"))
    return {"task": IMAGE_TASK, "prompt": f"an image {seed}",
            "diffusion": {"steps": args.image_steps, "seed": seed, "width": w, "height": h, "frames": 1},
            "outputs": {"stream_progress": False}}


async def _timed(handle: Any, done: dict[str, float]) -> Any:
    out = await handle.result(timeout=3600)
    done[handle.request_id] = time.perf_counter()
    return out


async def latency_run(rt: Runtime, scheduler: str, args: argparse.Namespace, gap: float, rep: int,
                      order: str = "round_robin") -> dict[str, Any]:
    engine = AsyncEngine(rt, scheduler, max_batch=args.max_batch, order=order)
    await engine.start()
    done: dict[str, float] = {}
    submitted: dict[str, float] = {}
    t0 = time.perf_counter()
    c0 = time.process_time()
    long = engine.submit(video_req(args, args.long_steps, 10_000 + rep))
    submitted[long.request_id] = t0
    tasks = [asyncio.create_task(_timed(long, done))]
    shorts = []
    for i in range(args.shorts):
        await asyncio.sleep(max(0.0, t0 + (i + 1) * gap - time.perf_counter()))
        h = engine.submit(video_req(args, args.short_steps, i + 100 * rep))
        submitted[h.request_id] = time.perf_counter()
        shorts.append(h)
        tasks.append(asyncio.create_task(_timed(h, done)))
    outs = await asyncio.gather(*tasks)
    cpu = time.process_time() - c0  # less sensitive than wall time to other load on the machine
    await engine.shutdown()
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    makespan = max(done.values()) - t0
    lat = [done[h.request_id] - submitted[h.request_id] for h in shorts]
    steps = args.long_steps + args.shorts * args.short_steps
    return {
        "scheduler": scheduler,
        "short_p50_s": percentile(lat, 0.5), "short_p95_s": percentile(lat, 0.95), "short_max_s": max(lat),
        "long_latency_s": done[long.request_id] - t0, "makespan_s": makespan,
        "requests_per_s": (1 + args.shorts) / makespan, "steps_per_s": steps / makespan,
        "cpu_s": cpu, "steps_per_cpu_s": steps / cpu,
        "batched_forwards": engine.stats()["batched_forwards"],
        # where the worker's time went: loop-step forwards vs stages (encoders, decoders)
        "step_units_s": engine.stats()["step_seconds"]["sum"], "stage_units_s": engine.stats()["stage_seconds"]["sum"],
    }


async def image_run(rt: Runtime, scheduler: str, max_batch: int, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    engine = AsyncEngine(rt, scheduler, max_batch=max_batch)
    await engine.start()
    done: dict[str, float] = {}
    t0 = time.perf_counter()
    hs = [engine.submit(image_req(args, 1000 * rep + i)) for i in range(args.images)]
    outs = await asyncio.gather(*(_timed(h, done) for h in hs))
    await engine.shutdown()
    assert all(o.ok for o in outs)
    makespan = max(done.values()) - t0
    return {"makespan_s": makespan, "images_per_s": args.images / makespan,
            "batched_forwards": engine.stats()["batched_forwards"]}


def med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def make_role_runtime(model: str, components: list[str], max_steps: int, threads: int) -> Any:
    """The role-pool runtime: ``components`` placed on one CPU worker process."""
    from omniloop.runtime import deploy_for_model
    from omniloop_parallel import RolePoolRuntime

    limits = {"max_steps": max(max_steps, 200), "max_queue": 1024}
    deploy = deploy_for_model(model, limits=limits, placement={c: {"devices": ["cpu"]} for c in components})
    return RolePoolRuntime(deploy, threads=threads)


async def bench(rt: Runtime, args: argparse.Namespace, role_rt: Any = None) -> dict[str, Any]:
    # warm both paths once, then measure the long request alone for the arrival interval
    await latency_warm(rt, args)
    if role_rt is not None:
        await latency_warm(role_rt, args, ("step",), images=False)
    eng = AsyncEngine(rt, "serial")
    await eng.start()
    t = time.perf_counter()
    await eng.submit(video_req(args, args.long_steps, 1)).result(timeout=3600)
    long_solo = time.perf_counter() - t
    await eng.shutdown()
    gap = args.arrival_span * long_solo / max(1, args.shorts)

    runs: dict[str, list[dict[str, Any]]] = {"serial": [], "step": []}
    variants = ["serial", "step", *args.extra_variants]
    if role_rt is not None:
        variants.append(args.role_variant)
    for v in variants:
        runs.setdefault(v, [])
    for rep in range(args.repeats):
        order = variants if rep % 2 == 0 else variants[::-1]
        for sched in order:
            name, _, how = sched.partition(":")  # "step:fewest" / "roles:fewest": order fewest_steps_left
            ordering = "fewest_steps_left" if how == "fewest" else "round_robin"
            if name == "roles":
                runs[sched].append(await latency_run(role_rt, "step", args, gap, rep, ordering))
                runs[sched][-1]["scheduler"] = f"step+roles ({ordering})"
            else:
                runs[sched].append(await latency_run(rt, name, args, gap, rep, ordering))
            r = runs[sched][-1]
            print(f"  rep {rep} {sched:<12} short p50 {r['short_p50_s']:.3f}s p95 {r['short_p95_s']:.3f}s "
                  f"makespan {r['makespan_s']:.3f}s (steps {r['step_units_s']:.3f}s, stages {r['stage_units_s']:.3f}s)",
                  flush=True)
    summary_latency = {
        s: {k: med(rs, k) for k in ("short_p50_s", "short_p95_s", "long_latency_s", "makespan_s", "requests_per_s", "steps_per_s",
                                  "cpu_s", "steps_per_cpu_s", "step_units_s", "stage_units_s")}
        for s, rs in runs.items()
    }
    ser, stp = summary_latency["serial"], summary_latency["step"]
    ratios = {
        "short_p50_serial_over_step": ser["short_p50_s"] / stp["short_p50_s"],
        "short_p95_serial_over_step": ser["short_p95_s"] / stp["short_p95_s"],
        "throughput_step_over_serial": stp["steps_per_s"] / ser["steps_per_s"],
        "cpu_throughput_step_over_serial": stp["steps_per_cpu_s"] / ser["steps_per_cpu_s"],
        "long_latency_step_over_serial": stp["long_latency_s"] / ser["long_latency_s"],
    }
    targets = {
        "short_p95_serial_over_step >= 5": ratios["short_p95_serial_over_step"] >= 5,
        "throughput_step_over_serial >= 0.95": ratios["throughput_step_over_serial"] >= 0.95,
    }
    for v in variants[2:]:
        rol = summary_latency[v]
        ratios.update({
            f"short_p50_serial_over_{v}": ser["short_p50_s"] / rol["short_p50_s"],
            f"short_p95_serial_over_{v}": ser["short_p95_s"] / rol["short_p95_s"],
            f"short_p95_step_over_{v}": stp["short_p95_s"] / rol["short_p95_s"],
            f"throughput_{v}_over_serial": rol["steps_per_s"] / ser["steps_per_s"],
            f"long_latency_{v}_over_serial": rol["long_latency_s"] / ser["long_latency_s"],
        })
        if v.startswith("roles"):
            targets[f"short_p95_serial_over_{v} >= 3"] = ratios[f"short_p95_serial_over_{v}"] >= 3
            targets[f"throughput_{v}_over_serial >= 0.95"] = ratios[f"throughput_{v}_over_serial"] >= 0.95

    img: dict[str, list[dict[str, Any]]] = {"sequential": [], "step_batched": [], "step_unbatched": []}
    variants = [("sequential", "serial", 1), ("step_batched", "step", args.images), ("step_unbatched", "step", 1)]
    if not args.skip_images:
        for rep in range(args.repeats):
            for name, sched, mb in (variants if rep % 2 == 0 else variants[::-1]):
                img[name].append(await image_run(rt, sched, mb, args, rep))
            print(f"  rep {rep} images: " + ", ".join(f"{k} {v[-1]['images_per_s']:.2f}/s" for k, v in img.items()), flush=True)
    img_summary = {k: {"images_per_s": med(v, "images_per_s"), "makespan_s": med(v, "makespan_s"),
                       "batched_forwards": v[0]["batched_forwards"]} for k, v in img.items() if v}
    if img_summary:
        ratios["images_batched_over_sequential"] = img_summary["step_batched"]["images_per_s"] / img_summary["sequential"]["images_per_s"]
        ratios["images_batched_over_unbatched"] = img_summary["step_batched"]["images_per_s"] / img_summary["step_unbatched"]["images_per_s"]
    return {
        "long_solo_s": long_solo, "arrival_gap_s": gap,
        "latency": {"median": summary_latency, "runs": runs},
        "images": {"median": img_summary, "runs": img},
        "ratios": ratios,
        "targets": targets,
    }


async def latency_warm(rt: Runtime, args: argparse.Namespace, scheds: tuple[str, ...] = ("serial", "step"),
                       images: bool = True) -> None:
    for sched in scheds:
        eng = AsyncEngine(rt, sched, max_batch=args.max_batch)
        await eng.start()
        hs = [eng.submit(video_req(args, 3, i)) for i in range(2)]
        if images and not args.skip_images:
            hs.append(eng.submit(image_req(args, 0)))
        await asyncio.gather(*(h.result(timeout=3600) for h in hs))
        await eng.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="toy", help="'toy' (built on the fly), a preset (wan-demo) or a checkpoint path")
    p.add_argument("--size", default="64x64", help="WxH of the video requests ('' for the family default)")
    p.add_argument("--frames", type=int, default=9, help="frames of the video requests (0: family default)")
    p.add_argument("--long-steps", type=int, default=200)
    p.add_argument("--short-steps", type=int, default=4)
    p.add_argument("--shorts", type=int, default=12)
    p.add_argument("--arrival-span", type=float, default=0.6, help="shorts arrive over this fraction of the long's solo time")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--image-size", default="64x64")
    p.add_argument("--image-steps", type=int, default=20)
    p.add_argument("--skip-images", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise)")
    p.add_argument("--roles", default="", help="components to place in a CPU role worker (e.g. 'vae'): adds the "
                                              "role-pool variant (omniloop-parallel)")
    p.add_argument("--role-order", choices=("round_robin", "fewest"), default="round_robin",
                   help="the role-pool variant's step order (fewest: scheduler_options order fewest_steps_left)")
    p.add_argument("--extra-variants", default="", help="more in-process variants, e.g. 'step:fewest'")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    args.extra_variants = [v.strip() for v in args.extra_variants.split(",") if v.strip()]
    args.role_variant = "roles:fewest" if args.role_order == "fewest" else "roles"
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        rt = make_runtime(args.model, Path(tmp), args.long_steps)
        global IMAGE_TASK
        if "t2i" not in {t.value for t in rt.tasks}:
            IMAGE_TASK = "t2v"  # one-frame t2v requests are the image-sized ones
        if args.frames == 0:
            args.frames = None
        role_rt = None
        if args.roles:
            role_rt = make_role_runtime(args.model, [c.strip() for c in args.roles.split(",") if c.strip()],
                                        args.long_steps, args.threads)
        try:
            result = asyncio.run(bench(rt, args, role_rt))
        finally:
            if role_rt is not None:
                role_rt.close()

    r = result["ratios"]
    print(f"short p50 serial/step {r['short_p50_serial_over_step']:.2f}x, p95 {r['short_p95_serial_over_step']:.2f}x "
          f"(target >= 5); throughput step/serial {r['throughput_step_over_serial']:.3f} (target >= 0.95), "
          f"per CPU-second {r['cpu_throughput_step_over_serial']:.3f}")
    for v in [*args.extra_variants, *([args.role_variant] if args.roles else [])]:
        print(f"{v}: short p50 serial/{v} {r[f'short_p50_serial_over_{v}']:.2f}x, p95 {r[f'short_p95_serial_over_{v}']:.2f}x "
              f"(roles target >= 3); throughput {v}/serial {r[f'throughput_{v}_over_serial']:.3f} (target >= 0.95)")
    if "images_batched_over_sequential" in r:
        print(f"images: batched/sequential {r['images_batched_over_sequential']:.2f}x, "
              f"batched/unbatched-interleaved {r['images_batched_over_unbatched']:.2f}x")
    if not args.no_write:
        name = "scheduler_latency" if args.model == "toy" else f"scheduler_latency-{Path(args.model).name}"
        name += f"-{args.tag}" if args.tag else ""
        machine = common.cpu_machine(args.threads, load_average=os.getloadavg() if hasattr(os, "getloadavg") else None)
        path = common.write_dated_record(
            args.out_dir, name, "scheduler_latency",
            "step scheduler vs serial FIFO: short-request latency behind a long request, throughput; "
            "image batching; medians over interleaved repeats, ratios",
            machine, result, config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        )
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
