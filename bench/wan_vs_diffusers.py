"""omniloop's Wan family against diffusers' ``WanPipeline``, side by side in one process (GPU).

Wan2.1 T2V 1.3B architecture with random weights (timing does not depend on the values): the
1.3B transformer, the real VAE config, a UMT5-XXL-sized text encoder, UniPC with flow shift 3.
Both sides share the very same modules. 480x832, 81 frames, CFG 5.0, bf16 (VAE float32).

Runs are interleaved (diffusers, omniloop, diffusers, ...) after a warm-up of each; every time is
taken with ``torch.cuda.synchronize()`` on both ends. Reported per side:

* ``s_per_step``: median seconds of one denoise step (two transformer forwards + CFG + solver),
  steps 1..N-1 of every run (step 0 also holds the loop's set-up);
* ``s_end_to_end``: median seconds from prompt to frames (text encode, denoise, VAE decode): for
  diffusers up to its ``output_type="np"`` float frames, for omniloop up to its uint8 ``video``;

and the ratios omniloop / diffusers (target: <= 1.00). Also checks that both produce the same
frames (same seed, same CPU-generator noise).

    python bench/wan_vs_diffusers.py [--steps 10] [--repeats 3]    # writes bench/results/wan_vs_diffusers-<date>.json
    python bench/wan_vs_diffusers.py --smoke --no-write              # toy sizes on a CPU: checks the script
"""

from __future__ import annotations

import datetime as dt
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


class DiffusersSide:
    name = "diffusers"

    def __init__(self, comps: dict[str, Any]) -> None:
        self.comps = comps

    def run(self, steps: int, seed: int, size: tuple[int, int, int]) -> common.TimedRun:
        return common.run_diffusers(common.wan_pipeline(self.comps), steps, seed, size)


class OmniloopSide:
    name = "omniloop"

    def __init__(self, comps: dict[str, Any], device: torch.device, dtype: torch.dtype) -> None:
        from omniloop.execution import BuiltPipeline
        from omniloop.request import TaskType
        from omniloop_wan.family import WanFamily

        fam = WanFamily()
        self.model = fam.from_components(comps, device=device, dtype=dtype)
        spec = fam.build_pipeline(self.model, TaskType.T2V, {})
        self.built = BuiltPipeline(spec=spec, components=comps, device=device, dtype=dtype)

    def run(self, steps: int, seed: int, size: tuple[int, int, int]) -> common.TimedRun:
        return common.run_omniloop_video(self.built, steps, seed, size)[0]


def main(argv: list[str] | None = None) -> int:
    ap = common.video_parser(__doc__, steps=10, repeats=3, frames=81, height=480, width=832)
    common.add_output_args(ap, HERE / "results")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    size = (args.frames, args.height, args.width)
    t_build = time.perf_counter()
    if args.smoke:
        size = (9, 32, 32)
    comps = common.build_components(device, dtype, smoke=args.smoke)
    print(f"built components in {time.perf_counter() - t_build:.1f} s", flush=True)
    sides = [DiffusersSide(comps), OmniloopSide(comps, device, dtype)]

    totals, steps, frames = common.run_interleaved(sides, args.steps, args.repeats, size)

    result: dict[str, Any] = {}
    for name in totals:
        result[name] = {
            "s_per_step": round(statistics.median(steps[name]), 4),
            "s_per_step_min": round(min(steps[name]), 4),
            "s_end_to_end": round(statistics.median(totals[name]), 3),
            "runs": len(totals[name]),
        }
    ratio_step = result["omniloop"]["s_per_step"] / result["diffusers"]["s_per_step"]
    ratio_e2e = result["omniloop"]["s_end_to_end"] / result["diffusers"]["s_end_to_end"]
    same = torch.equal(frames["omniloop"], frames["diffusers"])
    record = {
        "bench": "wan_vs_diffusers",
        "command": common.command_line(sys.argv[0], argv if argv is not None else sys.argv[1:]),
        "date": dt.date.today().isoformat(),
        "machine": common.machine(torch_threads=torch.get_num_threads()),
        "setup": {"model": "Wan2.1 T2V 1.3B architecture, random weights", "text_encoder": "UMT5-XXL size, random",
                  "dtype": "bfloat16 (VAE float32)", "frames": size[0], "height": size[1], "width": size[2],
                  "steps": args.steps, "guidance_scale": 5.0, "scheduler": "UniPC flow shift 3", "repeats": args.repeats},
        "results": result,
        "ratio_s_per_step": round(ratio_step, 4),
        "ratio_end_to_end": round(ratio_e2e, 4),
        "frames_equal": same,
    }
    record["machine"].update(common.library_versions())
    return common.publish(record, args)


if __name__ == "__main__":
    sys.exit(main())
