"""Merge side-runner records (``flux_gpu.py``, ``sd3_gpu.py``) made one side per process into one record.

An H100 holds diffusers' FLUX.1-dev and one FP8 copy, not two: the side runner skips a side with "no room for
another copy ... run this side in a process of its own". ``gpu_fa3.sh``'s ``ISOLATE=1`` then runs each side of
``CF`` in its own process beside its own diffusers-eager anchor and merges the records here::

    python3 bench/merge_runs.py OUT.json RUN1.json RUN2.json ...

Each side's ratio stays the one its own process measured against its own anchor (``anchor_s_per_step`` beside
it); nothing is recomputed across processes. A side measured in more than one run, a run without the anchor, or
a side that a run skipped is kept as it came and listed under ``skipped``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ANCHOR = "diffusers"


def merge(records: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One record from ``records`` (their file names in ``names``): ``summary`` side -> that side's summary
    from the run that measured it, with ``anchor_s_per_step`` and ``run``; ``runs`` the records as they came."""
    if not records:
        raise ValueError("merge_runs: no records given")
    benches = {r.get("bench") for r in records}
    if len(benches) != 1:
        raise ValueError(f"merge_runs: records of different benches: {sorted(map(str, benches))}")
    summary: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name, rec in zip(names, records, strict=True):
        runs = rec.get("summary") or {}
        anchor = runs.get(ANCHOR)
        if anchor is None:
            raise ValueError(f"merge_runs: {name} has no {ANCHOR!r} side to anchor its ratios")
        for side, result in (rec.get("sides") or {}).items():
            if "skipped" in result:
                skipped.setdefault(side, f"{name}: {result['skipped']}")
        for side, row in runs.items():
            if side == ANCHOR:
                continue
            if side in summary:
                raise ValueError(f"merge_runs: side {side!r} is in {summary[side]['run']} and {name}; "
                                 "give each side one run")
            summary[side] = {**row, "anchor_s_per_step": anchor["s_per_step"], "run": name}
    for side in summary:
        skipped.pop(side, None)
    first = records[0]
    return {"bench": first.get("bench"), "date": first.get("date"), "machine": first.get("machine"),
            "config": first.get("config"), "matmul_limit": first.get("matmul_limit"),
            "how": f"each side in its own process beside its own {ANCHOR!r} anchor (bench/merge_runs.py); a ratio "
                   "is the one its process measured",
            "anchors_s_per_step": {n: r["summary"][ANCHOR]["s_per_step"] for n, r in zip(names, records, strict=True)},
            "summary": summary, "skipped": skipped, "runs": dict(zip(names, records, strict=True))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="the merged record (JSON)")
    ap.add_argument("runs", type=Path, nargs="+", help="side-runner records, one side (and the anchor) each")
    args = ap.parse_args(argv)
    try:
        records = [json.loads(p.read_text()) for p in args.runs]
        merged = merge(records, [p.name if p.parent.name in ("", ".") else f"{p.parent.name}/{p.name}"
                                 for p in args.runs])
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        print(f"merge_runs: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged, indent=1))
    print(json.dumps({"wrote": str(args.out), "summary": {s: {k: r.get(k) for k in
          ("s_per_step", "anchor_s_per_step", "step_speedup_vs_diffusers")} for s, r in merged["summary"].items()},
          "skipped": sorted(merged["skipped"])}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
