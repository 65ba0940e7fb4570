"""bench/offload_gpu.py runs end to end on tiny models (``--smoke``, CPU): the script does not rot.
No timing is asserted; every mode ran, the record is complete, offloaded latents equal ``none``'s."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniloop.testing.scripts import run_script

BENCH = Path(__file__).resolve().parents[2] / "bench" / "offload_gpu.py"


@pytest.mark.slow
@pytest.mark.skipif(not BENCH.exists(), reason="bench/offload_gpu.py not in this checkout")
def test_offload_gpu_smoke(tmp_path):
    modes = ["sequential", "none", "model", "sequential-nooverlap"]  # none is run first whatever the order
    rec = run_script(BENCH, ["--smoke", "--steps", "3", "--modes", *modes], tmp_path, "offload_gpu-smoke-*-smoke.json")
    assert rec["command"].startswith("python bench/offload_gpu.py --smoke")
    rows = rec["results"]["smoke"]["modes"]
    assert list(rows) == ["none", "sequential", "model", "sequential-nooverlap"]
    for mode, row in rows.items():
        assert row["s_per_step_median"] > 0 and len(row["s_per_step"]) == 2, mode
        if mode != "none":
            assert row["latents_equal_to_none"] is True, mode
            assert row["offload"]["mode"] == mode.split("-")[0]
    assert rows["sequential-nooverlap"]["offload"]["overlap"] is False
