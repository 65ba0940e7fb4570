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
