"""omniloop's cache-dit interceptor against cache-dit's own diffusers integration, side by side (GPU).

Wan2.1 T2V 1.3B architecture with random weights (the components of ``wan_vs_diffusers.py``),
four sides sharing the very same modules, interleaved and repeated after a warm-up of each:

* ``diffusers``             — ``WanPipeline``, no cache;
* ``diffusers+cache-dit``   — ``cache_dit.enable_cache(pipe, DBCacheConfig(...))`` (the pipeline
  path, which resets its contexts per call); hooks installed and removed around each run,
  outside the timed region;
* ``omniloop``              — the Wan family, no interceptor;
* ``omniloop+cache-dit``    — the Wan family with ``CacheDiTInterceptor`` bound (same settings).

Reported: median seconds per denoise step and end to end per side; ``ratio_ours_vs_library``
(omniloop+cache-dit / diffusers+cache-dit, end to end and per step; target <= 1.00); each
framework's speedup over its own uncached run; the cached steps each cache side took per branch
(equal decisions are what make the timing comparable); whether the two cached sides produced the
same frames.

On random weights the Fn residual changes a lot between steps (about 0.2 relative L1), so the
default threshold is high enough to make caching happen; speed *and quality* of real settings
need a trained checkpoint.

    python bench/cache_dit_vs_library.py [--steps 12] [--repeats 2] [--frames 33]   # writes bench/results/
    python bench/cache_dit_vs_library.py --smoke --no-write                          # toy sizes on a CPU
"""

from __future__ import annotations

import datetime as dt
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (also when loaded by file path)
from _repo_paths import add_repo_packages

add_repo_packages()

import _common as common  # noqa: E402

HERE = Path(__file__).resolve().parent


def cache_configs(s: dict[str, Any]) -> tuple[Any, Any]:
    import cache_dit

    cfg = cache_dit.DBCacheConfig(
        Fn_compute_blocks=s["Fn"],
        Bn_compute_blocks=s["Bn"],
        residual_diff_threshold=s["residual_diff_threshold"],
        max_warmup_steps=s["max_warmup_steps"],
        max_cached_steps=s["max_cached_steps"],
        max_continuous_cached_steps=s["max_continuous_cached_steps"],
    )
    cal = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=s["taylorseer_order"]) if s["taylorseer"] else None
    return cfg, cal


class Diffusers:
    def __init__(self, comps: dict[str, Any], settings: dict[str, Any] | None) -> None:
        self.comps, self.settings = comps, settings
        self.name = "diffusers" + ("+cache-dit" if settings else "")
        self.cached: dict[str, list[int]] = {}

    def run(self, steps: int, seed: int, size: tuple[int, int, int]) -> common.TimedRun:
        import cache_dit

        pipe = common.wan_pipeline(self.comps)
        if self.settings:
            cfg, cal = cache_configs(self.settings)
            cache_dit.enable_cache(pipe, cache_config=cfg, calibrator_config=cal)
        try:
            run = common.run_diffusers(pipe, steps, seed, size)
            if self.settings:
                mgr = pipe._context_manager
                ctx = next(iter(mgr._cached_context_manager.values()))
                self.cached = {"cond": ctx.get_cached_steps(), "uncond": ctx.get_cfg_cached_steps()}
        finally:
            if self.settings:
                cache_dit.disable_cache(pipe)
        return run


class Omniloop:
    def __init__(
        self, comps: dict[str, Any], device: torch.device, dtype: torch.dtype, settings: dict[str, Any] | None
    ) -> None:
        from omniloop.execution import BuiltPipeline
        from omniloop.request import TaskType
        from omniloop_wan.family import WanFamily

        self.settings = settings
        self.name = "omniloop" + ("+cache-dit" if settings else "")
        self.cached: dict[str, list[int]] = {}
        icpt = None
        if settings:
            from omniloop_cache_dit import CacheDiTInterceptor

            icpt = CacheDiTInterceptor(settings)
        fam = WanFamily()
        model = fam.from_components(comps, device=device, dtype=dtype)
        spec = fam.build_pipeline(model, TaskType.T2V, {})
        self.built = BuiltPipeline(spec=spec, components=comps, device=device, dtype=dtype, block_interceptor=icpt)

    def run(self, steps: int, seed: int, size: tuple[int, int, int]) -> common.TimedRun:
        run, out = common.run_omniloop_video(self.built, steps, seed, size)
        if self.settings:
            stats = out.metrics["plugins"]["cache-dit"]
            self.cached = {b: s["cached_steps"] for b, s in stats.items()}
            self.diffs = {b: s["residual_diffs"] for b, s in stats.items()}
        return run


def main(argv: list[str] | None = None) -> int:
    ap = common.video_parser(__doc__, steps=12, repeats=2, frames=33, height=480, width=832)
    ap.add_argument("--Fn", type=int, default=8)
    ap.add_argument("--Bn", type=int, default=0)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-cached", type=int, default=-1)
    ap.add_argument("--max-continuous", type=int, default=3)
    ap.add_argument("--taylorseer", action="store_true")
    ap.add_argument("--taylorseer-order", type=int, default=1)
    common.add_output_args(ap, HERE / "results")
    args = ap.parse_args(argv)
    logging.getLogger("cache_dit").setLevel(logging.WARNING)

    settings = {
        "Fn": args.Fn,
        "Bn": args.Bn,
        "residual_diff_threshold": args.threshold,
        "max_warmup_steps": args.warmup,
        "max_cached_steps": args.max_cached,
        "max_continuous_cached_steps": args.max_continuous,
        "taylorseer": args.taylorseer,
        "taylorseer_order": args.taylorseer_order,
    }
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    size = (args.frames, args.height, args.width)
    if args.smoke:
        size = (9, 32, 32)
        settings["Fn"], settings["Bn"] = 1, 0  # the smoke transformer has 2 blocks
    t_build = time.perf_counter()
    comps = common.build_components(device, dtype, smoke=args.smoke)
    print(f"built components in {time.perf_counter() - t_build:.1f} s", flush=True)
    sides = [
        Diffusers(comps, None),
        Diffusers(comps, settings),
        Omniloop(comps, device, dtype, None),
        Omniloop(comps, device, dtype, settings),
    ]

    totals, steps, frames = common.run_interleaved(sides, args.steps, args.repeats, size)

    res = {
        name: {
            "s_per_step": round(statistics.median(steps[name]), 4),
            "s_end_to_end": round(statistics.median(totals[name]), 3),
            "runs": len(totals[name]),
        }
        for name in totals
    }
    ours, lib = sides[3], sides[1]
    record = {
        "bench": "cache_dit_vs_library",
        "command": common.command_line(sys.argv[0], argv if argv is not None else sys.argv[1:]),
        "date": dt.date.today().isoformat(),
        "machine": common.machine(),
        "setup": {
            "model": "Wan2.1 T2V 1.3B architecture, random weights" if not args.smoke else "smoke",
            "dtype": "bfloat16 (VAE float32)",
            "frames": size[0],
            "height": size[1],
            "width": size[2],
            "steps": args.steps,
            "repeats": args.repeats,
            "cache": settings,
        },
        "results": res,
        "ratio_ours_vs_library": {
            "end_to_end": round(res[ours.name]["s_end_to_end"] / res[lib.name]["s_end_to_end"], 4),
            "per_step": round(res[ours.name]["s_per_step"] / res[lib.name]["s_per_step"], 4),
        },
        "speedup_over_uncached": {
            "diffusers+cache-dit": round(res["diffusers"]["s_end_to_end"] / res[lib.name]["s_end_to_end"], 3),
            "omniloop+cache-dit": round(res["omniloop"]["s_end_to_end"] / res[ours.name]["s_end_to_end"], 3),
        },
        "cached_steps": {"library": lib.cached, "ours": ours.cached},
        "same_decisions": lib.cached == ours.cached,
        "residual_diffs_ours": getattr(ours, "diffs", {}),
        "frames_equal_cached_sides": torch.equal(frames[ours.name], frames[lib.name]),
        "frames_equal_uncached_sides": torch.equal(frames["omniloop"], frames["diffusers"]),
    }
    return common.publish(record, args)


if __name__ == "__main__":
    sys.exit(main())
