"""bench/flux_gpu.py runs end to end on tiny configs (``--smoke``, CPU, eager compile backend):
the script does not rot, and its omniloop sides equal diffusers' bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniloop.testing.scripts import run_script

BENCH = Path(__file__).resolve().parents[2] / "bench" / "flux_gpu.py"


@pytest.mark.slow
@pytest.mark.skipif(not BENCH.exists(), reason="bench/flux_gpu.py not in this checkout")
def test_flux_gpu_smoke(tmp_path):
    argv = ["--smoke", "--device", "cpu", "--steps", "3", "--repeats", "1", "--compile-backend", "eager"]
    rec = run_script(BENCH, argv, tmp_path, "flux_gpu-*-smoke-*.json")
    assert rec["command"].startswith("python bench/flux_gpu.py --smoke")
    assert set(rec["results"]) == {"diffusers", "diffusers-compile", "omniloop", "omniloop-compile"}
    assert all(r["s_per_step"] > 0 for r in rec["results"].values())
    assert all(v["equal"] for v in rec["final_latents"].values()), rec["final_latents"]


@pytest.mark.slow
@pytest.mark.skipif(not BENCH.exists(), reason="bench/flux_gpu.py not in this checkout")
def test_flux_gpu_smoke_modulation_side(tmp_path):
    """``omniloop-mod-…``: ``options.modulation: per-request`` on its own copy of the transformer (its
    owned blocks never replace the shared transformer's: diffusers' side stays diffusers')."""
    argv = ["--smoke", "--device", "cpu", "--steps", "2", "--repeats", "1", "--compile-backend", "eager",
            "--only", "diffusers,omniloop,omniloop-mod-compile"]
    rec = run_script(BENCH, argv, tmp_path, "flux_gpu-*-smoke-*.json")
    assert set(rec["results"]) == {"diffusers", "omniloop", "omniloop-mod-compile"}
    assert "modulation=per-request" in rec["sides"]["omniloop-mod-compile"]["setup"]
    assert rec["final_latents"]["omniloop_vs_diffusers"]["equal"]
    mod = rec["sides"]["omniloop-mod-compile"]
    assert mod["latents_rel_rms_vs_diffusers"] < 1e-3, mod  # float32: the table's GEMMs reassociate


@pytest.mark.slow
@pytest.mark.skipif(not BENCH.exists(), reason="bench/flux_gpu.py not in this checkout")
def test_flux_gpu_smoke_fp8_linears_side(tmp_path):
    """``omniloop-fp8lin-…``: the side deploys ``linear_precision: fp8`` the way the runtime does
    (omniloop-quant's check, then its swap, on its own copy of the transformer) and says so."""
    pytest.importorskip("omniloop_quant")
    argv = ["--smoke", "--device", "cpu", "--steps", "2", "--repeats", "1", "--compile-backend", "eager",
            "--only", "diffusers,omniloop,omniloop-fp8lin-compile,omniloop-fp8lin-keepv-compile,omniloop-fp8lin-keepqkv-compile"]
    rec = run_script(BENCH, argv, tmp_path, "flux_gpu-*-smoke-*.json")
    assert set(rec["results"]) == {"diffusers", "omniloop", "omniloop-fp8lin-compile", "omniloop-fp8lin-keepv-compile",
                                   "omniloop-fp8lin-keepqkv-compile"}
    setup = rec["sides"]["omniloop-fp8lin-compile"]["setup"]
    assert "linear_precision=fp8" in setup and "(0 linears)" not in setup and "kept" not in setup
    keepv = rec["sides"]["omniloop-fp8lin-keepv-compile"]["setup"]  # linear_precision_options: {keep: [...]}
    assert "attn.to_v x" in keepv and "attn.add_v_proj x" in keepv
    keepqkv = rec["sides"]["omniloop-fp8lin-keepqkv-compile"]["setup"]  # the globs expanded to the layers they keep
    assert all(f"attn.{p} x" in keepqkv for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"))
    assert rec["final_latents"]["omniloop_vs_diffusers"]["equal"]  # the bf16 side's transformer was not swapped


@pytest.mark.slow
@pytest.mark.skipif(not BENCH.exists(), reason="bench/flux_gpu.py not in this checkout")
def test_flux_gpu_smoke_profile(tmp_path):
    """``--profile``: after the timed rounds each side's kernels over one step are in its record
    (on the CPU the profiler's op times stand in for kernels)."""
    argv = ["--smoke", "--device", "cpu", "--steps", "2", "--repeats", "1", "--compile-backend", "eager",
            "--only", "diffusers,omniloop", "--profile"]
    rec = run_script(BENCH, argv, tmp_path, "flux_gpu-*-smoke-*.json")
    for side in ("diffusers", "omniloop"):
        prof = rec["sides"][side]["profile_one_step"]
        assert prof["kernel_ms_total"] > 0 and set(prof["groups_ms"]) == {"attention", "matmul", "other"}
        assert prof["top_kernels"]
