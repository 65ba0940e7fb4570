"""The ``adapters`` mechanism (``omniloop_register_mechanisms``, hook API 1.4): a deploy's LoRA
``adapters`` (and ``adapter_fuse``) checked before any weight loads, requests' ``adapters`` checked
against them, the bank read and hooked on the loaded model (before offload), and
``Runtime.update_weights(source, adapter=NAME)``. Imports no torch until a deployment asks."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omniloop.family import Mechanism, MechanismSpec
from omniloop.hookspecs import hookimpl

OMNILOOP_HOOK_API = ">=1.4,<2"  # omniloop_register_mechanisms


def _check(deployment: Any) -> None:
    from .lora import check_declared

    check_declared(deployment.deploy.adapters, deployment.deploy.adapter_fuse, deployment.family)


def _check_request(deployment: Any, request: Any) -> None:
    from .lora import check_request

    bank = deployment.mechanisms.get("adapters")  # a runtime's table grows with update_weights(adapter=)
    table = bank.declared if bank is not None else deployment.deploy.adapters
    check_request(request.adapters, table, deployment.deploy.adapter_fuse)


def _bank(runtime: Any, declared: Mapping[str, str], fuse: Mapping[str, float] | None = None) -> Any:
    from .lora import AdapterBank

    return AdapterBank(declared, runtime.model.components, runtime.capabilities.adapters,
                       max_loaded=runtime.deploy.limits.max_adapters, fuse=fuse, model=runtime.model,
                       options=runtime.options)


def _install(runtime: Any) -> Mechanism | None:
    d = runtime.deploy
    return _bank(runtime, d.adapters, d.adapter_fuse) if d.adapters else None


def _update(runtime: Any, name: str, source: Any) -> Callable[[], None]:
    """``Runtime.update_weights(source, adapter=name)``: the adapter read and checked now (one
    ``WeightUpdateError`` naming the field); the returned function registers it."""
    from omniloop.errors import DeployError
    from omniloop.weights import WeightUpdateError

    from .lora import NAME_PATTERN, load_adapter

    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise WeightUpdateError("adapter", "an adapter name is 1-64 letters, digits or _ . : @ + = -")
    support = runtime.capabilities.adapters
    if support is None:
        raise WeightUpdateError("adapter", f"family {runtime.family.name!r} does not support LoRA adapters")
    if isinstance(source, Mapping):
        raise WeightUpdateError("source", "a LoRA adapter is given as a safetensors file or folder")
    if not isinstance(source, (str, os.PathLike)):
        raise WeightUpdateError("source", f"expected a safetensors file or folder, got {type(source).__name__}")
    try:
        loaded = load_adapter(name, Path(source), runtime.model.components, support)
    except DeployError as exc:
        raise WeightUpdateError("source", str(exc)) from None

    def register() -> None:
        if runtime.adapters is None:
            runtime.mechanisms["adapters"] = _bank(runtime, {})
        runtime.adapters.register(name, str(source), loaded)

    return register


MECHANISM = MechanismSpec(name="adapters", check=_check, check_request=_check_request, install=_install,
                          update=_update, order=10,
                          description="LoRA adapters declared by the deploy, chosen per request, applied unfused")


@hookimpl
def omniloop_register_mechanisms(register: Any) -> None:
    register(MECHANISM)
