"""``rollout: causal`` — the Wan pipeline that streams a video chunk by chunk.

Deploy::

    model: {path: ./wan-causal}
    options:
      rollout: causal                      # default: bidirectional (the ordinary Wan pipeline)
      rollout_options: {chunk_frames: 3, steps: 4, shift: 5.0, window: null, sink: 0,
                        context_timestep: 0.0, max_sessions: 4, session_ttl_s: 600, kv_slabs: 64}

Nodes: ``validate`` → ``rollout`` (cheap checks: chunk count, size, session; takes the node
params) → ``text_encode`` → ``chunks`` (a ``LoopStage``: one chunk per ``step()``, emitting the chunk's frames as a PARTIAL ``video_chunk`` artifact) →
the ``video`` artifact (every frame, at finalize).

A request's ``diffusion.frames`` (``4k+1`` as for every Wan request) fixes its chunks: its latent
frames ``(frames-1)/4+1`` must be a multiple of ``chunk_frames``; a first chunk gives
``1 + 4*(chunk_frames-1)`` frames, every later chunk ``4*chunk_frames``. ``diffusion.steps``
(else ``rollout_options.steps``) is the few-step sampler's steps per chunk.
``diffusion.guidance_scale`` (else ``rollout_options.guidance_scale``, default 1: none) other
than 1 runs classifier-free guidance per chunk against the negative prompt, the unconditional
branch with its own slabs (twice the slabs); a session keeps the CFG mode it started with.

The nodes, the deployment (engines per video size, their slab pools and sessions) and the
options are omniloop-kit's (:mod:`omniloop_kit.causal`); Wan's part is its engine
(:class:`~omniloop_wan.causal.rollout.CausalWan`), its validate and text-encode nodes, its frames
and what it refuses (Wan2.2 A14B's two experts, TI2V).

Sessions (``node_params.rollout``): ``keep_session: true`` keeps the stream after the request
(its id in ``output.metrics["session"]``); ``session: <id>`` continues it with this request's
prompt. Cancelling or failing a request frees its slabs (``release``). Sessions, engines and the
slab pool belong to the loaded model (``model.config["causal"]``), one pool per video size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniloop.artifacts import Conditioning, Embeddings, VideoFrames
from omniloop.errors import DeployError, RequestError
from omniloop.family import LoadedModel
from omniloop.graph import Node, PipelineSpec
from omniloop.request import TaskType
from omniloop_kit.causal import (
    ROLLOUTS,
    CausalDeployment,
    CausalRollout,
    RolloutCheck,
    RolloutParams,
    causal_options,
    deployment,
    plan_chunks,
    refuse_interceptors,
    rollout_mode,
)

from ..stages import TextEncode, Validate, to_uint8_frames
from .rollout import CausalWan


def build_causal_pipeline(model: LoadedModel, task: TaskType, options: Mapping[str, Any], menu: Any) -> PipelineSpec:
    """validate → rollout (checks, session) → text_encode → chunks (streams ``video_chunk``) → ``video``."""
    if task is not TaskType.T2V:
        raise RequestError("task", f"rollout: causal does text-to-video only, not {task.value!r}")
    if model.config.get("boundary_ratio") is not None:
        raise DeployError("options.rollout: causal needs a one-transformer Wan checkpoint (not Wan2.2 A14B's two experts)")
    if model.config.get("expand_timesteps"):
        raise DeployError("options.rollout: causal does not support Wan2.2 TI2V (per-token timesteps)")
    refuse_interceptors(options)
    dep = deployment(model, options, CausalWan)
    nodes = [
        Node("validate", Validate(model, menu), writes={"params": Conditioning}),
        Node("rollout", RolloutCheck(dep), reads={"params": Conditioning}, writes={"rollout_plan": Conditioning},
             params_schema=RolloutParams),
        Node("text_encode", TextEncode(model.config.get("text_cache")), reads={"params": Conditioning},
             writes={"prompt_embeds": Embeddings, "negative_embeds": Embeddings}, uses=("text_encoder",)),
        Node("chunks", CausalRollout(dep, to_uint8_frames), reads={"params": Conditioning, "prompt_embeds": Embeddings,
                                                  "negative_embeds": Embeddings, "rollout_plan": Conditioning},
             writes={"video": VideoFrames}, emits={"video_chunk": VideoFrames}, uses=("transformer", "vae")),
    ]
    return PipelineSpec(family="wan", task=task, nodes=nodes, outputs={"video": "video"})


__all__ = [
    "ROLLOUTS",
    "CausalDeployment",
    "CausalRollout",
    "RolloutCheck",
    "RolloutParams",
    "build_causal_pipeline",
    "causal_options",
    "plan_chunks",
    "refuse_interceptors",
    "rollout_mode",
]
