"""bench/merge_runs.py: side-runner records made one side per process (an H100 holds one FP8 copy of FLUX.1-dev
beside diffusers' model) merged into one, each ratio the one its own process measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .conftest import bench_helper


def record(side: str, s: float, anchor: float, skipped: str | None = None) -> dict[str, Any]:
    sides: dict[str, Any] = {"diffusers": {"s_per_step": anchor}}
    summary: dict[str, Any] = {"diffusers": {"s_per_step": anchor, "step_speedup_vs_diffusers": 1.0}}
    if skipped:
        sides[side] = {"skipped": skipped}
    else:
        sides[side] = {"s_per_step": s}
        summary[side] = {"s_per_step": s, "step_speedup_vs_diffusers": round(anchor / s, 3)}
    return {"bench": "flux_gpu", "date": "2026-12-07", "machine": {"gpu": "H100"}, "config": {}, "matmul_limit": {},
            "sides": sides, "summary": summary}


def write(tmp: Path, name: str, rec: dict[str, Any]) -> Path:
    (tmp / name).mkdir(parents=True, exist_ok=True)
    path = tmp / name / "flux_gpu.json"
    path.write_text(json.dumps(rec))
    return path


def test_each_side_keeps_its_own_anchor_and_ratio(tmp_path):
    mr = bench_helper("merge_runs")
    runs = [write(tmp_path, "p1", record("a", 0.10, 0.18)), write(tmp_path, "p2", record("b", 0.12, 0.19)),
            write(tmp_path, "p3", record("c", 0, 0.18, skipped="RuntimeError: no room for another copy"))]
    out = tmp_path / "merged.json"
    assert mr.main([str(out), *map(str, runs)]) == 0
    merged = json.loads(out.read_text())
    assert merged["summary"]["a"] == {"s_per_step": 0.10, "step_speedup_vs_diffusers": 1.8, "anchor_s_per_step": 0.18,
                                      "run": "p1/flux_gpu.json"}
    assert merged["summary"]["b"]["anchor_s_per_step"] == 0.19 and merged["summary"]["b"]["run"] == "p2/flux_gpu.json"
    assert merged["anchors_s_per_step"] == {"p1/flux_gpu.json": 0.18, "p2/flux_gpu.json": 0.19, "p3/flux_gpu.json": 0.18}
    assert list(merged["skipped"]) == ["c"] and "no room" in merged["skipped"]["c"]
    assert set(merged["runs"]) == {"p1/flux_gpu.json", "p2/flux_gpu.json", "p3/flux_gpu.json"}


@pytest.mark.parametrize("second, message", [
    ({**record("a", 0.11, 0.18)}, "side 'a' is in p1/flux_gpu.json and p2/flux_gpu.json"),
    ({**record("b", 0.11, 0.18), "bench": "sd3_gpu"}, "records of different benches"),
    ({"bench": "flux_gpu", "summary": {"b": {"s_per_step": 0.1}}, "sides": {}}, "has no 'diffusers' side"),
])
def test_records_that_do_not_merge_are_refused_with_nothing_written(tmp_path, capsys, second, message):
    mr = bench_helper("merge_runs")
    runs = [write(tmp_path, "p1", record("a", 0.10, 0.18)), write(tmp_path, "p2", second)]
    out = tmp_path / "merged.json"
    assert mr.main([str(out), *map(str, runs)]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_flux_gpu_names_its_file_after_the_device():
    """bench/flux_gpu.py's default file-name tag is the device's model, not a fixed ``h200`` (an H100's records were
    named h200 before)."""
    flux_gpu = bench_helper("flux_gpu")
    assert [flux_gpu.device_tag(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", None)] \
        == ["h100", "h200", "a100", "cpu"]
