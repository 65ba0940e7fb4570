"""What the standard observers cost in the step loop, and what they cost when not enabled.

Configurations, each a runtime over the core's toy family (4-block transformer, classic CFG):

* ``not-installed``  — an isolated plugin manager (``omniloop.testing.make_manager()``): the
  observer packages do not exist for it;
* ``not-installed-2`` — a second such runtime, to show the run-to-run noise;
* ``installed-not-enabled`` — the default manager with every installed plugin discovered
  (parity, profiler, nanwatch, trace registered) but none enabled in the deploy;
* one configuration per observer enabled alone (and with block taps where it offers them).

Both "not enabled" configurations must bind no observer bus at all (checked and recorded), so
the step loop runs the same code; the measurement shows it. Runs are interleaved round by round
in shuffled order; per configuration the median over rounds of the denoise node's seconds per
step (init, steps, hooks, finalize; everything the loop costs) and of the request's seconds.
Ratios are against ``not-installed``.

    python bench/observer_overhead.py                 # writes bench/results/observer_overhead-<device>.json
    python bench/observer_overhead.py --rounds 10 --no-write
    python bench/observer_overhead.py --device cuda
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from omniloop.plugins import PluginManager
from omniloop.request import TaskType
from omniloop.runtime import Runtime
from omniloop.testing import ToyPlugin, build_toy_checkpoint, make_manager


def _observer_plugins() -> dict[str, Any]:
    from omniloop_nanwatch import plugin as nanwatch
    from omniloop_parity import plugin as parity
    from omniloop_profiler import plugin as profiler
    from omniloop_trace import plugin as trace

    return {"parity": parity, "profiler": profiler, "nanwatch": nanwatch, "trace": trace}


def isolated(*plugins: tuple[str, Any]) -> PluginManager:
    """A manager without discovery: toy family, the same serial scheduler the installed one uses, ``plugins``."""
    try:
        from omniloop_scheduler import plugin as scheduler
    except ImportError:  # no scheduler package: the core's inline serial scheduler
        return make_manager(*plugins)
    return make_manager(("scheduler", scheduler), *plugins, scheduler=False)


def build_configs(ckpt: Path, device: str, tmp: Path) -> dict[str, Runtime]:
    blocks = r"blocks\.\d+$"
    mods = _observer_plugins()
    rts: dict[str, Runtime] = {}
    rts["not-installed"] = Runtime.from_model(ckpt, device=device, manager=isolated())
    rts["not-installed-2"] = Runtime.from_model(ckpt, device=device, manager=isolated())
    discovered = PluginManager()  # entry-point discovery: every installed omniloop plugin
    discovered.add("toy", ToyPlugin())
    reg = discovered.registry()
    missing = [n for n in mods if n not in reg.observers]
    if missing:
        raise SystemExit(f"installed-not-enabled needs the observer packages installed; missing: {missing}")
    rts["installed-not-enabled"] = Runtime.from_model(ckpt, device=device, manager=discovered)
    enabled: dict[str, dict[str, Any]] = {
        "parity": {},
        "parity+blocks": {"blocks": blocks},
        "profiler": {},
        "profiler+blocks": {"blocks": blocks},
        "nanwatch": {},
        "nanwatch+blocks": {"blocks": blocks},
        "trace": {"path": str(tmp / "trace.jsonl")},
        "trace+blocks": {"path": str(tmp / "trace-blocks.jsonl"), "blocks": blocks},
    }
    for label, cfg in enabled.items():
        name = label.split("+")[0]
        rts[label] = Runtime.from_model(ckpt, device=device, manager=isolated((name, mods[name])), plugins={name: cfg})
    return rts


def run_once(rt: Runtime, steps: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = rt.generate({"task": "t2v", "prompt": "a red cube rolling", "diffusion": {"seed": 0, "steps": steps}})
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    assert out.ok, out.error
    return out.metrics["node_seconds"]["denoise"] / steps, total


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default=None, help="result file (default bench/results/observer_overhead-<device>.json)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="omniloop-bench-"))
    ckpt = build_toy_checkpoint(tmp / "toy")
    rts = build_configs(ckpt, args.device, tmp)
    bound = {k: rt.pipeline(TaskType.T2V).bus is not None for k, rt in rts.items()}
    for k in ("not-installed", "not-installed-2", "installed-not-enabled"):
        if bound[k]:
            raise SystemExit(f"{k}: an observer bus is bound although no observer is enabled")
    for rt in rts.values():
        for _ in range(args.warmup):
            run_once(rt, args.steps)
    per_step: dict[str, list[float]] = {k: [] for k in rts}
    per_req: dict[str, list[float]] = {k: [] for k in rts}
    rng = random.Random(0)
    order = list(rts)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for k in order:
            s, r = run_once(rts[k], args.steps)
            per_step[k].append(s)
            per_req[k].append(r)
    base = statistics.median(per_step["not-installed"])
    base_req = statistics.median(per_req["not-installed"])
    rel_mad = statistics.median(abs(x - base) / base for x in per_step["not-installed"])
    rows = {}
    for k in rts:
        med = statistics.median(per_step[k])
        q = statistics.quantiles(per_step[k], n=4)
        rows[k] = {
            "bus_bound": bound[k],
            "eager": rts[k].pipeline(TaskType.T2V).eager,
            "step_median_us": round(med * 1e6, 1),
            "step_iqr_us": [round(q[0] * 1e6, 1), round(q[2] * 1e6, 1)],
            "step_ratio": round(med / base, 4),
            "step_overhead_us": round((med - base) * 1e6, 1),
            "request_median_ms": round(statistics.median(per_req[k]) * 1e3, 3),
            "request_ratio": round(statistics.median(per_req[k]) / base_req, 4),
        }
    noise = abs(rows["not-installed-2"]["step_ratio"] - 1.0)
    band = max(noise, rel_mad)
    verdict = abs(rows["installed-not-enabled"]["step_ratio"] - 1.0) <= max(2 * band, 0.01)
    result = {
        "benchmark": "observer_overhead",
        "command": " ".join(["python", "bench/observer_overhead.py", *map(shlex.quote, argv or sys.argv[1:])]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": args.device,
            "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        },
        "workload": {
            "family": "toy",
            "steps": args.steps,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "branches": 2,
            "blocks": 4,
            "latents": [1, 4, 3, 4, 4],
        },
        "noise": {"baseline_rel_mad": round(rel_mad, 4), "repeat_ratio_delta": round(noise, 4)},
        "not_enabled_within_noise": verdict,
        "configs": rows,
    }
    width = max(map(len, rows))
    print(f"{'config':<{width}}  bus  step µs (median)  ratio   +µs/step  request ms  ratio")
    for k, r in rows.items():
        print(
            f"{k:<{width}}  {'yes' if r['bus_bound'] else 'no ':3}  {r['step_median_us']:>16.1f}  "
            f"{r['step_ratio']:>5.3f}  {r['step_overhead_us']:>8.1f}  {r['request_median_ms']:>10.2f}  "
            f"{r['request_ratio']:>5.3f}"
        )
    print(
        f"noise: baseline relative MAD {rel_mad:.3%}, repeat baseline ratio delta {noise:.3%}; "
        f"installed-not-enabled within noise: {verdict}"
    )
    if not args.no_write:
        out = (
            Path(args.out)
            if args.out
            else Path(__file__).parent / "results" / f"observer_overhead-{args.device.split(':')[0]}.json"
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
