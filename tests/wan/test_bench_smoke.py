"""bench/wan_gpu.py runs end to end on tiny configs (``--smoke``, CPU): the script does not rot."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniloop.testing.scripts import run_script

BENCH = Path(__file__).resolve().parents[2] / "bench" / "wan_gpu.py"


@pytest.mark.skipif(not BENCH.exists(), reason="bench/wan_gpu.py not in this checkout")
def test_wan_gpu_smoke(tmp_path):
    only = "omniloop-sdpa-compile-batched,diffusers,omniloop-sdpa,omniloop-cudnn,omniloop-sdpa-qkv-fp8fast"
    rec = run_script(BENCH, ["--smoke", "--only", only], tmp_path, "wan_gpu-*-smoke.json")
    assert rec["command"].startswith("python bench/wan_gpu.py --smoke")
    rows = {(r["model"], r["config"]): r for r in rec["results"]}
    assert [c for m, c in rows if m == "1.3b"] == ["diffusers", "omniloop-sdpa-compile-batched", "omniloop-sdpa",
                                                  "omniloop-cudnn", "omniloop-sdpa-qkv-fp8fast"]
    for model in ("1.3b", "14b"):
        assert "error" not in rows[(model, "omniloop-sdpa")], rows[(model, "omniloop-sdpa")]
        assert rows[(model, "omniloop-sdpa")]["s_per_step"] > 0
        assert "skipped" in rows[(model, "omniloop-cudnn")] or "s_per_step" in rows[(model, "omniloop-cudnn")]
    # the default backend runs diffusers' kernels: bit-identical to diffusers eager
    assert rows[("1.3b", "omniloop-sdpa")]["vs_diffusers_eager"]["latents_bit_equal"]
    assert rows[("14b", "omniloop-sdpa")]["vs_diffusers_eager"]["bit_equal"]
    assert rows[("1.3b", "omniloop-sdpa-compile-batched")]["omniloop_metrics"]["denoise"]["compile"]["enabled"]
    # -qkv (options.qkv: fused) and -fp8fast (linear_precision: fp8-fast) run on both sides of the script
    for model in ("1.3b", "14b"):
        row = rows[(model, "omniloop-sdpa-qkv-fp8fast")]
        assert "error" not in row, row
        assert row["qkv"] and row["fp8fast"] and row["fp8lin"] and row["fp8_linears"]["fast_accum"]
