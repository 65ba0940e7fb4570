"""Prompt adherence of the wan-demo checkpoint vs denoising steps (color and motion direction).

    python bench/adherence.py                         # runtime on CPU, 50/20/8/4 steps, 24 prompts x seeds 0,1
    python bench/adherence.py --backend diffusers --device cuda --prompts full --seeds 0,1,2,3
    python bench/adherence.py --smoke                 # 2 prompts, 2 steps: checks the script

Writes ``bench/results/adherence-<model>-<backend>-<device>-<date>.json`` (per-clip tables
included) unless ``--no-write``. Same machinery as ``omniloop eval adherence``
(``omniloop_wan_demo.evaluate``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    from omniloop_wan_demo.evaluate import default_prompts, evaluate, full_prompts, make_generator

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan-demo")
    ap.add_argument("--steps", default="50,20,8,4")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--prompts", default="default", choices=["default", "full"])
    ap.add_argument("--backend", default="runtime", choices=["auto", "runtime", "diffusers"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=os.environ.get("RESULTS_DIR", str(HERE / "results")))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)

    steps = [int(s) for s in a.steps.split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    prompts = default_prompts() if a.prompts == "default" else full_prompts()
    if a.smoke:
        steps, seeds, prompts = [2], [0], prompts[:2]
    gen, backend, note = make_generator(a.backend, model=a.model, device=a.device)
    reports = []
    for n in steps:
        rep = evaluate(gen, prompts=prompts, seeds=seeds, steps=n, guidance_scale=a.guidance, backend=backend)
        print(json.dumps({"steps": n, "n": rep.n, "accuracy": rep.accuracy, "seconds": round(rep.seconds, 1)}), flush=True)
        reports.append(rep.to_dict())
    result = {
        "model": a.model, "backend": backend, "note": note, "device": a.device, "guidance_scale": a.guidance,
        "prompt_set": a.prompts, "seeds": seeds, "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "date": dt.date.today().isoformat(), "host": platform.node(), "cpus": os.cpu_count(),
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "summary": [{"steps": r["steps"], "n": r["n"], **r["accuracy"], "seconds": round(r["seconds"], 1)} for r in reports],
        "reports": reports,
    }
    if not a.no_write and not a.smoke:
        out = Path(a.out) / f"adherence-{Path(a.model).name}-{backend}-{a.device}-{result['date']}.json"
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
