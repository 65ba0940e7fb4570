"""CPU seconds per tone-demo clip: the tone-demo architecture (omniloop_tone_demo_training.build,
random weights: timing does not depend on training) sampled on the CPU through diffusers'
``StableAudioPipeline`` and through omniloop's ``stable-audio`` family, one clip at a time.

    python bench/tone_demo_cpu_time.py --clips 4 --steps 100 --threads 2

Writes ``bench/results/tone-demo-cpu-time-<date>.json`` (or ``--json``) with the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clips", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--guidance", type=float, default=7.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from diffusers import StableAudioPipeline

    from omniloop.runtime import Runtime
    from omniloop_tone_demo.grammar import eval_specs
    from omniloop_tone_demo_training.build import assemble, build_parts, param_count, save

    parts = build_parts()
    params = {k: param_count(v) for k, v in parts.items() if isinstance(v, torch.nn.Module)}
    prompts = [s.prompt for s in eval_specs(a.clips)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = save(assemble(parts), Path(tmp) / "checkpoint",
                      {"variant": "tone-demo", "defaults": {"steps": a.steps, "guidance_scale": a.guidance}})
        pipe = StableAudioPipeline.from_pretrained(str(folder))
        pipe.set_progress_bar_config(disable=True)
        rt = Runtime.from_model(folder)
        sides: dict[str, list[float]] = {"diffusers": [], "omniloop": []}
        for i, p in enumerate(prompts):
            t0 = time.perf_counter()
            pipe(p, num_inference_steps=a.steps, guidance_scale=a.guidance, generator=torch.Generator().manual_seed(i))
            sides["diffusers"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = rt.generate({"task": "t2a", "prompt": p, "diffusion": {"seed": i, "steps": a.steps,
                                                                         "guidance_scale": a.guidance}})
            sides["omniloop"].append(time.perf_counter() - t0)
            assert out.artifacts["audio"].samples.shape[-1] == 16384
    rec = {
        "what": "CPU wall seconds per tone-demo clip (2.048 s of 8 kHz mono), one clip per call, random weights of "
                "the tone-demo architecture",
        "command": "python " + " ".join(shlex.quote(x) for x in sys.argv),
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "loadavg_at_end": os.getloadavg(), "torch": torch.__version__,
        "threads": a.threads, "steps": a.steps, "guidance": a.guidance, "clips": a.clips, "params": params,
        "seconds_per_clip": {k: {"median": round(statistics.median(v), 3), "all": [round(x, 3) for x in v]}
                             for k, v in sides.items()},
    }
    out_path = Path(a.json or Path(__file__).parent / "results" / f"tone-demo-cpu-time-{rec['date']}.json")
    out_path.write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec["seconds_per_clip"], indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
