"""Entry point of omniloop-compose: the runtime loader of composed deploys (``pipeline`` + ``models``)."""

from __future__ import annotations

from typing import Any

from omniloop.family import RuntimeLoaderSpec
from omniloop.hookspecs import hookimpl

OMNILOOP_HOOK_API = ">=1.3,<2"  # omniloop_register_runtime_loaders


def _load(deploy: Any, *, manager: Any = None) -> Any:
    from .composed import ComposedRuntime

    return ComposedRuntime(deploy, manager=manager)


def _deployment(deploy: Any, *, manager: Any = None) -> Any:
    from .composed import ComposedDeployment

    return ComposedDeployment(deploy, manager=manager)


def _claims(deploy: Any) -> bool:
    return deploy.pipeline is not None or bool(deploy.models)


#: what ``Runtime.from_deploy`` hands a composed deploy to
LOADER = RuntimeLoaderSpec(name="compose", fields=("pipeline", "models"), claims=_claims, load=_load,
                           deployment=_deployment, description="composed pipelines: one runtime per role")


@hookimpl
def omniloop_register_runtime_loaders(register: Any) -> None:
    register(LOADER)
