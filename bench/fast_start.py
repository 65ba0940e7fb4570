"""Start-up cost of the CLI and of a demo run (issue 42, finding 6 and "Fast start"): where the
seconds before the first step go.

Each variant runs in a fresh interpreter (``python -X importtime``), interleaved and repeated:

* ``floor_python``: ``python -c pass``; ``floor_torch``: ``import torch`` (the floor of any run);
  ``floor_wan_libs``: what a wan-demo run needs from the libraries, imported the way the Wan family
  does (torch, diffusers' ``AutoencoderKLWan`` / ``WanTransformer3DModel``, transformers'
  ``UMT5EncoderModel``, av for the mp4): the floor of a demo run while the family runs on diffusers;
  ``floor_wan_models``: the same without av (the floor of ``demo``, which writes no file; for a
  machine without PyAV); ``floor_no_diffusers``: torch, transformers' ``UMT5EncoderModel`` and av
  (what a run would import at least if the family owned its Wan modules instead of importing
  diffusers' model packages);
* ``help``: ``omniloop --help`` (plugin discovery included: the command list names plugin commands);
  ``generate_help``: ``omniloop generate --help`` (plugin flags included);
* ``error``: ``omniloop generate x --model wan-demo --steps -1`` (a refused value: nothing loads);
  ``error_image``: ``omniloop generate x --model wan-demo --image <file>`` (a flag the t2v model
  would ignore: refused once the model's default task is known);
* ``demo_cli``: ``omniloop generate "a red circle moving up" --model wan-demo --steps 1 --out <tmp>.mp4``
  (what a newcomer runs);
* ``demo``: ``Runtime.from_model("wan-demo")`` and one 1-step request, with the phases timed in-process
  (import of omniloop, model load, the request).

For each: wall seconds, CPU seconds (user + system of the child: less sensitive to a shared
machine's load than wall time), the interpreter's total import seconds (sum of -X importtime self
times), the import seconds of omniloop's own modules (``omniloop*``, self times), the cumulative
import seconds of the heavy packages (torch, diffusers, transformers, ...; ``import_torch._dynamo``:
what importing ``torch._dynamo`` adds once torch is in, sympy and triton included) and, as
``self_<package>``, the self times summed by top-level package (every module counted once, under its
own package: where the seconds go whoever imported them; ``self_omniloop`` sums every ``omniloop*``
package, ``self_other`` the rest). Medians over the repeats. The machine's load average is recorded: on a shared machine absolute numbers are upper
bounds; compare a variant with the floors measured in the same run (``ratios``).

    python bench/fast_start.py --repeats 3        # -> bench/results/fast_start-<date>.json

The file name takes ``--tag`` (``fast_start-<tag>-<date>.json``) to keep a before/after pair.
``--alt-path DIR`` measures two trees in one interleaved run: a variant named ``NAME@alt`` runs
``NAME`` with ``DIR`` put first on ``PYTHONPATH`` (e.g. a branch's changed packages over main's)::

    python bench/fast_start.py --variants floor_torch,floor_wan_models,demo,demo@alt --alt-path /tmp/branch

The record is rewritten after each repeat, so a run stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, machine, write_record

HEAVY = ("torch", "torch._dynamo", "diffusers", "transformers", "scipy", "peft", "starlette", "uvicorn", "av", "PIL",
         "rich", "numpy", "omniloop")
#: top-level packages whose self times are summed (``self_<name>``); everything else is ``self_other``
PACKAGES = ("torch", "sympy", "triton", "scipy", "peft", "transformers", "diffusers", "accelerate", "av", "PIL",
            "numpy", "rich", "omniloop")
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
WAN_MODELS = ("import torch\nfrom diffusers import AutoencoderKLWan, WanTransformer3DModel\n"
              "from transformers import UMT5EncoderModel\n")
WAN_LIBS = WAN_MODELS + "import av\n"
NO_DIFFUSERS = "import torch\nfrom transformers import UMT5EncoderModel\nimport av\n"
OUT_MP4 = str(Path(tempfile.gettempdir()) / "omniloop-fast-start-demo.mp4")
CLI = [sys.executable, "-X", "importtime", "-m", "omniloop_cli"]
VARIANTS = {
    "floor_python": [sys.executable, "-X", "importtime", "-c", "pass"],
    "floor_torch": [sys.executable, "-X", "importtime", "-c", "import torch"],
    "floor_wan_libs": [sys.executable, "-X", "importtime", "-c", WAN_LIBS],
    "floor_wan_models": [sys.executable, "-X", "importtime", "-c", WAN_MODELS],
    "floor_no_diffusers": [sys.executable, "-X", "importtime", "-c", NO_DIFFUSERS],
    "help": [*CLI, "--help"],
    "generate_help": [*CLI, "generate", "--help"],
    "error": [*CLI, "generate", "x", "--model", "wan-demo", "--steps", "-1"],
    "error_image": [*CLI, "generate", "x", "--model", "wan-demo", "--image", __file__],
    "demo_cli": [*CLI, "generate", "a red circle moving up", "--model", "wan-demo", "--steps", "1", "--seed", "0",
                 "--out", OUT_MP4],
    "demo": [sys.executable, "-X", "importtime", "-c", DEMO],
}
#: variant -> the floor it is compared with in ``ratios``
FLOOR_OF = {"help": "floor_python", "generate_help": "floor_python", "error": "floor_python",
            "error_image": "floor_python", "demo_cli": "floor_wan_libs", "demo": "floor_wan_models"}


def parse_importtime(stderr: str) -> dict[str, float]:
    total = own = 0.0
    heavy: dict[str, float] = {}
    by_package = dict.fromkeys((*PACKAGES, "other"), 0.0)
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cum_us, name = (p.strip() for p in line[len("import time:"):].split("|"))
        total += int(self_us) / 1e6
        top = name.split(".")[0]
        if top.startswith("omniloop"):
            own += int(self_us) / 1e6
        package = "omniloop" if top.startswith("omniloop") else top if top in by_package else "other"
        by_package[package] += int(self_us) / 1e6
        if name in HEAVY:
            heavy[name] = max(heavy.get(name, 0.0), int(cum_us) / 1e6)
    return {"import_total": total, "import_omniloop_own": own, **{f"import_{k}": v for k, v in heavy.items()},
            **{f"self_{k}": v for k, v in by_package.items()}}


def run_once(name: str, alt_path: str | None = None) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base, _, alt = name.partition("@")
    if alt:
        if alt != "alt" or not alt_path:
            raise SystemExit(f"variant {name!r}: only NAME@alt, with --alt-path")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (alt_path, env.get("PYTHONPATH")) if p)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(VARIANTS[base], capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out = {"wall": wall, "cpu": cpu, **parse_importtime(res.stderr)}
    for line in res.stdout.splitlines():
        if line.startswith("PHASES "):
            out.update({k: float(v) for k, v in json.loads(line[7:]).items()})
    out["exit_code"] = float(res.returncode)
    return out


def ratios(medians: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each variant's import seconds over and above its floor's, and as a multiple of it."""
    out = {}
    for name in medians:
        floor = FLOOR_OF.get(name.partition("@")[0])
        if floor in medians:
            v, f = medians[name], medians[floor]
            out[name] = {"floor": floor, "import_over_floor": round(v["import_total"] - f["import_total"], 3),
                         "import_x_floor": round(v["import_total"] / max(f["import_total"], 1e-9), 2),
                         "cpu_over_floor": round(v["cpu"] - f["cpu"], 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--note", default="", help="a free-text note stored in the record (e.g. which tree was measured)")
    ap.add_argument("--tag", default="", help="in the file name: fast_start-<tag>-<date>.json")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--alt-path", default=None, help="put first on PYTHONPATH for the variants named NAME@alt")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n.partition("@")[0] not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)} (NAME@alt with --alt-path)")
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    load_before = os.getloadavg()
    for i in range(args.repeats):
        for n in names:  # interleaved
            runs[n].append(run_once(n, args.alt_path))
        medians = {n: {k: round(statistics.median(r[k] for r in rs if k in r), 3) for k in rs[0]}
                   for n, rs in runs.items()}
        record = {
            "bench": f"fast_start-{args.tag}" if args.tag else "fast_start", "date": time.strftime("%Y-%m-%d"),
            "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
            "machine": machine(loadavg_before=load_before, loadavg_after=os.getloadavg()),
            "repeats_done": i + 1, "medians": medians, "ratios": ratios(medians), "runs": runs,
        }
        if args.alt_path:
            record["alt_path"] = args.alt_path
        if args.note:
            record["note"] = args.note
        path = write_record(record, args.out)  # after each repeat: a run stopped early keeps what it measured
    print(json.dumps({"medians": medians, "ratios": record["ratios"]}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
