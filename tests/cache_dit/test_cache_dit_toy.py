"""The cache-dit interceptor on a toy residual block stack (CPU, fast)."""

from __future__ import annotations

import gc
import itertools
import threading
import time
from typing import Any

import pytest
import torch

from omniloop.errors import DeployError, PluginError, RequestError
from omniloop.interceptors import BlockContext
from omniloop.loop import LoopState, StepContext
from omniloop_cache_dit import CacheDiTConfig, CacheDiTInterceptor, CacheDiTParams
from omniloop_cache_dit._cachedit import CachedContextManager

SETTINGS = dict(Fn=1, Bn=1, residual_diff_threshold=0.1, max_warmup_steps=3)


def _hits(metrics: dict[str, Any]) -> int:
    return sum(m["num_cached_steps"] for m in metrics.values())


def _contexts(icpt: CacheDiTInterceptor) -> int:
    return sum(len(m._cached_context_manager) for m in icpt._registry.managers())


def test_is_a_block_interceptor_with_declared_capabilities() -> None:
    from omniloop.interceptors import BlockInterceptor

    icpt = CacheDiTInterceptor(SETTINGS)
    assert isinstance(icpt, BlockInterceptor)
    assert icpt.name == "cache-dit"
    assert icpt.distribution_altering is True and icpt.graph_safe is False and icpt.needs_eager is False


def test_baseline_enabled_disabled_after_enabled(toy_blocks: Any) -> None:
    model = toy_blocks.Model()
    params_before = {k: v.clone() for k, v in model.state_dict().items()}
    baseline, _ = toy_blocks.run_alone(model)
    icpt = CacheDiTInterceptor(SETTINGS)
    enabled, metrics = toy_blocks.run_alone(model, icpt)
    disabled, _ = toy_blocks.run_alone(model)

    assert _hits(metrics) > 0
    assert not torch.equal(enabled, baseline)
    assert (enabled - baseline).abs().max() < 0.1  # an approximation, not garbage
    assert torch.equal(disabled, baseline)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in params_before.items())
    assert _contexts(icpt) == 0


def test_threshold_zero_request_computes_every_step_exactly(toy_blocks: Any) -> None:
    model = toy_blocks.Model()
    baseline, _ = toy_blocks.run_alone(model)
    icpt = CacheDiTInterceptor(SETTINGS)
    out, metrics = toy_blocks.run_alone(model, icpt, params={"residual_diff_threshold": 0.0})
    assert _hits(metrics) == 0
    assert torch.equal(out, baseline)
    # the next, untuned request caches again: params are per request
    _, metrics = toy_blocks.run_alone(model, icpt)
    assert _hits(metrics) > 0


@pytest.mark.parametrize(
    "settings",
    [
        SETTINGS,
        dict(Fn=2, Bn=2, residual_diff_threshold=0.15, max_warmup_steps=2, taylorseer=True, taylorseer_order=2),
        dict(Fn=1, Bn=0, residual_diff_threshold=0.2, max_warmup_steps=2, max_continuous_cached_steps=2),
    ],
    ids=["F1B1", "F2B2-taylorseer2", "F1B0-MC2"],
)
def test_interleaved_requests_equal_each_alone(toy_blocks: Any, settings: dict[str, Any]) -> None:
    model = toy_blocks.Model()
    icpt = CacheDiTInterceptor(settings)
    kw_a = dict(request_id="a", seed=1, steps=20)
    kw_b = dict(request_id="b", seed=2, steps=16, params={"residual_diff_threshold": 0.12})
    alone_a, met_a = toy_blocks.run_alone(model, icpt, **kw_a)
    alone_b, met_b = toy_blocks.run_alone(model, icpt, **kw_b)
    assert _hits(met_a) > 0 and _hits(met_b) > 0

    a, b = toy_blocks.Run(model, icpt, **kw_a), toy_blocks.Run(model, icpt, **kw_b)
    for _ in range(5):  # b starts late
        a.step()
    toy_blocks.interleave([a, b])
    assert torch.equal(a.x, alone_a) and torch.equal(b.x, alone_b)
    assert a.close() == met_a and b.close() == met_b
    assert _contexts(icpt) == 0


def test_same_request_id_twice_does_not_share_state(toy_blocks: Any) -> None:
    model = toy_blocks.Model()
    icpt = CacheDiTInterceptor(SETTINGS)
    alone, _ = toy_blocks.run_alone(model, icpt, request_id="dup", seed=3)
    a, b = toy_blocks.Run(model, icpt, request_id="dup", seed=3), toy_blocks.Run(model, icpt, request_id="dup", seed=4)
    toy_blocks.interleave([a, b])
    assert torch.equal(a.x, alone)
    a.close(), b.close()


def test_requests_in_two_threads_equal_each_alone(toy_blocks: Any) -> None:
    model = toy_blocks.Model()
    icpt = CacheDiTInterceptor(SETTINGS)
    seeds = (5, 6, 7, 8)
    alone = [toy_blocks.run_alone(model, icpt, request_id=f"t{s}", seed=s)[0] for s in seeds]
    results: dict[int, torch.Tensor] = {}

    def work(s: int) -> None:
        results[s] = toy_blocks.run_alone(model, icpt, request_id=f"t{s}", seed=s)[0]

    threads = [threading.Thread(target=work, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(results[s], ref) for s, ref in zip(seeds, alone, strict=True))


def test_context_selection_is_exclusive_across_threads(toy_blocks: Any) -> None:
    """cache-dit keeps one "current context" per manager: a second thread waits for the first."""
    model = toy_blocks.Model()
    icpt = CacheDiTInterceptor(SETTINGS)
    ra, rb = toy_blocks.Run(model, icpt, request_id="a"), toy_blocks.Run(model, icpt, request_id="b")
    ra.step(), rb.step()
    ((_, mgr),) = [icpt._registry.get(model.blocks)]
    name_a = ra.loop.plugin_state[(icpt.name, "cond")].contexts[tuple(map(id, model.blocks))].name
    name_b = rb.loop.plugin_state[(icpt.name, "cond")].contexts[tuple(map(id, model.blocks))].name
    entered, release, seen = threading.Event(), threading.Event(), []

    def first() -> None:
        with mgr.selected(name_a):
            entered.set()
            release.wait(5)
            seen.append(("a", mgr.get_context().name))

    def second() -> None:
        entered.wait(5)
        with mgr.selected(name_b):
            seen.append(("b", mgr.get_context().name))

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    release.set()
    for t in threads:
        t.join()
    assert seen == [("a", name_a), ("b", name_b)]
    ra.close(), rb.close()


def test_metrics_report_loop_steps_and_respect_limits(toy_blocks: Any) -> None:
    model = toy_blocks.Model()
    icpt = CacheDiTInterceptor(
        dict(
            Fn=1,
            Bn=1,
            residual_diff_threshold=0.5,
            max_warmup_steps=4,
            max_cached_steps=6,
            max_continuous_cached_steps=2,
        )
    )
    _, metrics = toy_blocks.run_alone(model, icpt, steps=20)
    for br in ("cond", "uncond"):
        m = metrics[br]
        cached = m["cached_steps"]
        assert m["branch"] == br and m["forwards"] == 20
        assert m["num_cached_steps"] == len(cached) == 6  # max_cached_steps
        assert m["computed_steps"] == 14
        assert min(cached) >= 4  # warmup
        runs = [1]
        for prev, cur in itertools.pairwise(cached):
            runs.append(runs[-1] + 1 if cur == prev + 1 else 1)
        assert max(runs) <= 2  # max_continuous_cached_steps
        assert set(m["residual_diffs"]) >= {str(s) for s in cached}
        assert all(float(m["residual_diffs"][str(s)]) < 0.5 for s in cached)
        assert m["settings"] == "F1B1_W4_M6_MC2_R0.5_T0"


def test_request_params_override_deploy_config(toy_blocks: Any) -> None:
    model = toy_blocks.Model()
    icpt = CacheDiTInterceptor(SETTINGS)
    _, metrics = toy_blocks.run_alone(model, icpt, params=CacheDiTParams(max_warmup_steps=10, Fn=2))
    assert metrics["cond"]["settings"].startswith("F2B1_W10")
    assert min(metrics["cond"]["cached_steps"], default=10) >= 10


@pytest.mark.parametrize(
    "params, path",
    [
        ({"Fn": 0}, "plugin_params.cache-dit.Fn"),
        ({"residual_diff_threshold": 2.0}, "plugin_params.cache-dit.residual_diff_threshold"),
        ({"taylorseer_order": 9}, "plugin_params.cache-dit.taylorseer_order"),
        ({"max_cached_steps": -2}, "plugin_params.cache-dit.max_cached_steps"),
        ({"nope": 1}, "plugin_params.cache-dit.nope"),
    ],
)
def test_invalid_request_params_are_refused_with_their_path(toy_blocks: Any, params: dict[str, Any], path: str) -> None:
    with pytest.raises(RequestError) as err:
        toy_blocks.Run(toy_blocks.Model(), CacheDiTInterceptor(SETTINGS), params=params)
    assert err.value.path == path


def test_invalid_deploy_config_is_a_deploy_error() -> None:
    with pytest.raises(DeployError, match=r"plugins\.cache-dit\.Bn"):
        CacheDiTInterceptor({"Bn": -1})
    with pytest.raises(DeployError, match=r"plugins\.cache-dit\.Fn"):
        CacheDiTInterceptor(CacheDiTConfig(Fn=0))


def test_fn_plus_bn_larger_than_the_stack_is_refused(toy_blocks: Any) -> None:
    run = toy_blocks.Run(toy_blocks.Model(n_blocks=4), CacheDiTInterceptor(dict(Fn=3, Bn=2)))
    with pytest.raises(PluginError, match="exceeds the 4 blocks"):
        run.step()
    run.close()


def test_run_without_open_is_a_clear_error(toy_blocks: Any) -> None:
    model = toy_blocks.Model()
    icpt = CacheDiTInterceptor(SETTINGS)
    loop = LoopState(total=4)
    ctx = BlockContext(step=StepContext("x", "denoise", 0, 4, 1.0, branch="cond"), loop=loop, interceptor=icpt)
    with pytest.raises(PluginError, match="open"):
        model(torch.zeros(1, toy_blocks.TOKENS, toy_blocks.DIM), 1.0, "cond", ctx)


def test_close_removes_contexts_and_is_idempotent(toy_blocks: Any) -> None:
    model = toy_blocks.Model()
    icpt = CacheDiTInterceptor(SETTINGS)
    run = toy_blocks.Run(model, icpt)
    run.step()
    assert _contexts(icpt) == 2  # one per branch
    states = [run.loop.plugin_state[(icpt.name, b)] for b in run.loop.branches]
    before = [icpt.metrics(s) for s in states]
    for s in states:
        icpt.close(s)
        icpt.close(s)
    assert _contexts(icpt) == 0
    assert [icpt.metrics(s) for s in states] == before  # metrics survive close
    with pytest.raises(PluginError, match="after close"):
        run.step()


def test_state_dropped_without_close_frees_its_context(toy_blocks: Any) -> None:
    model = toy_blocks.Model()
    icpt = CacheDiTInterceptor(SETTINGS)
    run = toy_blocks.Run(model, icpt)
    run.step()
    assert _contexts(icpt) == 2
    del run
    gc.collect()
    assert _contexts(icpt) == 0


def test_one_context_per_block_list_within_a_branch(toy_blocks: Any) -> None:
    """Two experts (Wan2.2-style) get separate contexts: residuals of different stacks never compare."""
    high, low = toy_blocks.Model(seed=0), toy_blocks.Model(seed=1)
    icpt = CacheDiTInterceptor(SETTINGS)
    loop = LoopState(total=8, branches=("cond",))
    loop.plugin_state[(icpt.name, "cond")] = state = icpt.open(StepContext("moe", "denoise", 0, 8, 1.0, "cond"), loop)
    x = torch.randn(1, toy_blocks.TOKENS, toy_blocks.DIM)
    with torch.no_grad():
        for i in range(8):
            model = high if i < 4 else low
            sc = StepContext("moe", "denoise", i, 8, 1.0 - i / 8, branch="cond")
            x = x - model(x, 1.0 - i / 8, "cond", BlockContext(step=sc, loop=loop, interceptor=icpt)) / 8
    assert len(state.contexts) == 2 and len(icpt._registry.managers()) == 2
    icpt.close(state)
    assert _contexts(icpt) == 0


def test_manager_is_a_subclass_not_a_patch() -> None:
    from omniloop_cache_dit.manager import OmniloopContextManager

    assert issubclass(OmniloopContextManager, CachedContextManager)
    assert "similarity" in OmniloopContextManager.__dict__
    # the library class itself is untouched
    assert CachedContextManager.similarity.__qualname__ == "CachedContextManager.similarity"
