"""Start-up cost of the CLI and of a demo run (issue 42, finding 6): where the seconds before the
first step go.

Each variant runs in a fresh interpreter (``python -X importtime``), interleaved and repeated:

* ``help``: ``omniloop --help`` (plugin discovery included: the command list names plugin commands);
* ``error``: ``omniloop generate x --model wan-demo --steps -1`` (a refused request: nothing loads);
* ``demo``: ``Runtime.from_model("wan-demo")`` and one 1-step request, with the phases timed in-process
  (import of omniloop, model load, the request).

For each: wall seconds, the interpreter's total import seconds (sum of -X importtime self times) and
the cumulative import seconds of the heavy packages (torch, diffusers, transformers, starlette, av,
PIL, rich). Medians over the repeats. The machine's load average is recorded: on a shared machine
absolute numbers are upper bounds; the *shares* (which package the seconds go to) are the finding.

    python bench/fast_start.py --repeats 3        # -> bench/results/fast_start-<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, machine, write_record

HEAVY = ("torch", "diffusers", "transformers", "starlette", "uvicorn", "av", "PIL", "rich", "numpy", "omniloop")
DEMO = """
import json, time
t0 = time.perf_counter()
from omniloop import Runtime
t1 = time.perf_counter()
rt = Runtime.from_model("wan-demo")
t2 = time.perf_counter()
out = rt.generate({"task": "t2v", "prompt": "a red circle moving up", "diffusion": {"steps": 1, "seed": 0}})
t3 = time.perf_counter()
print("PHASES", json.dumps({"import_omniloop": t1 - t0, "load": t2 - t1, "request": t3 - t2, "ok": out.ok}))
"""
VARIANTS = {
    "help": [sys.executable, "-X", "importtime", "-m", "omniloop_cli", "--help"],
    "error": [sys.executable, "-X", "importtime", "-m", "omniloop_cli", "generate", "x", "--model", "wan-demo", "--steps", "-1"],
    "demo": [sys.executable, "-X", "importtime", "-c", DEMO],
}


def parse_importtime(stderr: str) -> dict[str, float]:
    total = 0.0
    heavy: dict[str, float] = {}
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cum_us, name = (p.strip() for p in line[len("import time:"):].split("|"))
        total += int(self_us) / 1e6
        if name in HEAVY:
            heavy[name] = max(heavy.get(name, 0.0), int(cum_us) / 1e6)
    return {"import_total": total, **{f"import_{k}": v for k, v in heavy.items()}}


def run_once(name: str) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    res = subprocess.run(VARIANTS[name], capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - t0
    out = {"wall": wall, **parse_importtime(res.stderr)}
    for line in res.stdout.splitlines():
        if line.startswith("PHASES "):
            out.update({k: float(v) for k, v in json.loads(line[7:]).items()})
    out["exit_code"] = float(res.returncode)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="help,error,demo")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        for n in names:  # interleaved
            runs[n].append(run_once(n))
    medians = {n: {k: round(statistics.median(r[k] for r in rs if k in r), 3) for k in rs[0]} for n, rs in runs.items()}
    record = {
        "bench": "fast_start", "date": time.strftime("%Y-%m-%d"), "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
        "machine": machine(loadavg_before=load_before, loadavg_after=os.getloadavg()),
        "medians": medians, "runs": runs,
    }
    path = write_record(record, args.out)
    print(json.dumps(medians, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
