"""Test helpers for the cache-dit interceptor's parity tests (they run the cache-dit library itself
as the reference).

* :func:`library_configs` — the library's ``DBCacheConfig`` and ``TaylorSeerCalibratorConfig`` for
  our settings (the deploy's ``plugins.cache-dit`` block, merged with a request's params);
* :func:`cached_run` — a request through a runtime deploying cache-dit, checked to differ from its
  ``exact`` twin (which bypasses the interceptor).
"""

from __future__ import annotations

from typing import Any


def library_configs(settings: dict[str, Any], num_inference_steps: int | None = None) -> tuple[Any, Any]:
    """``(DBCacheConfig, TaylorSeerCalibratorConfig or None)`` of the cache-dit library for
    ``settings`` (``Fn``, ``Bn``, ``residual_diff_threshold``, ``max_warmup_steps``; optional
    ``max_cached_steps`` / ``max_continuous_cached_steps``, -1 = unlimited; ``taylorseer`` with
    ``taylorseer_order``); ``num_inference_steps`` for ``refresh_context``."""
    # cache-dit is imported only by _cachedit (tests/cache_dit/test_cache_dit_internals.py)
    from ._cachedit import cache_dit

    cache_config = cache_dit.DBCacheConfig(
        Fn_compute_blocks=settings["Fn"],
        Bn_compute_blocks=settings["Bn"],
        residual_diff_threshold=settings["residual_diff_threshold"],
        max_warmup_steps=settings["max_warmup_steps"],
        max_cached_steps=settings.get("max_cached_steps", -1),
        max_continuous_cached_steps=settings.get("max_continuous_cached_steps", -1),
        num_inference_steps=num_inference_steps,
    )
    calib = None
    if settings.get("taylorseer"):
        calib = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=settings["taylorseer_order"])
    return cache_config, calib


def cached_run(runtime: Any, request: dict[str, Any], exact_request: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``request`` through ``runtime`` (which deploys cache-dit) completes with at least one cached
    step in every guidance branch, and its latents differ from those of ``exact_request`` (an
    ``exact`` request bypasses the interceptor). Returns its final latents and its
    ``metrics["plugins"]["cache-dit"]`` (per branch)."""
    import torch

    out = runtime.generate(request)
    assert out.ok, out.error
    stats = out.metrics["plugins"]["cache-dit"]
    assert all(s["num_cached_steps"] > 0 for s in stats.values()), stats
    baseline = runtime.generate(exact_request)
    assert not torch.equal(out.artifacts["latents"].tensor, baseline.artifacts["latents"].tensor)
    return out.artifacts["latents"].tensor, stats
