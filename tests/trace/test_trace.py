"""Activation trace on the toy family: one JSONL line per (step, branch, name)."""

from __future__ import annotations

import json

import pytest
import torch

from omniloop.request import TaskType
from omniloop.testing import build_toy_checkpoint, toy_runtime
from omniloop_trace import plugin, read_trace, tensor_stats

REQ = {"task": "t2v", "prompt": "a cat", "diffusion": {"seed": 1}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_toy_checkpoint(tmp_path_factory.mktemp("trace") / "toy")


def _rt(ckpt, **cfg):
    return toy_runtime(ckpt, ("trace", plugin), plugins={"trace": cfg})


def test_one_line_per_step_branch_and_tap(ckpt, tmp_path):
    path = tmp_path / "t.jsonl"
    rt = _rt(ckpt, path=str(path))
    assert not rt.pipeline(TaskType.T2V).eager
    out = rt.generate({**REQ, "request_id": "r1"})
    lines = read_trace(path)
    keys = [(x["step"], x["branch"], x["name"]) for x in lines]
    assert keys[:4] == [
        (0, "cond", "noise_pred"),
        (0, "uncond", "noise_pred"),
        (0, None, "guided"),
        (0, None, "latents"),
    ]
    assert len(lines) == 16 and len(set(keys)) == 16
    last = lines[-1]
    assert last["request_id"] == "r1" and last["kind"] == "tap" and last["shape"] == [1, 4, 3, 4, 4]
    lat = out.artifacts["latents"].tensor
    assert last["mean"] == pytest.approx(float(lat.mean()), rel=1e-5)
    assert last["std"] == pytest.approx(float(lat.std(correction=0)), rel=1e-5)
    assert last["absmax"] == pytest.approx(float(lat.abs().max()), rel=1e-6)


def test_block_regex_selects_modules_and_forces_eager(ckpt, tmp_path):
    path = tmp_path / "b.jsonl"
    rt = _rt(ckpt, path=str(path), taps="^latents$", blocks=r"blocks\.(0|2)$")
    assert rt.pipeline(TaskType.T2V).eager
    rt.generate(REQ)
    lines = read_trace(path)
    assert {x["name"] for x in lines} == {"latents", "blocks.0", "blocks.2"}
    blocks = [x for x in lines if x["kind"] == "block"]
    assert len(blocks) == 4 * 2 * 2 and {x["branch"] for x in blocks} == {"cond", "uncond"}


def test_append_and_truncate_and_per_request_files(ckpt, tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"old": 1}\n')
    rt = _rt(ckpt, path=str(path), taps="^guided$")
    rt.generate(REQ)
    assert len(read_trace(path)) == 1 + 4
    rt2 = _rt(ckpt, path=str(path), taps="^guided$", append=False)
    rt2.generate(REQ)
    rt2.generate(REQ)  # the truncation happens once per runtime, later requests append
    assert len(read_trace(path)) == 8
    per = _rt(ckpt, path=str(tmp_path / "req-{request_id}.jsonl"), taps="^guided$")
    per.generate({**REQ, "request_id": "x1"})
    per.generate({**REQ, "request_id": "x2"})
    assert len(read_trace(tmp_path / "req-x1.jsonl")) == 4 and len(read_trace(tmp_path / "req-x2.jsonl")) == 4


def test_nonfinite_stats_stay_valid_json():
    s = tensor_stats(torch.tensor([1.0, float("nan"), 3.0]))
    assert s["mean"] == "nan" and s["nonfinite"] == 1
    json.loads(json.dumps(s), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert tensor_stats(torch.zeros(0))["mean"] is None
    assert tensor_stats(torch.tensor([2.0]))["std"] == 0.0
