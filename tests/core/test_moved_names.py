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
    ("omniloop.weights", "checksum", "omniloop_rl.weights"),
    ("omniloop.weights", "plan_update", "omniloop_rl.weights"),
    ("omniloop.rl", "nft_loss", "omniloop_rl.trainer"),
    ("omniloop.rl", "step_log_prob", "omniloop_rl.trainer"),
    ("omniloop.rl", "replay_log_probs", "omniloop_rl.trainer"),
    ("omniloop.rl", "step_stats", "omniloop_policies.rollout"),
    ("omniloop.rl", "gaussian_log_prob", "omniloop_policies.rollout"),
    ("omniloop.placement", "check_in_pool", "omniloop_parallel.checks"),
    ("omniloop.streams", "EventStream", "omniloop_scheduler.streams"),
])
def test_a_moved_name_says_where_it_went(old_module: str, name: str, new_module: str) -> None:
    with pytest.raises(ImportError, match=new_module.replace(".", r"\.")):
        exec(f"from {old_module} import {name}", {})
    assert getattr(importlib.import_module(new_module), name) is not None


@pytest.mark.parametrize(("old_module", "name", "line"), [
    ("omniloop.offload", "Offloader", "omniloop.offload.Offloader moved to omniloop-offload (omniloop 0.2, issue 34): "
                                      "from omniloop_offload import Offloader (pip install omniloop-offload)"),
    ("omniloop.rl", "step_stats", "omniloop.rl.step_stats moved to omniloop-policies (omniloop 0.2, issue 34): "
                                  "from omniloop_policies.rollout import step_stats (pip install omniloop-policies)"),
])
def test_the_message_is_one_line_naming_the_import_and_the_package(old_module: str, name: str, line: str) -> None:
    with pytest.raises(ImportError) as info:
        exec(f"from {old_module} import {name}", {})
    assert str(info.value) == line


def test_a_name_that_never_existed_is_an_attribute_error() -> None:
    import omniloop.placement
    import omniloop.weights

    with pytest.raises(AttributeError):
        omniloop.weights.no_such_name  # noqa: B018
    with pytest.raises(ImportError, match="runtime loaders"):
        omniloop.placement.pool_factory  # noqa: B018


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


def test_a_mechanism_whose_plugin_is_missing_is_refused_naming_the_package(tmp_path) -> None:
    """The core keeps the deploy fields and runtime methods; without the plugin that serves one, one
    line names the package (the offload case: tests/core/test_offload.py)."""
    from omniloop.errors import DeployError, RequestError
    from omniloop.runtime import Deployment, Runtime
    from omniloop.testing import build_toy_checkpoint, make_manager, toy_request
    from omniloop.weights import WeightUpdateError

    ckpt = build_toy_checkpoint(tmp_path / "toy")
    with pytest.raises(DeployError, match=r"^adapters: no installed plugin serves this field: pip install omniloop-adapters$"):
        Deployment({"model": {"path": str(ckpt)}, "adapters": {"a": str(tmp_path / "a.safetensors")}}, manager=make_manager())
    dep = Deployment({"model": {"path": str(ckpt)}}, manager=make_manager())
    with pytest.raises(RequestError, match=r"^adapters\.0\.name: unknown adapter 'a' .*omniloop-adapters"):
        dep.check(toy_request(steps=2, adapters=[{"name": "a"}]))
    rt = Runtime({"model": {"path": str(ckpt)}}, manager=make_manager())
    with pytest.raises(WeightUpdateError, match=r"^source: needs the weights mechanism: pip install omniloop-rl$"):
        rt.update_weights({}, version="v2")
    with pytest.raises(WeightUpdateError, match=r"^algorithm: .*pip install omniloop-rl$"):
        rt.weights_checksum()
    with pytest.raises(WeightUpdateError, match=r"^adapter: .*pip install omniloop-adapters$"):
        rt.update_weights(str(tmp_path), version="v2", adapter="a")
