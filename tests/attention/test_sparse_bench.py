"""The sparse-tile benchmark scripts run and say what they measure (CPU smoke runs, tiny shapes):
``bench/attention_sparse.py --smoke`` (the backend vs SDPA given the same mask, timings and
layouts recorded) and ``bench/attention_sparse_quality.py --smoke`` at density 1.0 (the sparse
path through the runtime reproduces the dense wan-demo clips: the comparison machinery is sound)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.usefixtures("one_thread")]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod



@pytest.mark.slow  # imports the library stack for the machine record; the work itself is a 72-token grid
def test_attention_sparse_smoke(tmp_path):
    assert _load("attention_sparse").main(["--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("attention_sparse-*-smoke.json")
    rec = json.loads(path.read_text())
    assert rec["errors"] == [] and rec["command"].startswith("python bench/attention_sparse.py --smoke")
    # float32 on the CPU: the backend equals SDPA given the same mask as a dense boolean attn_mask
    assert rec["check"] and all(c["rel_rms_vs_masked_fp32"] < 1e-5 for c in rec["check"].values())
    for kind in ("random", "structured"):
        rows = rec["results"][kind]
        assert {"dense-sdpa", "sparse-0.5", "sparse-0.3", "sparse-0.15", "sparse-1.0"} <= set(rows)
        assert rows["sparse-1.0"]["rel_rms_vs_dense"] < 1e-5
        assert rows["sparse-0.3"]["layout"]["visited_blocks"] < 0.5


@pytest.mark.slow
def test_quality_smoke_density_one_reproduces_dense(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("omniloop_wan_demo")
    from omniloop_attention import sparse

    before = sparse.BLOCK
    mod = _load("attention_sparse_quality")
    assert mod.main(["--smoke", "--densities", "1.0", "--out", str(tmp_path)]) == 0
    assert sparse.BLOCK == before  # the run's block size is restored
    (path,) = tmp_path.glob("attention_sparse_quality-wan-demo-cpu-*-smoke.json")
    rec = json.loads(path.read_text())
    row = rec["configs"]["sparse-tile 1.0 tile [1, 4, 4]"]
    assert row["block"] == 16 and row["layouts"][0]["blocks"] == 20 and row["layouts"][0]["kept_token_pairs"] == 1.0
    # every key block kept: the same attention up to summation order, 3 steps of float32 -> uint8 frames
    assert row["vs_dense"]["psnr_db_min"] is None or row["vs_dense"]["psnr_db_min"] > 40 \
        or row["vs_dense"]["identical_clips"] == row["n"]
    assert all(v["lost"] == 0 for v in row["verdict_changes_vs_dense"].values())
