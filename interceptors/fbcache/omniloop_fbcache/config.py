"""What a deploy may set (``FBCacheConfig``) and what a request may tune (``FBCacheParams``).

Ranges live in field metadata (``ge`` / ``le``): the runtime's converter checks them and names
the dotted path of a bad value (``plugin_params.fbcache.threshold: must be <= 1.0, got 3``).
"""

from __future__ import annotations

import attrs
from attrs import define, field


@define(frozen=True)
class FBCacheConfig:
    """Deploy config: ``plugins: {fbcache: {threshold: 0.08, ...}}``."""

    #: reuse the cached residual while the first block's residual changed less than this
    #: (relative L1: mean|r_t - r_ref| / mean|r_ref|); 0 computes every step
    threshold: float = field(default=0.08, metadata={"ge": 0.0, "le": 1.0})
    #: first loop steps that always compute
    warmup_steps: int = field(default=2, metadata={"ge": 0, "le": 10_000})
    #: most consecutive cached steps before a forced compute (-1: no limit)
    max_consecutive_cached: int = field(default=-1, metadata={"ge": -1, "le": 10_000})


@define(frozen=True)
class FBCacheParams:
    """Per-request tuning (``request.plugin_params["fbcache"]``); ``None`` keeps the deploy's value."""

    threshold: float | None = field(default=None, metadata={"ge": 0.0, "le": 1.0})
    warmup_steps: int | None = field(default=None, metadata={"ge": 0, "le": 10_000})
    max_consecutive_cached: int | None = field(default=None, metadata={"ge": -1, "le": 10_000})


def resolve(config: FBCacheConfig, params: FBCacheParams | None) -> FBCacheConfig:
    """The settings one request runs with."""
    if params is None:
        return config
    changes = {a.name: getattr(params, a.name) for a in attrs.fields(FBCacheParams)}
    return attrs.evolve(config, **{k: v for k, v in changes.items() if v is not None})
