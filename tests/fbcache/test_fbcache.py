"""omniloop-fbcache on a toy residual block stack and through the runtime (toy family)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest
import torch

import omniloop_fbcache.plugin as fbcache_plugin
from omniloop.errors import PluginError, RequestError
from omniloop.interceptors import BlockContext, BlockInterceptor
from omniloop.loop import LoopState, StepContext
from omniloop.testing import check_interleaved_equal_alone, completed_latents, toy_request, toy_runtime
from omniloop_fbcache import FBCacheConfig, FBCacheParams, FirstBlockCache

SETTINGS = {"threshold": 0.1, "warmup_steps": 3}


def _hits(metrics: dict[str, Any]) -> int:
    return sum(m["num_cached_steps"] for m in metrics.values())


# -- the interceptor on its own ----------------------------------------------------------------


def test_declares_the_block_interceptor_contract() -> None:
    icpt = FirstBlockCache(SETTINGS)
    assert isinstance(icpt, BlockInterceptor)
    assert (icpt.name, icpt.graph_safe, icpt.distribution_altering, icpt.needs_eager) == ("fbcache", False, True, False)


def test_baseline_enabled_disabled_after_enabled(toy_blocks: Any) -> None:
    model = toy_blocks.Model()
    baseline, _ = toy_blocks.run_alone(model)
    enabled, metrics = toy_blocks.run_alone(model, FirstBlockCache(SETTINGS))
    disabled, _ = toy_blocks.run_alone(model)
    assert _hits(metrics) > 0
    assert not torch.equal(enabled, baseline) and (enabled - baseline).abs().max() < 0.1
    assert torch.equal(disabled, baseline)


def test_threshold_zero_is_bit_identical_to_no_cache(toy_blocks: Any) -> None:
    model = toy_blocks.Model()
    baseline, _ = toy_blocks.run_alone(model)
    out, metrics = toy_blocks.run_alone(model, FirstBlockCache(SETTINGS), params={"threshold": 0.0})
    assert _hits(metrics) == 0 and torch.equal(out, baseline)


def test_interleaved_requests_equal_each_alone(toy_blocks: Any) -> None:
    model = toy_blocks.Model()
    icpt = FirstBlockCache(SETTINGS)
    kw_a = dict(request_id="a", seed=1, steps=20)
    kw_b = dict(request_id="b", seed=2, steps=15, params={"threshold": 0.15, "max_consecutive_cached": 1})
    alone_a, met_a = toy_blocks.run_alone(model, icpt, **kw_a)
    alone_b, met_b = toy_blocks.run_alone(model, icpt, **kw_b)
    assert _hits(met_a) > 0 and _hits(met_b) > 0
    a, b = toy_blocks.Run(model, icpt, **kw_a), toy_blocks.Run(model, icpt, **kw_b)
    a.step(), a.step()
    toy_blocks.interleave([a, b])
    assert torch.equal(a.x, alone_a) and torch.equal(b.x, alone_b)
    assert a.close() == met_a and b.close() == met_b


def test_decision_is_the_relative_l1_of_the_first_block_residual(toy_blocks: Any) -> None:
    """Re-derive every decision by hand from the first block's residuals."""
    model = toy_blocks.Model()
    icpt = FirstBlockCache({"threshold": 0.1, "warmup_steps": 2})
    run = toy_blocks.Run(model, icpt, branches=("cond",), guidance=1.0)
    seen: list[torch.Tensor] = []
    block0 = model.blocks[0]
    handle = block0.register_forward_hook(lambda mod, args, out: seen.append(out - args[0]))
    try:
        while not run.done:
            run.step()
    finally:
        handle.remove()
    m = run.close()["cond"]
    ref, cached = None, []
    for i, r in enumerate(seen):
        if ref is not None and i >= 2:
            diff = ((ref - r).abs().sum() / ref.abs().sum()).item()
            assert m["residual_diffs"][str(i)] == pytest.approx(diff, rel=1e-6)
            if diff < 0.1:
                cached.append(i)
                continue
        ref = r
    assert cached and m["cached_steps"] == cached


def test_warmup_and_max_consecutive(toy_blocks: Any) -> None:
    icpt = FirstBlockCache({"threshold": 0.9, "warmup_steps": 5, "max_consecutive_cached": 2})
    _, metrics = toy_blocks.run_alone(toy_blocks.Model(), icpt, steps=20)
    for m in metrics.values():
        cached = m["cached_steps"]
        assert cached and min(cached) >= 5
        run = longest = 0
        for i in range(20):
            run = run + 1 if i in cached else 0
            longest = max(longest, run)
        assert longest == 2


def test_switching_block_lists_drops_the_reference(toy_blocks: Any) -> None:
    high, low = toy_blocks.Model(seed=0), toy_blocks.Model(seed=1)
    icpt = FirstBlockCache({"threshold": 0.9, "warmup_steps": 0})
    loop = LoopState(total=6, branches=("cond",))
    loop.plugin_state[("fbcache", "cond")] = st = icpt.open(StepContext("m", "denoise", 0, 6, 1.0, "cond"), loop)
    x = torch.randn(1, toy_blocks.TOKENS, toy_blocks.DIM)
    with torch.no_grad():
        for i in range(6):
            model = high if i < 3 else low
            ctx = BlockContext(step=StepContext("m", "denoise", i, 6, 1.0, "cond"), loop=loop, interceptor=icpt)
            model(x, 1.0, "cond", ctx)
    assert 3 not in st.cached_steps and 0 not in st.cached_steps  # first forward of each stack computes
    assert {1, 2, 4, 5} <= set(st.cached_steps)


def test_close_frees_tensors_and_run_after_close_fails(toy_blocks: Any) -> None:
    icpt = FirstBlockCache(SETTINGS)
    run = toy_blocks.Run(toy_blocks.Model(), icpt)
    run.step()
    states = [run.loop.plugin_state[("fbcache", b)] for b in run.loop.branches]
    for st in states:
        assert st.rest_residual is not None
        icpt.close(st)
        icpt.close(st)
        assert st.rest_residual is None and st.ref_residual is None
    with pytest.raises(PluginError, match="fbcache"):
        run.step()


@pytest.mark.parametrize(
    "params, path",
    [
        ({"threshold": -0.1}, "plugin_params.fbcache.threshold"),
        ({"warmup_steps": "x"}, "plugin_params.fbcache.warmup_steps"),
        ({"max_consecutive_cached": -5}, "plugin_params.fbcache.max_consecutive_cached"),
        ({"Fn": 1}, "plugin_params.fbcache.Fn"),
    ],
)
def test_invalid_params_name_their_path(toy_blocks: Any, params: dict[str, Any], path: str) -> None:
    with pytest.raises(RequestError) as err:
        toy_blocks.Run(toy_blocks.Model(), FirstBlockCache(SETTINGS), params=params)
    assert err.value.path == path


# -- packaging and registration ----------------------------------------------------------------


def test_entry_point_and_registration() -> None:
    (ep,) = [e for e in importlib.metadata.entry_points(group="omniloop.plugins") if e.name == "fbcache"]
    assert ep.load() is fbcache_plugin and fbcache_plugin.OMNILOOP_HOOK_API == ">=1.0,<2"
    got: list[Any] = []
    fbcache_plugin.omniloop_register_interceptors(got.append)
    (spec,) = got
    assert (spec.name, spec.kind, spec.distribution_altering) == ("fbcache", "block_interceptor", True)
    assert spec.config_schema is FBCacheConfig and spec.params_schema is FBCacheParams
    assert isinstance(spec.factory(FBCacheConfig()), FirstBlockCache)


def test_depends_only_on_omniloop_and_torch() -> None:
    reqs = {
        r.split(";")[0].split(">")[0].split("<")[0].split("=")[0].strip()
        for r in importlib.metadata.requires("omniloop-fbcache") or []
    }
    assert reqs == {"omniloop", "torch", "attrs"}


# -- through the runtime -------------------------------------------------------------------------




@pytest.fixture
def runtimes(toy_checkpoint: Path) -> tuple[Any, Any]:
    return (
        toy_runtime(toy_checkpoint),
        toy_runtime(
            toy_checkpoint, ("fbcache", fbcache_plugin), plugins={"fbcache": {"threshold": 0.2, "warmup_steps": 2}}
        ),
    )


def test_runtime_enabled_exact_and_tuned(runtimes: tuple[Any, Any]) -> None:
    plain, cached = runtimes
    baseline = completed_latents(plain.generate(toy_request()))
    out = cached.generate(toy_request())
    assert _hits(out.metrics["plugins"]["fbcache"]) > 0
    assert not torch.equal(completed_latents(out), baseline)
    assert torch.equal(completed_latents(cached.generate(toy_request(exact=True))), baseline)
    assert torch.equal(completed_latents(cached.generate(toy_request(plugin_params={"fbcache": {"threshold": 0.0}}))), baseline)


def test_runtime_interleaved_executions_equal_each_alone(runtimes: tuple[Any, Any]) -> None:
    _, cached = runtimes
    reqs = [toy_request(seed=3), toy_request(seed=4, steps=12, plugin_params={"fbcache": {"threshold": 0.3}})]
    check_interleaved_equal_alone(cached, reqs, "fbcache")


def test_conformance_kit() -> None:
    conformance = pytest.importorskip("omniloop.testing.conformance")
    conformance.check_block_interceptor(lambda: FirstBlockCache({"threshold": 0.2, "warmup_steps": 2}))
