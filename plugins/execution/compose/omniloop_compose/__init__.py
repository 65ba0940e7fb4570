"""omniloop-compose: composed deployments: several models, one request, a pipeline whose nodes are
families' pipelines (moved out of the core, where it was ``omniloop.compose``: issue 34). Its runtime
loader (``omniloop_compose.plugin``) is what ``Runtime.from_deploy`` hands a ``pipeline:`` deploy to.
The module :mod:`omniloop_compose.composed` holds the code and its full description.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .composed import (
        PIPELINE_KIND,
        ComposedDeployment,
        ComposedNode,
        ComposedRuntime,
        CompositionSpec,
        RoleSpec,
        is_composed,
    )

__all__ = ["PIPELINE_KIND", "ComposedDeployment", "ComposedNode", "ComposedRuntime", "CompositionSpec", "RoleSpec",
           "is_composed"]


def __getattr__(name: str) -> Any:
    # imported on first use: loading the plugin (omniloop --help) imports neither the runtime nor torch (issue 42)
    if name in __all__:
        from . import composed

        value = getattr(composed, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
