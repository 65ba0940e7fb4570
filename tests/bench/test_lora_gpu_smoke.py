"""bench/lora_gpu.py runs end to end on a tiny transformer (``--smoke``, CPU): the script does not rot.
No timing is asserted (performance lives in bench/); only that every configuration ran and the
record is complete — and that switching adapters under compile made no new graph."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniloop.testing.scripts import load_script, run_script

BENCH = Path(__file__).resolve().parents[2] / "bench" / "lora_gpu.py"


@pytest.mark.skipif(not BENCH.exists(), reason="bench/lora_gpu.py not in this checkout")
def test_lora_gpu_smoke(tmp_path):
    mod = load_script(BENCH)
    rec = run_script(mod, ["--smoke", "--repeats", "2", "--forwards", "1", "--rank", "4", "--compile"], tmp_path,
                     "lora_gpu-*-smoke.json")
    assert rec["command"].startswith("python bench/lora_gpu.py --smoke")
    res = rec["results"]
    assert set(res["s_per_forward_median"]) == {"base", "hooked-idle", "unfused", "unfused-x2", "fused",
                                                "base-compile", "unfused-compile"}
    assert all(v > 0 for v in res["s_per_forward_median"].values())
    assert res["adapter"]["modules"] == 2 * len(mod.TARGETS)
    assert res["compile"]["graphs_before_switches"] == res["compile"]["graphs_after_switches"]
    assert res["switch"]["fused_unfuse_then_fuse_s_median"] > 0
    assert res["numerics"]["hooked_idle_equals_base"] and res["numerics"]["fused_vs_unfused_rel_rms"] < 1e-4
