"""Packaging and registration of omniloop-cache-dit."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from typing import Any

import attrs
import pytest

import omniloop_cache_dit.plugin as plugin
from omniloop.family import PluginComponentSpec
from omniloop_cache_dit import CacheDiTConfig, CacheDiTParams

FIELDS = [
    "Fn",
    "Bn",
    "residual_diff_threshold",
    "max_warmup_steps",
    "max_cached_steps",
    "max_continuous_cached_steps",
    "taylorseer",
    "taylorseer_order",
]


def test_entry_point_is_declared() -> None:
    eps = [e for e in importlib.metadata.entry_points(group="omniloop.plugins") if e.name == "cache-dit"]
    assert len(eps) == 1 and eps[0].value == "omniloop_cache_dit.plugin"
    assert eps[0].load() is plugin
    assert plugin.OMNILOOP_HOOK_API == ">=1.0,<2"


def test_registers_one_block_interceptor_spec() -> None:
    got: list[Any] = []
    plugin.omniloop_register_interceptors(got.append)
    (spec,) = got
    assert isinstance(spec, PluginComponentSpec)
    assert (spec.name, spec.kind, spec.distribution_altering) == ("cache-dit", "block_interceptor", True)
    assert spec.config_schema is CacheDiTConfig and spec.params_schema is CacheDiTParams
    icpt = spec.factory(CacheDiTConfig(Fn=2))
    assert icpt.name == "cache-dit" and icpt.config.Fn == 2


def test_discovered_by_the_plugin_manager() -> None:
    from omniloop.plugins import PluginManager

    pm = PluginManager()
    reg = pm.registry()
    assert "cache-dit" in reg.interceptors


def test_schemas_have_exactly_the_documented_fields() -> None:
    assert [f.name for f in attrs.fields(CacheDiTConfig)] == FIELDS
    assert [f.name for f in attrs.fields(CacheDiTParams)] == FIELDS
    assert all(f.default is None for f in attrs.fields(CacheDiTParams))
    # defaults are cache-dit's own DBCacheConfig defaults
    c = CacheDiTConfig()
    assert (
        c.Fn,
        c.Bn,
        c.residual_diff_threshold,
        c.max_warmup_steps,
        c.max_cached_steps,
        c.max_continuous_cached_steps,
        c.taylorseer,
        c.taylorseer_order,
    ) == (8, 0, 0.08, 8, -1, -1, False, 1)


@pytest.mark.parametrize("cls", [CacheDiTConfig, CacheDiTParams])
def test_structured_by_the_core_converter(cls: type) -> None:
    from omniloop.errors import RequestError
    from omniloop.schema import structure_params

    obj = structure_params(cls, {"Fn": 4, "taylorseer": True}, "plugins.cache-dit")
    assert obj.Fn == 4 and obj.taylorseer is True
    with pytest.raises(RequestError, match=r"plugins\.cache-dit\.taylorseer_order"):
        structure_params(cls, {"taylorseer_order": 0}, "plugins.cache-dit")


def test_registration_does_not_import_cache_dit() -> None:
    """Registration hooks must be fast and offline: cache-dit (and diffusers) load only in the factory."""
    code = (
        "import sys, omniloop_cache_dit.plugin as p; got=[]; p.omniloop_register_interceptors(got.append); "
        "assert 'cache_dit' not in sys.modules and 'diffusers' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
