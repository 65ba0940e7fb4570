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


@pytest.mark.skipif(not BENCH.exists(), reason="bench/wan_gpu.py not in this checkout")
def test_inductor_side_words_merge_into_one_setting():
    """-mk / -cd set the deploy's options.compile_inductor (several words: one merged mapping); unknown words refused."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("wan_gpu_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH.parent))
    assert mod.parse_config("omniloop-fp8-compile-fused-fp8fast")["inductor"] is None
    assert mod.parse_config("omniloop-fp8-compile-fused-fp8fast-mk")["inductor"] == {"triton.multi_kernel": 1}
    both = mod.parse_config("omniloop-fp8-compile-fused-fp8fast-gq-mk-cd")
    assert both["gq"] and both["inductor"] == {"triton.multi_kernel": 1, "coordinate_descent_tuning": True}
    # the FFN kernel follows the runtime's default (on); -nogq turns it off for a paired comparison
    assert mod.parse_config("omniloop-fp8-compile-fused-fp8fast")["gq"] is True
    assert mod.parse_config("omniloop-fp8-compile-fused-fp8fast-nogq")["gq"] is False
    # every word's settings are real settings of this torch's inductor (the deploy check accepts them)
    from omniloop.deploy import DeployConfig
    from omniloop_kit.compile import compile_options

    assert compile_options({"deploy": DeployConfig(compile=True), "compile_inductor": both["inductor"]})["options"]
    with pytest.raises(SystemExit, match="unknown configuration"):
        mod.parse_config("omniloop-fp8-compile-xx")
