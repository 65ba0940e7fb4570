"""The ``offload`` mechanism (``omniloop_register_mechanisms``, hook API 1.4): checks a deploy's
``offload: model | sequential`` before any weight loads (first: it names what it does not combine
with, LoRA adapters among them), has the family load into host memory and installs the offloader on
the loaded model. Imports no torch until a deployment asks."""

from __future__ import annotations

from typing import Any

from omniloop.family import Mechanism, MechanismSpec
from omniloop.hookspecs import hookimpl

OMNILOOP_HOOK_API = ">=1.4,<2"  # omniloop_register_mechanisms


def _check(deployment: Any) -> None:
    from .offload import check_offload

    options = {**deployment.preset_options, **deployment.deploy.options}
    check_offload(deployment.deploy, deployment.family, deployment.device, options)


def _storage_device(deploy: Any, device: Any) -> Any:
    from .offload import storage_device

    return storage_device(deploy.offload, device)


def _install(runtime: Any) -> Mechanism | None:
    from .offload import install

    return install(runtime.model, runtime.family, runtime.deploy.offload, runtime.device)


MECHANISM = MechanismSpec(name="offload", check=_check, storage_device=_storage_device, install=_install, order=0,
                          description="offload: model | sequential — components moved to the GPU as nodes run")


@hookimpl
def omniloop_register_mechanisms(register: Any) -> None:
    register(MECHANISM)
