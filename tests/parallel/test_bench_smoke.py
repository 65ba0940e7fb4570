"""bench/parallel_gpu.py runs end to end on a tiny transformer (``--smoke``: 2 CPU processes over gloo).
No timing is asserted (the GPU numbers live in bench/results once measured); only that every mode
ran on both ranks and the record is complete — and that cfg and sp predictions match single's."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniloop.testing.scripts import run_script

BENCH = Path(__file__).resolve().parents[2] / "bench" / "parallel_gpu.py"


@pytest.mark.skipif(not BENCH.exists(), reason="bench/parallel_gpu.py not in this checkout")
def test_parallel_gpu_smoke(tmp_path):
    rec = run_script(BENCH, ["--smoke", "--repeats", "2", "--warmup", "1"], tmp_path, "parallel_gpu-*-smoke.json")
    assert rec["command"].startswith("python bench/parallel_gpu.py --smoke")
    res = rec["results"]["smoke"]
    assert set(res["s_per_step_median"]) == {"single", "cfg", "sp", "sp-g1"}  # sp-g1: one head group (5f5d779)
    assert all(v > 0 for v in res["s_per_step_median"].values())
    assert set(res["speedup_vs_single"]) >= {"cfg", "sp"}
    assert res["max_abs_diff_vs_single"]["cfg"] == 0.0  # one branch per rank: the same forward
    assert res["max_abs_diff_vs_single"]["sp"] <= 1e-5  # fp32 CPU, see tests/parallel/test_pool.py
