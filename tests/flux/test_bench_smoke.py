"""bench/flux_gpu.py runs end to end on tiny configs (``--smoke``, CPU, eager compile backend):
the script does not rot, and its omniloop sides equal diffusers' bit for bit."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "flux_gpu.py"


@pytest.mark.slow
@pytest.mark.skipif(not BENCH.exists(), reason="bench/flux_gpu.py not in this checkout")
def test_flux_gpu_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("flux_gpu_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = ["--smoke", "--device", "cpu", "--steps", "3", "--repeats", "1", "--compile-backend", "eager",
            "--out", str(tmp_path)]
    assert mod.main(argv) == 0
    (path,) = tmp_path.glob("flux_gpu-*-smoke-*.json")
    rec = json.loads(path.read_text())
    assert rec["command"].startswith("python bench/flux_gpu.py --smoke")
    assert set(rec["results"]) == {"diffusers", "diffusers-compile", "omniloop", "omniloop-compile"}
    assert all(r["s_per_step"] > 0 for r in rec["results"].values())
    assert all(v["equal"] for v in rec["final_latents"].values()), rec["final_latents"]
