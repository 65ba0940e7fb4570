"""The cache-dit interceptor through omniloop's runtime, on the toy family (CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import omniloop_cache_dit.plugin as cache_dit_plugin
from omniloop.errors import RequestError
from omniloop.request import Status
from omniloop.testing import check_interleaved_equal_alone, completed_latents, toy_request, toy_runtime

SETTINGS = {"Fn": 1, "Bn": 1, "residual_diff_threshold": 0.2, "max_warmup_steps": 2}




def _contexts(rt: Any) -> int:
    icpt = rt.components_enabled["cache-dit"][1]
    return sum(len(m._cached_context_manager) for m in icpt._registry.managers())


@pytest.fixture
def runtimes(toy_checkpoint: Path) -> tuple[Any, Any]:
    plain = toy_runtime(toy_checkpoint)
    cached = toy_runtime(toy_checkpoint, ("cache-dit", cache_dit_plugin), plugins={"cache-dit": SETTINGS})
    return plain, cached


def test_enabled_in_deploy_caches_and_reports_per_branch_metrics(runtimes: tuple[Any, Any]) -> None:
    plain, cached = runtimes
    baseline = completed_latents(plain.generate(toy_request()))
    out = cached.generate(toy_request())
    stats = out.metrics["plugins"]["cache-dit"]
    assert set(stats) == {"cond", "uncond"}
    assert sum(s["num_cached_steps"] for s in stats.values()) > 0
    assert not torch.equal(completed_latents(out), baseline)
    assert _contexts(cached) == 0
    # the same runtime without caching for one request: exact again (threshold 0), then caching again
    tuned = cached.generate(toy_request(plugin_params={"cache-dit": {"residual_diff_threshold": 0.0}}))
    assert torch.equal(completed_latents(tuned), baseline)
    assert torch.equal(completed_latents(cached.generate(toy_request())), completed_latents(out))


def test_exact_request_bypasses_the_interceptor(runtimes: tuple[Any, Any]) -> None:
    plain, cached = runtimes
    baseline = completed_latents(plain.generate(toy_request()))
    out = cached.generate(toy_request(exact=True))
    assert torch.equal(completed_latents(out), baseline)
    assert "cache-dit" not in out.metrics.get("plugins", {})
    with pytest.raises(RequestError, match=r"plugin_params\.cache-dit"):
        cached.prepare(toy_request(exact=True, plugin_params={"cache-dit": {"Fn": 2}}))


def test_invalid_request_params_are_refused_before_compute(runtimes: tuple[Any, Any]) -> None:
    _, cached = runtimes
    with pytest.raises(RequestError) as err:
        cached.prepare(toy_request(plugin_params={"cache-dit": {"max_warmup_steps": -3}}))
    assert err.value.path == "plugin_params.cache-dit.max_warmup_steps"


def test_request_params_reach_open(runtimes: tuple[Any, Any]) -> None:
    _, cached = runtimes
    out = cached.generate(toy_request(plugin_params={"cache-dit": {"max_warmup_steps": 12, "taylorseer": True}}))
    cond = out.metrics["plugins"]["cache-dit"]["cond"]
    assert cond["settings"] == "F1B1_W12_M-1_MC-1_R0.2_T1"
    assert all(s >= 12 for s in cond["cached_steps"])


def test_interleaved_executions_equal_each_alone(runtimes: tuple[Any, Any]) -> None:
    _, cached = runtimes
    reqs = [toy_request(seed=3), toy_request(seed=4, steps=14, plugin_params={"cache-dit": {"residual_diff_threshold": 0.3}})]
    check_interleaved_equal_alone(cached, reqs, "cache-dit")
    assert _contexts(cached) == 0


def test_cancel_mid_loop_releases_contexts(runtimes: tuple[Any, Any]) -> None:
    _, cached = runtimes
    ex = cached.prepare(toy_request())
    while ex.loop is None or ex.loop.step < 5:
        ex.advance()
    assert _contexts(cached) == 2
    ex.cancel()
    while not ex.done:
        ex.advance()
    assert ex.output.status is Status.CANCELLED
    assert _contexts(cached) == 0
