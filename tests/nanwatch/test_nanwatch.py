"""NaN watch on the toy family: raise names (node, step, branch, module); flag records findings."""

from __future__ import annotations

import pytest

from omniloop.request import Status, TaskType
from omniloop.testing import build_toy_checkpoint, toy_runtime
from omniloop_nanwatch import NonFiniteError, plugin

REQ = {"task": "t2v", "prompt": "a cat", "diffusion": {"seed": 1}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_toy_checkpoint(tmp_path_factory.mktemp("nanwatch") / "toy")


def _rt(ckpt, **cfg):
    return toy_runtime(ckpt, ("nanwatch", plugin), plugins={"nanwatch": cfg})


def _poison(rt, block: int, call: int, value: float = float("nan")):
    """Make block ``block`` put ``value`` into its output on its ``call``-th call (0-based).

    The toy calls each block once per branch per step, cond first: call 4 is step 2, cond.
    """
    calls = {"n": 0}

    def hook(_m, _inp, out):
        n = calls["n"]
        calls["n"] += 1
        if n == call:
            out = out.clone()
            out[0, 0, 0] = value
        return out

    return rt.model.components["transformer"].blocks[block].register_forward_hook(hook)


def test_a_clean_run_passes_and_reports_what_was_checked(ckpt):
    rt = _rt(ckpt)
    out = rt.generate(REQ)
    assert out.ok
    rep = rt.components_enabled["nanwatch"][1].get_report(out.request_id)
    assert rep["findings"] == [] and rep["first"] is None and rep["checked"] == 4 * 4  # 2 preds, guided, latents


def test_raise_fails_the_request_naming_node_step_branch_and_module(ckpt):
    rt = _rt(ckpt, blocks=r"blocks\.\d+$")
    assert rt.pipeline(TaskType.T2V).eager
    handle = _poison(rt, block=1, call=4)
    try:
        out = rt.generate(REQ)
    finally:
        handle.remove()
    assert out.status is Status.FAILED
    assert out.error.type == "NonFiniteError" and out.error.node == "denoise" and out.error.step == 2
    msg = out.error.message
    assert "NaN in module 'blocks.1'" in msg and "node 'denoise'" in msg and "step 2" in msg and "branch 'cond'" in msg
    # the next request on the same runtime is unaffected
    assert rt.generate(REQ).ok


def test_without_block_taps_the_first_tap_after_the_nan_is_named(ckpt):
    rt = _rt(ckpt)
    assert not rt.pipeline(TaskType.T2V).eager
    handle = _poison(rt, block=1, call=5, value=float("inf"))  # step 2, uncond
    try:
        out = rt.generate(REQ)
    finally:
        handle.remove()
    assert out.status is Status.FAILED
    assert "tap 'noise_pred' (node 'denoise', step 2, branch 'uncond')" in out.error.message


def test_flag_mode_records_findings_and_lets_the_run_finish(ckpt, caplog):
    rt = _rt(ckpt, mode="flag", blocks=r"blocks\.3$")
    handle = _poison(rt, block=3, call=2)  # step 1, cond
    try:
        out = rt.generate(REQ)
    finally:
        handle.remove()
    assert out.ok
    watch = rt.components_enabled["nanwatch"][1]
    found = watch.findings(out.request_id)
    first = found[0]
    assert (first.kind, first.name, first.step, first.branch, first.nan, first.inf) == (
        "block",
        "blocks.3",
        1,
        "cond",
        1,
        0,
    )
    # NaN spreads: the noise prediction, the guided value and the latents of that step are flagged too
    names = [(f.step, f.branch, f.name) for f in found[:4]]
    assert names == [(1, "cond", "blocks.3"), (1, "cond", "noise_pred"), (1, None, "guided"), (1, None, "latents")]
    assert watch.get_report(out.request_id)["first"]["name"] == "blocks.3"
    assert "nanwatch: NaN in module 'blocks.3'" in caplog.text


def test_flag_mode_caps_findings(ckpt):
    rt = _rt(ckpt, mode="flag", max_findings=3)
    handle = _poison(rt, block=0, call=0)
    try:
        out = rt.generate(REQ)
    finally:
        handle.remove()
    assert len(rt.components_enabled["nanwatch"][1].get_report(out.request_id)["findings"]) == 3


def test_error_is_an_omniloop_error():
    from omniloop.errors import OmniloopError

    assert issubclass(NonFiniteError, OmniloopError)


def test_bad_mode_is_a_deploy_error(ckpt):
    from omniloop.errors import DeployError

    with pytest.raises(DeployError, match="mode"):
        _rt(ckpt, mode="explode")
