"""Names that moved out of the core (issue 34) fail with one message naming their new import, and
work from there; the core itself imports none of those packages."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize(("old_module", "name", "new_module"), [
    ("omniloop", "CacheManager", "omniloop_kvcache"),
    ("omniloop.kvcache", "CacheManager", "omniloop_kvcache"),
    ("omniloop.compose", "ComposedRuntime", "omniloop_compose"),
    ("omniloop.compose", "CompositionSpec", "omniloop_compose"),
    ("omniloop.placement", "check_parallel", "omniloop_parallel.checks"),
    ("omniloop.placement", "role_device", "omniloop_parallel.checks"),
    ("omniloop.checkpoints", "resolve_root", "omniloop_kit.checkpoints"),
    ("omniloop.compile", "compile_blocks", "omniloop_kit.compile"),
    ("omniloop.adapters", "AdapterBank", "omniloop_adapters"),
    ("omniloop.adapters", "load_adapter", "omniloop_adapters"),
    ("omniloop.offload", "Offloader", "omniloop_offload"),
    ("omniloop.offload", "install", "omniloop_offload"),
    ("omniloop.placement", "check_offload", "omniloop_offload"),
    ("omniloop.testing.offload", "offload_run", "omniloop_offload.testing"),
    ("omniloop.media", "write_mp4", "omniloop_io.media"),
    ("omniloop.media", "AUDIO_FORMATS", "omniloop_io.media"),
    ("omniloop.jsonschema", "request_schema", "omniloop_io.jsonschema"),
])
def test_a_moved_name_says_where_it_went(old_module: str, name: str, new_module: str) -> None:
    with pytest.raises(ImportError, match=new_module.replace(".", r"\.")):
        exec(f"from {old_module} import {name}", {})
    assert getattr(importlib.import_module(new_module), name) is not None


def test_a_moved_module_still_answers_dunder_probes() -> None:
    import omniloop.compose
    import omniloop.kvcache

    assert not hasattr(omniloop.compose, "__wrapped__") and not hasattr(omniloop.kvcache, "__wrapped__")


def test_names_that_stayed_still_import() -> None:
    from omniloop.checkpoints import read_safetensors
    from omniloop.placement import AXES, check_attention_grid, check_transport

    assert AXES and callable(check_attention_grid) and callable(check_transport)
    assert callable(read_safetensors)


def test_the_adapter_declaration_still_imports_from_its_old_home() -> None:
    """A family's LoRA declaration is the core's family contract (``omniloop.capabilities``); its
    old import (``omniloop.adapters``) still works for this release."""
    from omniloop.adapters import AdapterFormatError, AdapterSupport, unknown_keys_error
    from omniloop.capabilities import AdapterSupport as declared

    assert AdapterSupport is declared and issubclass(AdapterFormatError, ValueError) and callable(unknown_keys_error)
