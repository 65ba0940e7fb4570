"""The profiler observer on the toy family (CPU); CUDA paths are exercised when a GPU is present."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from rich.console import Console

from omniloop.request import TaskType
from omniloop.testing import build_toy_checkpoint, toy_runtime
from omniloop_profiler import plugin, summary_table

REQ = {"task": "t2v", "prompt": "a cat", "diffusion": {"seed": 1}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_toy_checkpoint(tmp_path_factory.mktemp("profiler") / "toy")


def _rt(ckpt, device="cpu", **cfg):
    return toy_runtime(ckpt, ("profiler", plugin), device=device, plugins={"profiler": cfg})


def test_report_has_nodes_steps_memory_and_is_kept_by_request_id(ckpt):
    rt = _rt(ckpt)
    out = rt.generate({**REQ, "request_id": "p1"})
    prof = rt.components_enabled["profiler"][1]
    rep = prof.get_report("p1")
    assert rep is prof.last_report and rep["status"] == "completed" and rep["device"] == "cpu"
    assert [n["node"] for n in rep["nodes"]] == ["text_encode", "denoise", "decode"]
    assert all(n["wall_s"] > 0 and n["device_s"] is None for n in rep["nodes"])
    assert [(s["node"], s["step"]) for s in rep["steps"]] == [("denoise", i) for i in range(4)]
    assert rep["step_summary"]["denoise"]["count"] == 4
    assert rep["memory"]["kind"] == "process_peak_rss" and rep["memory"]["peak_bytes"] > 2**20
    assert rep["blocks"] == [] and rep["trace"] is None
    assert rep["total_s"] >= sum(n["wall_s"] for n in rep["nodes"]) * 0.99
    assert out.ok and prof.get_report("nope") is None
    json.dumps(rep)


def test_without_blocks_the_profiler_listens_to_no_taps(ckpt):
    rt = _rt(ckpt)
    built = rt.pipeline(TaskType.T2V)
    assert built.bus.tap is None and built.eager is False
    assert built.bus.step_end is not None


def test_block_timing_forces_eager_and_times_each_block_per_branch_forward(ckpt, caplog):
    with caplog.at_level(logging.INFO):
        rt = _rt(ckpt, blocks=r"blocks\.(0|3)$")
    assert "blocks run eagerly" in caplog.text and rt.pipeline(TaskType.T2V).eager
    out = rt.generate(REQ)
    rep = rt.components_enabled["profiler"][1].get_report(out.request_id)
    assert [(b["name"], b["count"]) for b in rep["blocks"]] == [("blocks.0", 8), ("blocks.3", 8)]
    assert all(b["total_s"] > 0 and b["mean_s"] > 0 for b in rep["blocks"])


def test_json_report_and_summary_table(ckpt, tmp_path):
    rt = _rt(ckpt, json=str(tmp_path / "prof-{request_id}.json"), blocks=r"blocks\.\d+$")
    rt.generate({**REQ, "request_id": "r7"})
    data = json.loads((tmp_path / "prof-r7.json").read_text())
    assert data["request_id"] == "r7" and len(data["blocks"]) == 4
    console = Console(record=True, width=140)
    console.print(summary_table(data))
    text = console.export_text()
    for s in ("profile of r7", "text_encode", "denoise", "decode", "peak RSS MiB", "steps", "blocks.0", "total"):
        assert s in text, s


def test_torch_profiler_window_writes_a_chrome_trace(ckpt, tmp_path):
    rt = _rt(ckpt, trace_steps=[1, 2], trace_out=str(tmp_path / "trace-{request_id}.json"))
    rt.generate({**REQ, "request_id": "t1"})
    rep = rt.components_enabled["profiler"][1].get_report("t1")
    assert rep["trace"]["steps"] == [1, 2] and rep["trace"]["path"] == str(tmp_path / "trace-t1.json")
    trace = json.loads((tmp_path / "trace-t1.json").read_text())
    assert trace["traceEvents"]
    # the window is closed: a second request can trace again
    rt.generate({**REQ, "request_id": "t2"})
    assert (tmp_path / "trace-t2.json").is_file()


def test_failed_request_still_reports_and_closes_the_trace_window(ckpt, tmp_path):
    rt = _rt(ckpt, trace_steps=[0, 3], trace_out=str(tmp_path / "t.json"))
    ex = rt.prepare({**REQ, "request_id": "f1"})
    ex.advance()
    ex.advance()  # text_encode, then loop init + step 0 (the trace window opens at step 0)
    ex.cancel()
    ex.run()
    rep = rt.components_enabled["profiler"][1].get_report("f1")
    assert rep["status"] == "cancelled" and (tmp_path / "t.json").is_file()
    from omniloop_profiler.profiler import Profiler

    assert Profiler._active_trace is None


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"trace_steps": [3, 1]}, "trace_steps"),
        ({"blocks": "("}, "blocks"),
        ({"keep": 0}, "keep"),
    ],
)
def test_bad_config_is_a_deploy_error(ckpt, cfg, message):
    from omniloop.errors import DeployError

    with pytest.raises(DeployError, match=message):
        _rt(ckpt, **cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_time_memory_and_nvtx(ckpt):
    rt = _rt(ckpt, device="cuda", blocks=r"blocks\.\d+$", nvtx=True)
    rt.components_enabled["profiler"][1].bind(rt)
    out = rt.generate(REQ)
    assert out.ok
    rep = rt.components_enabled["profiler"][1].get_report(out.request_id)
    assert rep["device"] == "cuda" and rep["memory"]["kind"] == "cuda_max_allocated"
    assert all(n["device_s"] is not None and n["device_s"] >= 0 for n in rep["nodes"])
    assert all(s["device_s"] > 0 for s in rep["steps"])
    assert all(b["device_total_s"] > 0 for b in rep["blocks"])
    synced = _rt(ckpt, device="cuda", sync=True)
    out = synced.generate(REQ)
    assert synced.components_enabled["profiler"][1].get_report(out.request_id)["synchronized"] is True


def test_device_comes_from_the_deploy_not_from_cuda_being_initialized(ckpt, monkeypatch):
    """On a GPU host a CPU deployment is still profiled as CPU (found on the H200: the report said cuda)."""
    rt = _rt(ckpt)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    rt.generate({**REQ, "request_id": "cpu-on-gpu-host"})
    rep = rt.components_enabled["profiler"][1].get_report("cpu-on-gpu-host")
    assert rep["device"] == "cpu" and rep["memory"]["kind"] == "process_peak_rss"
