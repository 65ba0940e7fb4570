"""omniloop: an inference runtime for diffusion and omni models.

The public API::

    from omniloop import Runtime, OmniRequest, TaskType
    rt = Runtime.from_model("wan-demo")
    out = rt.generate({"task": "t2v", "prompt": "a blue square moving right"})
    out.artifacts["video"].frames   # uint8 [T, H, W, 3]

See CONTRIBUTING.md for the layout and how to write a plugin.
"""

from __future__ import annotations

import importlib
import os as _os
import sys as _sys
from typing import TYPE_CHECKING, Any

from .lazy import moved

if "torch" not in _sys.modules:
    # OpenMP's default busy-waiting makes torch's CPU thread pool spin against any other process on
    # the machine: on a shared 2-core box a 3 s demo generation was measured taking 130 s. Passive
    # waiting costs little when the machine is idle. Only effective before torch is first imported;
    # set OMP_WAIT_POLICY yourself to override.
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

#: the public names, by the module that defines them: imported on first use (PEP 562), so ``import
#: omniloop`` (and ``from omniloop.request import ...``) does not import torch — ``omniloop --help``
#: imports no torch (issue 42); ``from omniloop import Runtime`` works as it always did
_EXPORTS: dict[str, tuple[str, ...]] = {
    "artifacts": ("Artifact", "Audio", "Conditioning", "Embeddings", "Image", "KVRef", "Latents", "Tensors", "Text", "VideoFrames"),
    "cancel": ("check_cancelled",),
    "capabilities": ("FamilyCapabilities", "OffloadSupport", "ParallelSupport", "Rollout"),
    "context": ("LoopStage", "Stage", "StageContext"),
    "deploy": ("DeployConfig", "Limits", "ModelConfig", "load_deploy"),
    "errors": ("CheckpointError", "DeployError", "GraphError", "HookDeprecationWarning", "OmniloopError", "PluginError", "RequestError"),
    "execution": ("Execution",),
    "graph": ("Node", "PipelineSpec"),
    "hookspecs": ("HOOK_API_VERSION", "hookimpl"),
    "interceptors": ("BlockContext", "BlockInterceptor", "StepInterceptor", "call_model", "run_blocks"),
    "limits": ("ModelLimits",),
    "loop": ("LoopState", "RequestState", "StepContext", "StepResult"),
    "request": ("DiffusionParams", "ImagePart", "OmniEvent", "OmniOutput", "OmniRequest", "OutputSpec", "Status", "TaskType", "TextPart"),
    "resolved": ("GenericResolved", "Resolved", "Workload"),
    "runtime": ("Deployment", "Runtime", "check_request"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from .artifacts import Artifact, Audio, Conditioning, Embeddings, Image, KVRef, Latents, Tensors, Text, VideoFrames
    from .cancel import check_cancelled
    from .capabilities import FamilyCapabilities, OffloadSupport, ParallelSupport, Rollout
    from .context import LoopStage, Stage, StageContext
    from .deploy import DeployConfig, Limits, ModelConfig, load_deploy
    from .errors import (
        CheckpointError,
        DeployError,
        GraphError,
        HookDeprecationWarning,
        OmniloopError,
        PluginError,
        RequestError,
    )
    from .execution import Execution
    from .graph import Node, PipelineSpec
    from .hookspecs import HOOK_API_VERSION, hookimpl
    from .interceptors import BlockContext, BlockInterceptor, StepInterceptor, call_model, run_blocks
    from .limits import ModelLimits
    from .loop import LoopState, RequestState, StepContext, StepResult
    from .request import (
        DiffusionParams,
        ImagePart,
        OmniEvent,
        OmniOutput,
        OmniRequest,
        OutputSpec,
        Status,
        TaskType,
        TextPart,
    )
    from .resolved import GenericResolved, Resolved, Workload
    from .runtime import Deployment, Runtime, check_request


#: public names that moved out of the core (issue 34)
_MOVED = ("CacheFull", "CacheManager", "KVHandle", "KVLayout")
_moved = moved(__name__, dict.fromkeys(_MOVED, "omniloop_kvcache"))


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return _moved(name)
    module = _MODULE_OF.get(name)
    if module is None:  # a submodule not imported yet (``omniloop.runtime``)
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


__version__ = "0.1.0"

__all__ = [
    "HOOK_API_VERSION",
    "Artifact",
    "Audio",
    "BlockContext",
    "BlockInterceptor",
    "CheckpointError",
    "Conditioning",
    "DeployConfig",
    "DeployError",
    "Deployment",
    "DiffusionParams",
    "Embeddings",
    "Execution",
    "FamilyCapabilities",
    "GenericResolved",
    "GraphError",
    "HookDeprecationWarning",
    "Image",
    "ImagePart",
    "KVRef",
    "Latents",
    "Limits",
    "LoopStage",
    "LoopState",
    "ModelConfig",
    "ModelLimits",
    "Node",
    "OffloadSupport",
    "OmniEvent",
    "OmniOutput",
    "OmniRequest",
    "OmniloopError",
    "OutputSpec",
    "ParallelSupport",
    "PipelineSpec",
    "PluginError",
    "RequestError",
    "RequestState",
    "Resolved",
    "Rollout",
    "Runtime",
    "Stage",
    "StageContext",
    "Status",
    "StepContext",
    "StepInterceptor",
    "StepResult",
    "TaskType",
    "Tensors",
    "Text",
    "TextPart",
    "VideoFrames",
    "Workload",
    "call_model",
    "check_cancelled",
    "check_request",
    "hookimpl",
    "load_deploy",
    "run_blocks",
]
