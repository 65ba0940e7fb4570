"""Deploy config and per-request params of the ``cache-dit`` interceptor.

Range constraints live in field metadata (``ge`` / ``le``), the convention of
:mod:`omniloop.request`, so the runtime's converter names the dotted path of a bad field;
``omniloop.schema.check_ranges`` applies the same metadata to objects built directly in Python.
"""

from __future__ import annotations

from typing import Any

import attrs
from attrs import define, field

#: cache-dit's own DBCacheConfig defaults (F8B0, R0.08, W8, unlimited cached steps)
DEFAULTS: dict[str, Any] = {
    "Fn": 8,
    "Bn": 0,
    "residual_diff_threshold": 0.08,
    "max_warmup_steps": 8,
    "max_cached_steps": -1,
    "max_continuous_cached_steps": -1,
    "taylorseer": False,
    "taylorseer_order": 1,
}

_RANGES: dict[str, dict[str, Any]] = {
    # Fn >= 1: the Fn residual is what the cache decision compares (cache-dit asserts it too)
    "Fn": {"ge": 1, "le": 512},
    "Bn": {"ge": 0, "le": 512},
    # 0 disables caching (every step computes); 1 caches every eligible step (cache-dit's
    # "always similar" special case)
    "residual_diff_threshold": {"ge": 0.0, "le": 1.0},
    "max_warmup_steps": {"ge": 0, "le": 10_000},
    # -1 = unlimited
    "max_cached_steps": {"ge": -1, "le": 10_000},
    "max_continuous_cached_steps": {"ge": -1, "le": 10_000},
    "taylorseer_order": {"ge": 1, "le": 4},
}


def _f(name: str, default: Any, doc: str) -> Any:
    meta = dict(_RANGES.get(name, {}))
    meta["doc"] = doc
    return field(default=default, metadata=meta)


_DOCS = {
    "Fn": "first blocks always computed; their residual decides whether to reuse the cache",
    "Bn": "last blocks always computed, refining the cached approximation",
    "residual_diff_threshold": "relative L1 change of the Fn residual below which the middle blocks are skipped",
    "max_warmup_steps": "first steps that always compute",
    "max_cached_steps": "most cached steps per request and branch (-1: no limit)",
    "max_continuous_cached_steps": "most consecutive cached steps (-1: no limit)",
    "taylorseer": "extrapolate the cached residual with TaylorSeer instead of reusing it as is",
    "taylorseer_order": "TaylorSeer derivative order (1 or 2 recommended)",
}


@define(frozen=True)
class CacheDiTConfig:
    """Deploy-time settings (``plugins: {cache-dit: {...}}``). Names follow cache-dit's F/B notation."""

    Fn: int = _f("Fn", DEFAULTS["Fn"], _DOCS["Fn"])
    Bn: int = _f("Bn", DEFAULTS["Bn"], _DOCS["Bn"])
    residual_diff_threshold: float = _f(
        "residual_diff_threshold", DEFAULTS["residual_diff_threshold"], _DOCS["residual_diff_threshold"]
    )
    max_warmup_steps: int = _f("max_warmup_steps", DEFAULTS["max_warmup_steps"], _DOCS["max_warmup_steps"])
    max_cached_steps: int = _f("max_cached_steps", DEFAULTS["max_cached_steps"], _DOCS["max_cached_steps"])
    max_continuous_cached_steps: int = _f(
        "max_continuous_cached_steps",
        DEFAULTS["max_continuous_cached_steps"],
        _DOCS["max_continuous_cached_steps"],
    )
    taylorseer: bool = _f("taylorseer", DEFAULTS["taylorseer"], _DOCS["taylorseer"])
    taylorseer_order: int = _f("taylorseer_order", DEFAULTS["taylorseer_order"], _DOCS["taylorseer_order"])


@define(frozen=True)
class CacheDiTParams:
    """Per-request tuning (``request.plugin_params["cache-dit"]``): every field optional.

    A field left ``None`` keeps the deploy's value. Tuning only: a request cannot enable the
    interceptor when the deploy did not (set ``residual_diff_threshold: 0`` to compute every step).
    """

    Fn: int | None = _f("Fn", None, _DOCS["Fn"])
    Bn: int | None = _f("Bn", None, _DOCS["Bn"])
    residual_diff_threshold: float | None = _f("residual_diff_threshold", None, _DOCS["residual_diff_threshold"])
    max_warmup_steps: int | None = _f("max_warmup_steps", None, _DOCS["max_warmup_steps"])
    max_cached_steps: int | None = _f("max_cached_steps", None, _DOCS["max_cached_steps"])
    max_continuous_cached_steps: int | None = _f(
        "max_continuous_cached_steps", None, _DOCS["max_continuous_cached_steps"]
    )
    taylorseer: bool | None = _f("taylorseer", None, _DOCS["taylorseer"])
    taylorseer_order: int | None = _f("taylorseer_order", None, _DOCS["taylorseer_order"])


def resolve(config: CacheDiTConfig, params: CacheDiTParams | None) -> CacheDiTConfig:
    """The settings one request runs with: the deploy's config overridden by the request's params."""
    if params is None:
        return config
    overrides = {a.name: getattr(params, a.name) for a in attrs.fields(CacheDiTParams)}
    return attrs.evolve(config, **{k: v for k, v in overrides.items() if v is not None})
