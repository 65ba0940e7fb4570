"""bench/text_decode.py ``--smoke`` end to end on CPU (the script does not rot): every section writes
its rows, the CUDA-only kernel section says why it was skipped, a spent budget skips the rest."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "text_decode.py"


@pytest.fixture(autouse=True)
def _keep_threads():
    import torch

    n = torch.get_num_threads()  # the script sets torch's thread count (--threads)
    yield
    torch.set_num_threads(n)


def _load():
    spec = importlib.util.spec_from_file_location("text_decode_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not BENCH.exists(), reason="bench/text_decode.py not in this checkout")
def test_smoke_writes_every_section(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch backend only: seconds
    bench = _load()
    assert bench.main(["--smoke", "--preset", "qwen2.5-0.5b", "--batches", "1,2", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("text_decode-cpu-qwen2.5-0.5b-smoke-*.json")
    rec = json.loads(path.read_text())
    assert rec["variants"] == ["torch"] and rec["model"]["num_attention_heads"] == 14
    assert "cannot run here" in rec["kernel"]["skipped"]
    assert [r["batch"] for r in rec["throughput"]] == [1, 2]
    for row in rec["throughput"]:
        assert row["omniloop_torch_tokens_per_s"] > 0 and row["transformers_tokens_per_s"] > 0, row
        assert not any(k.endswith("_error") for k in row), row
    assert [r["batch"] for r in rec["decode_vs_reprefill"]] == [1, 2]
    for row in rec["decode_vs_reprefill"]:
        assert row["omniloop_torch_decode_ms"] > 0 and row["reprefill_ms"] > 0, row


@pytest.mark.skipif(not BENCH.exists(), reason="bench/text_decode.py not in this checkout")
def test_spent_budget_records_skips(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    bench = _load()
    assert bench.main(["--smoke", "--budget-s", "0", "--sections", "throughput,reprefill", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("text_decode-cpu-smoke-*.json")
    rec = json.loads(path.read_text())
    assert all(r.get("skipped") == "budget" for r in rec["throughput"] + rec["decode_vs_reprefill"])


@pytest.mark.skipif(not BENCH.exists(), reason="bench/text_decode.py not in this checkout")
def test_isolated_sides_survive_a_dead_child(tmp_path, monkeypatch) -> None:
    """--isolate yes (the CUDA default): every side runs in its own child process; a child that dies
    (os.abort, as a CUDA illegal memory access kills it) records an error for its side's rows and the
    other sides still measure."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    bench = _load()
    monkeypatch.setenv(bench.FAULT_ENV, "transformers")
    assert bench.main(["--smoke", "--isolate", "yes", "--batches", "1", "--sections", "throughput,reprefill",
                       "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("text_decode-cpu-smoke-*.json")
    rec = json.loads(path.read_text())
    assert set(rec["children"]) == {"omniloop_torch", "transformers"}
    assert rec["children"]["omniloop_torch"]["rc"] == 0 and rec["children"]["transformers"]["rc"] != 0
    (row,) = rec["throughput"]
    assert row["omniloop_torch_tokens_per_s"] > 0 and "died" in row["transformers_error"], row
    assert [r["batch"] for r in rec["decode_vs_reprefill"]] == [1, 2]
    for row in rec["decode_vs_reprefill"]:
        assert row["omniloop_torch_decode_ms"] > 0 and "died" in row["transformers_error"], row
