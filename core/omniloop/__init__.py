"""omniloop: an inference runtime for diffusion and omni models.

The public API::

    from omniloop import Runtime, OmniRequest, TaskType
    rt = Runtime.from_model("wan-demo")
    out = rt.generate({"task": "t2v", "prompt": "a blue square moving right"})
    out.artifacts["video"].frames   # uint8 [T, H, W, 3]

See CONTRIBUTING.md for the layout and how to write a plugin.
"""

from __future__ import annotations

from .artifacts import Artifact, Audio, Conditioning, Embeddings, Image, KVRef, Latents, Tensors, Text, VideoFrames
from .deploy import DeployConfig, Limits, ModelConfig, load_deploy
from .errors import CheckpointError, DeployError, GraphError, OmniloopError, PluginError, RequestError
from .execution import Execution
from .graph import Node, PipelineSpec
from .hookspecs import HOOK_API_VERSION, hookimpl
from .interceptors import BlockContext, BlockInterceptor, StepInterceptor, call_model, run_blocks
from .loop import LoopStage, LoopState, RequestState, Stage, StageContext, StepContext, StepResult
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
from .runtime import Runtime

__version__ = "0.1.0"

__all__ = [
    "HOOK_API_VERSION", "Artifact", "Audio", "BlockContext", "BlockInterceptor", "CheckpointError",
    "Conditioning", "DeployConfig", "DeployError", "DiffusionParams", "Embeddings", "Execution",
    "GraphError", "Image", "ImagePart", "KVRef", "Latents", "Limits", "LoopStage", "LoopState",
    "ModelConfig", "Node", "OmniEvent", "OmniOutput", "OmniRequest", "OmniloopError", "OutputSpec",
    "PipelineSpec", "PluginError", "RequestError", "RequestState", "Runtime", "Stage", "StageContext",
    "Status", "StepContext", "StepInterceptor", "StepResult", "TaskType", "Tensors", "Text", "TextPart",
    "VideoFrames", "call_model", "hookimpl", "load_deploy", "run_blocks",
]
