"""bench/sd3_gpu.py runs end to end at tiny size on the CPU (compile backend 'eager')."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sd3_gpu_bench_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("sd3_gpu", ROOT / "bench" / "sd3_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--smoke", "--repeats", "1", "--only", "diffusers,omniloop,omniloop-compile", "--out", str(tmp_path)]) == 0
    rec = json.loads(next(tmp_path.glob("sd3_gpu-smoke-*.json")).read_text())
    for side in ("diffusers", "omniloop", "omniloop-compile"):
        assert rec["sides"][side]["latents_bit_equal_diffusers"] is True, rec["sides"][side]
    assert rec["summary"]["omniloop"]["step_speedup_vs_diffusers"] > 0


@pytest.mark.slow
def test_sd3_gpu_bench_takes_the_gelu_side_and_refuses_flux_only_words(tmp_path):
    """``-gelu`` (``options.ffn_gelu: fused``) is an SD3 side word; on the CPU smoke it runs the reference
    GELU (cuBLASLt's epilogue is CUDA-only). ``mod`` / ``rope`` are FLUX's and refused with one message."""
    spec = importlib.util.spec_from_file_location("sd3_gpu", ROOT / "bench" / "sd3_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    side = "omniloop-fa3-fused-gelu-compile-graphs"
    assert mod.main(["--smoke", "--repeats", "1", "--only", f"diffusers,{side}", "--out", str(tmp_path)]) == 0
    rec = json.loads(next(tmp_path.glob("sd3_gpu-smoke-*.json")).read_text())
    assert "ffn_gelu=reference" in rec["sides"][side]["setup"]
    assert rec["summary"][side]["step_speedup_vs_diffusers"] > 0
    mod.SIDES = (*mod.SIDES, "omniloop-fused-mod-compile")
    out = tmp_path / "mod"
    assert mod.main(["--smoke", "--repeats", "1", "--only", "diffusers,omniloop-fused-mod-compile", "--out", str(out)]) == 0
    rec = json.loads(next(out.glob("sd3_gpu-smoke-*.json")).read_text())
    assert "ValueError: side 'omniloop-fused-mod-compile': the SD3 family has no options.modulation" in \
        rec["sides"]["omniloop-fused-mod-compile"]["skipped"]
