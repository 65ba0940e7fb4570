"""bench/text_decode.py ``--smoke`` end to end on CPU (the script does not rot): every section writes
its rows, the CUDA-only kernel section says why it was skipped, a spent budget skips the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniloop.testing.scripts import load_script, run_script

BENCH = Path(__file__).resolve().parents[2] / "bench" / "text_decode.py"


@pytest.fixture(autouse=True)
def _keep_threads():
    import torch

    n = torch.get_num_threads()  # the script sets torch's thread count (--threads)
    yield
    torch.set_num_threads(n)


@pytest.mark.skipif(not BENCH.exists(), reason="bench/text_decode.py not in this checkout")
def test_smoke_writes_every_section(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch backend only: seconds
    rec = run_script(BENCH, ["--smoke", "--preset", "qwen2.5-0.5b", "--batches", "1,2"], tmp_path,
                     "text_decode-cpu-qwen2.5-0.5b-smoke-*.json")
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
    rec = run_script(BENCH, ["--smoke", "--budget-s", "0", "--sections", "throughput,reprefill"], tmp_path,
                     "text_decode-cpu-smoke-*.json")
    assert all(r.get("skipped") == "budget" for r in rec["throughput"] + rec["decode_vs_reprefill"])


@pytest.mark.skipif(not BENCH.exists(), reason="bench/text_decode.py not in this checkout")
def test_isolated_sides_survive_a_dead_child(tmp_path, monkeypatch) -> None:
    """--isolate yes (the CUDA default): every side runs in its own child process; a child that dies
    (os.abort, as a CUDA illegal memory access kills it) records an error for its side's rows and the
    other sides still measure."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    bench = load_script(BENCH)
    monkeypatch.setenv(bench.FAULT_ENV, "transformers")
    rec = run_script(bench, ["--smoke", "--isolate", "yes", "--batches", "1", "--sections", "throughput,reprefill"],
                     tmp_path, "text_decode-cpu-smoke-*.json")
    assert set(rec["children"]) == {"omniloop_torch", "transformers"}
    assert rec["children"]["omniloop_torch"]["rc"] == 0 and rec["children"]["transformers"]["rc"] != 0
    (row,) = rec["throughput"]
    assert row["omniloop_torch_tokens_per_s"] > 0 and "died" in row["transformers_error"], row
    assert [r["batch"] for r in rec["decode_vs_reprefill"]] == [1, 2]
    for row in rec["decode_vs_reprefill"]:
        assert row["omniloop_torch_decode_ms"] > 0 and "died" in row["transformers_error"], row


@pytest.mark.skipif(not BENCH.exists(), reason="bench/text_decode.py not in this checkout")
def test_profile_explains_the_smallest_batch_through_the_children(tmp_path, monkeypatch) -> None:
    """--profile (passed on to each side's child): the smallest batch's decode-vs-re-prefill row gets
    each side's torch.profiler summary (host time per step, top host ops; the CUDA-only kernel and
    launch counts are absent on CPU), the larger batch none."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    bench = load_script(BENCH)
    rec = run_script(bench, ["--smoke", "--profile", "--isolate", "yes", "--sections", "reprefill"], tmp_path,
                     "text_decode-cpu-smoke-*.json")
    one, two = rec["decode_vs_reprefill"]
    for key in ("omniloop_torch_profile", "reprefill_profile"):
        prof = one[key]
        assert prof["steps"] == (bench.PROFILE_STEPS if key.startswith("omniloop") else bench.PROFILE_REPREFILLS)
        assert prof["wall_ms_per_step"] > 0 and prof["cpu_ms_per_step"] > 0 and prof["top_cpu_ops"], prof
        assert "gpu_kernel_ms_per_step" not in prof and prof["launches_per_step"] == 0
        assert key not in two
    assert one["omniloop_torch_decode_ms"] > 0 and one["reprefill_ms"] > 0
