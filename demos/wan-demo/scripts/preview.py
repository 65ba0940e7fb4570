"""Make ``families/wan-demo/docs/preview.png`` from the installed checkpoints, on the CPU, through
the omniloop runtime (what a user gets from ``omniloop generate``):

    OMP_NUM_THREADS=2 python demos/wan-demo/scripts/preview.py [--out families/wan-demo/docs/preview.png]

Eight prompts (every 13th of ``full_prompts()``: each shape and each direction twice, every colour),
seed 0, one row per prompt, frames 0/4/8/12/16 of the clip; left block ``wan-demo`` (v2, its
defaults: 20 stochastic flow-Euler steps, guidance 2, shift 5), right block ``wan-demo-fast`` (4
few-step steps, guidance 1). The layout of the GPU training run's ``preview.png`` (``training/v2.py`` eval phase), whose
prompts all move left.
Prints the prompts and the detector's verdict per clip. ``--models wan-demo-causal --out
families/wan-demo/docs/preview-causal.png`` makes the causal variant's (one block, its streamed rollout).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

FRAMES = (0, 4, 8, 12, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[3] / "families" / "wan-demo" / "docs" / "preview.png")
    ap.add_argument("--models", default="wan-demo,wan-demo-fast", help="comma list of presets, one block each")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    from PIL import Image

    from omniloop import Runtime
    from omniloop_wan_demo.evaluate import detect, full_prompts
    from omniloop_wan_demo.prompts import parse_prompt

    prompts = full_prompts()[::13][:8]
    blocks, verdicts = [], {}
    for model in [m.strip() for m in a.models.split(",") if m.strip()]:
        rt = Runtime.from_model(model, device="cpu", dtype="float32")
        rows, verdicts[model] = [], []
        for p in prompts:
            t0 = time.perf_counter()
            out = rt.generate({"task": "t2v", "prompt": p, "diffusion": {"seed": a.seed}})
            frames = np.asarray(out.artifacts["video"].frames)
            rows.append(np.concatenate([frames[i] for i in FRAMES], axis=1))
            d = detect(frames)
            verdicts[model].append({"prompt": p, "expected": "/".join(parse_prompt(p)),
                                    "detected": f"{d.color}/{d.shape}/{d.direction}",
                                    "seconds": round(time.perf_counter() - t0, 2)})
        blocks.append(np.concatenate(rows, axis=0))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.concatenate(blocks, axis=1)).save(a.out)
    print(json.dumps({"out": str(a.out), "seed": a.seed, "frames": FRAMES, "clips": verdicts}, indent=1, default=str))


if __name__ == "__main__":
    main()
