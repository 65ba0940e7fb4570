"""The ``prompt-upsample`` composition: a text model expands the user's prompt, a video model renders it.

Registered by this plugin through ``omniloop_register_policies`` as a ``kind="pipeline"``
:class:`~omniloop_compose.CompositionSpec` (see :mod:`omniloop_compose`)::

    pipeline: prompt-upsample
    models: {upsampler: {path: /models/Qwen2.5-0.5B-Instruct}, video: {path: /models/Wan2.1-T2V-1.3B-Diffusers}}
    pipeline_options: {upsample: {max_tokens: 120}}   # the upsample node's defaults (UpsampleParams)

Nodes (a ``t2v`` request):

* ``upsample`` (role ``upsampler``, any family doing ``reason``) reads the request's ``prompt`` and
  runs a ``reason`` request whose inputs are the instruction as a ``system`` part and the prompt
  as a ``user`` part (the chat template), greedy unless ``temperature`` says otherwise; its
  ``text`` output becomes the ``expanded_prompt`` edge (a ``Text``: ``.text``, ``.token_ids``).
* ``video`` (role ``video``, any family doing ``t2v``) runs the user's request with its prompt
  replaced by the expanded text (negative prompt, diffusion knobs, seed and the video family's
  ``node_params`` kept); writes ``video`` and ``latents``.

Outputs: ``expanded_prompt``, ``video``, ``latents``. A request tunes the upsampler with
``node_params.upsample`` (same fields as ``pipeline_options.upsample``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from attrs import define, field

from omniloop.artifacts import Artifact, Latents, Text, VideoFrames
from omniloop.errors import RequestError
from omniloop.family import PolicySpec
from omniloop.request import OmniRequest, TaskType, TextPart
from omniloop_compose import PIPELINE_KIND, ComposedNode, CompositionSpec, RoleSpec

NAME = "prompt-upsample"

DEFAULT_INSTRUCTION = (
    "You expand short video prompts. Rewrite the user's prompt as one detailed paragraph describing "
    "the subject, the scene, the lighting, the colours and the camera motion. Answer with the paragraph only."
)


def _nonblank(_inst: Any, attribute: Any, value: str) -> None:
    if not value.strip():
        raise ValueError(f"{attribute.name} must not be blank")


@define(frozen=True)
class UpsampleParams:
    """The ``upsample`` node's knobs: ``pipeline_options.upsample`` in the deploy, ``node_params.upsample`` per request."""

    instruction: str = field(default=DEFAULT_INSTRUCTION, validator=_nonblank, metadata={"max_len": 8000})
    max_tokens: int = field(default=128, metadata={"ge": 1, "le": 4096})
    #: 0 = greedy (the default: the same prompt always expands the same way)
    temperature: float = field(default=0.0, metadata={"ge": 0.0, "le": 10.0})
    top_p: float = field(default=1.0, metadata={"gt": 0.0, "le": 1.0})
    top_k: int = field(default=0, metadata={"ge": 0})
    seed: int | None = field(default=None, metadata={"ge": 0, "le": 2**63 - 1})


def upsample_request(req: OmniRequest, edges: Mapping[str, Artifact], params: UpsampleParams) -> dict[str, Any]:
    """The ``reason`` request of the upsampler: instruction (system) + prompt (user)."""
    prompt = edges["prompt"]
    assert isinstance(prompt, Text)
    if not prompt.text.strip():
        raise RequestError("inputs", f"a {req.task.value} request needs a non-empty prompt (a text part with role 'prompt') to expand")
    sampling: dict[str, Any] = {"max_tokens": params.max_tokens, "temperature": params.temperature,
                                "top_p": params.top_p, "top_k": params.top_k}
    if params.seed is not None:
        sampling["seed"] = params.seed
    return {"task": "reason", "exact": req.exact, "priority": req.priority,
            "inputs": [{"type": "text", "role": "system", "text": params.instruction},
                       {"type": "text", "role": "user", "text": prompt.text}],
            "sampling": sampling}


def video_request(req: OmniRequest, edges: Mapping[str, Artifact], params: Any) -> OmniRequest:
    """The user's request with its prompt replaced by the expanded one."""
    expanded = edges["expanded_prompt"]
    assert isinstance(expanded, Text)
    if not expanded.text.strip():
        raise RequestError("node_params.upsample", "the upsampler produced an empty prompt (raise max_tokens or change the instruction)")
    inputs = [p for p in req.inputs if not (isinstance(p, TextPart) and p.role == "prompt")]
    inputs.insert(0, TextPart(text=expanded.text, role="prompt"))
    node_params = {k: v for k, v in req.node_params.items() if k not in ("upsample", "video")}
    return attrs.evolve(req, inputs=inputs, node_params=node_params)


def _prompt_of(req: OmniRequest) -> dict[str, Artifact]:
    return {"prompt": Text(text=req.prompt or "", producer="request")}


def composition() -> CompositionSpec:
    return CompositionSpec(
        name=NAME, task=TaskType.T2V,
        roles=(RoleSpec("upsampler", TaskType.REASON, "expands the prompt (a text family: qwen)"),
               RoleSpec("video", TaskType.T2V, "renders the expanded prompt (a video family: wan)")),
        inputs={"prompt": Text}, inputs_of=_prompt_of,
        nodes=(
            ComposedNode(name="upsample", role="upsampler", request=upsample_request, reads={"prompt": Text},
                         writes={"expanded_prompt": Text}, outputs={"text": "expanded_prompt"},
                         params_schema=UpsampleParams, errors_at="node_params.upsample"),
            ComposedNode(name="video", role="video", request=video_request, reads={"expanded_prompt": Text},
                         writes={"video": VideoFrames, "latents": Latents},
                         outputs={"video": "video", "latents": "latents"}),
        ),
        outputs={"expanded_prompt": "expanded_prompt", "video": "video", "latents": "latents"},
        description="a text model expands the prompt (instruction + prompt), a video model renders it",
    )


SPEC = PolicySpec(name=NAME, kind=PIPELINE_KIND, factory=composition,
                  description="composition: upsampler (reason) -> video (t2v); see omniloop_qwen.upsample")
