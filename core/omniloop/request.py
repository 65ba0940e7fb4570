"""The request plane: what a user asks for (``OmniRequest``) and what comes back.

Everything here is an attrs class that round-trips through the single cattrs converter in
:mod:`omniloop.schema`. Range constraints live in field metadata (``ge``/``le``/``gt``/``choices``)
so that validation can name the dotted path of a bad field.
"""

from __future__ import annotations

import enum
import math
import uuid
from typing import Any, Literal, Union

import attrs
from attrs import define, field

SCHEMA_VERSION = "1"

#: the most samples one request may ask for (``diffusion.num_outputs``)
MAX_NUM_OUTPUTS = 64
#: the range of ``diffusion.fps``
MIN_FPS, MAX_FPS = 0.1, 1000.0
#: a request id is an identifier, never a file name: 1-128 characters of letters, digits and
#: ``_ . : @ + = -``, not starting with ``.`` (no ``/``, no NUL, no ``..``); front ends that name
#: files still name them by an id they make themselves
REQUEST_ID_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]{0,127}"


class TaskType(enum.StrEnum):
    """What a request asks for. Declared by the caller, never inferred from the inputs."""

    T2V = "t2v"
    I2V = "i2v"
    V2V = "v2v"
    T2I = "t2i"
    I2I = "i2i"
    T2A = "t2a"
    TTS = "tts"
    REASON = "reason"


class Status(enum.StrEnum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


def _c(**constraints: Any) -> dict[str, Any]:
    return dict(constraints)


# --------------------------------------------------------------------------------------------
# Typed input parts (tagged union on "type")
# --------------------------------------------------------------------------------------------


@define(frozen=True)
class TextPart:
    """A piece of text. ``role`` says what it is for: ``prompt`` or ``negative_prompt``; for text
    families, chat roles ``system`` / ``user`` / ``assistant`` (rendered with the chat template)."""

    text: str
    role: Literal["prompt", "negative_prompt", "system", "user", "assistant"] = "prompt"
    type: Literal["text"] = "text"


@define(frozen=True)
class ImagePart:
    """An image given by file path or base64 data (exactly one)."""

    path: str | None = None
    data_b64: str | None = None
    role: Literal["image", "first_frame", "last_frame", "reference"] = "image"
    type: Literal["image"] = "image"


@define(frozen=True)
class VideoPart:
    path: str
    role: Literal["video", "reference"] = "video"
    type: Literal["video"] = "video"


@define(frozen=True)
class AudioPart:
    path: str
    role: Literal["audio", "reference"] = "audio"
    type: Literal["audio"] = "audio"


@define(frozen=True)
class LatentsPart:
    """Latents saved with torch.save / safetensors, e.g. to resume or to image-condition."""

    path: str
    modality: str = "video"
    type: Literal["latents"] = "latents"


@define(frozen=True)
class ActionPart:
    """A control signal for world models (camera pose, action ids)."""

    values: list[float] = attrs.Factory(list)
    type: Literal["action"] = "action"


ModalPart = Union[TextPart, ImagePart, VideoPart, AudioPart, LatentsPart, ActionPart]  # noqa: UP007 (cattrs tagged union)
MODAL_PART_TYPES: tuple[type, ...] = (TextPart, ImagePart, VideoPart, AudioPart, LatentsPart, ActionPart)


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


@define(frozen=True)
class DiffusionParams:
    """Diffusion knobs. ``None`` means "the family's default for this task"."""

    steps: int | None = field(default=None, metadata=_c(ge=1))
    guidance_scale: float | None = field(default=None, metadata=_c(ge=0.0))
    shift: float | None = field(default=None, metadata=_c(gt=0.0))
    height: int | None = field(default=None, metadata=_c(ge=1))
    width: int | None = field(default=None, metadata=_c(ge=1))
    frames: int | None = field(default=None, metadata=_c(ge=1))
    #: frames per second of the output video: a sane range (1e-300 would make a 0-fps container)
    fps: float | None = field(default=None, metadata=_c(ge=MIN_FPS, le=MAX_FPS))
    seed: int | None = field(default=None, metadata=_c(ge=0, le=2**63 - 1))
    #: how many samples (OpenAI's ``n``): sample i is this request with seed ``seed + i`` and its
    #: own generator (diffusers' behaviour with a list of generators); the runtime runs the group
    #: together (the step scheduler batches it) and returns them in ``OmniOutput.samples``
    num_outputs: int | None = field(default=None, metadata=_c(ge=1, le=MAX_NUM_OUTPUTS))


def _check_sde_steps(steps: list[int]) -> str | None:
    if len(steps) > 10_000:
        return f"at most 10000 step indices, got {len(steps)}"
    bad = next((s for s in steps if s < 0), None)
    return None if bad is None else f"step indices are >= 0, got {bad}"


@define(frozen=True)
class RolloutParams:
    """A post-training rollout (``omniloop.rl``): the denoise loop takes the runtime's rollout step
    (``kind``) on the sampler's schedule and records a trajectory with per-step log-probs."""

    #: ``sde``: Flow-GRPO's SDE step; ``cps``: its coefficient-preserving variant; ``ode``: the
    #: deterministic Euler step (no log-prob)
    kind: Literal["sde", "cps", "ode"] = "sde"
    #: the noise level ``a`` (Flow-GRPO's ``noise_level``)
    noise_level: float = field(default=0.7, metadata=_c(gt=0.0, le=1.0))
    #: the step indices that are stochastic (None: every step); the others take the ODE step
    sde_steps: list[int] | None = field(default=None, metadata=_c(check=lambda v: _check_sde_steps(v)))
    #: what the trajectory records
    capture: list[Literal["latents", "log_probs", "timesteps"]] = field(
        factory=lambda: ["latents", "log_probs", "timesteps"])
    #: with ``diffusion.num_outputs``: every sample starts from the same initial noise (seed
    #: ``seed``) and draws its own SDE noise
    same_initial_noise: bool = False
    #: allow distribution-altering interceptors (caches) on a rollout that captures log-probs;
    #: the log-probs then no longer equal a trainer's recomputation (breaks C1)
    allow_cache: bool = False


@define(frozen=True)
class AudioParams:
    """The audio window of an audio-producing request (``task: t2a``, or a joint audio-video
    family's sound track). ``None`` means "the family's default" (the checkpoint's maximum
    length for ``seconds``)."""

    #: the clip's length in seconds (the end of the window is ``start + seconds``)
    seconds: float | None = field(default=None, metadata=_c(gt=0.0, le=3600.0))
    #: where the window starts, in seconds (Stable Audio's start-second conditioning)
    start: float = field(default=0.0, metadata=_c(ge=0.0, le=3600.0))
    #: a joint audio-video family's audio-branch guidance (LTX-2; None: the family's default),
    #: read only by a family declaring ``audio_guidance`` (others refuse them): the audio CFG
    #: scale, its spatio-temporal guidance scale, its modality-isolation scale, its rescale
    guidance: float | None = field(default=None, metadata=_c(ge=0.0, le=100.0))
    stg: float | None = field(default=None, metadata=_c(ge=0.0, le=100.0))
    modality: float | None = field(default=None, metadata=_c(ge=0.0, le=100.0))
    rescale: float | None = field(default=None, metadata=_c(ge=0.0, le=1.0))
    #: a joint audio-video family whose sound track is optional (Cosmos 3): ``true`` asks for it.
    #: ``false`` on a request that always makes audio (``t2a``) is refused, not ignored
    enabled: bool | None = None

    def guidance_knobs(self) -> list[str]:
        """The audio guidance knobs this window sets (``audio.<name>``)."""
        return [n for n in AUDIO_GUIDANCE_KNOBS if getattr(self, n) is not None]


#: the audio-branch guidance knobs of :class:`AudioParams`
AUDIO_GUIDANCE_KNOBS = ("guidance", "stg", "modality", "rescale")


@define(frozen=True)
class SamplingParams:
    """Autoregressive sampling knobs (text/audio tokens)."""

    temperature: float = field(default=1.0, metadata=_c(ge=0.0))
    top_p: float = field(default=1.0, metadata=_c(gt=0.0, le=1.0))
    top_k: int = field(default=0, metadata=_c(ge=0))
    max_tokens: int | None = field(default=None, metadata=_c(ge=1))
    #: the sampling generator's seed (None: the family's fallback, e.g. ``diffusion.seed``, else random)
    seed: int | None = field(default=None, metadata=_c(ge=0, le=2**63 - 1))
    #: stop strings: generation ends when the text contains one (the text ends before it)
    stop: list[str] = field(factory=list, metadata=_c(check=lambda v: _check_stop(v)))


#: at most this many stop strings, each at most this many characters
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 1000


def _check_stop(stops: list[str]) -> str | None:
    if len(stops) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"
    for i, s in enumerate(stops):
        if not s:
            return f"stop string {i} is empty (a stop string must be non-empty)"
        if len(s) > MAX_STOP_CHARS:
            return f"stop string {i} is longer than {MAX_STOP_CHARS} characters ({len(s)})"
    return None


@define(frozen=True)
class ActionParams:
    """An action-conditioned world-model request (Cosmos 3's ``CosmosActionCondition``): the
    ``mode`` (``forward_dynamics``: roll the video out from a first frame and given actions;
    ``inverse_dynamics``: infer the actions between a video's frames; ``policy``: roll out video
    and actions from a first frame), ``chunk_size`` action steps (the video spans ``chunk_size +
    1`` frames), the embodiment ``domain`` (selects the action head's weights and the action
    width), the conditioning canvas ``resolution_tier``, ``raw_actions`` ``[T][D]``
    (forward dynamics) and the camera ``view_point``. The conditioning image or video is an input
    part. Refused by families that declare no actions (``capabilities.actions``)."""

    mode: Literal["forward_dynamics", "inverse_dynamics", "policy"]
    chunk_size: int = field(metadata=_c(ge=1, le=1024))
    domain: str = field(metadata=_c(max_len=64))
    resolution_tier: int = field(default=480, metadata=_c(choices=(256, 480, 704, 720)))
    raw_actions: list[list[float]] | None = field(default=None, metadata=_c(check=lambda v: _check_actions(v)))
    view_point: str = field(default="ego_view", metadata=_c(max_len=64))


def _check_actions(rows: list[list[float]] | None) -> str | None:
    if rows is None:
        return None
    if not rows or len(rows) > 1024:
        return f"1 to 1024 action rows, got {len(rows)}"
    width = len(rows[0])
    for i, row in enumerate(rows):
        if len(row) != width or not 1 <= width <= 256:
            return f"row {i} has {len(row)} values (every row needs the same width, 1 to 256)"
        if not all(math.isfinite(v) for v in row):
            return f"row {i} holds a non-finite number"
    return None


#: an adapter name in a request: the key the deploy declared it under (never a path)
ADAPTER_NAME_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]{0,63}"


@define(frozen=True)
class AdapterRef:
    """One LoRA adapter a request applies: a name the deployment declared (``adapters:`` in the
    deploy file) and its scale (diffusers' ``set_adapters`` weight)."""

    name: str = field(metadata=_c(max_len=64, pattern=ADAPTER_NAME_PATTERN,
                                  pattern_hint="must be 1-64 letters, digits or _ . : @ + = - (a name the deployment declares)"))
    scale: float = field(default=1.0, metadata=_c(ge=-100.0, le=100.0))


@define(frozen=True)
class OutputSpec:
    """What to return and how to stream it."""

    stream_progress: bool = True
    stream_partial: bool = False
    return_latents: bool = False
    return_trajectory: bool = False
    format: Literal["mp4", "png", "frames", "wav", "text"] | None = None


@define(frozen=True)
class OmniRequest:
    """Immutable user intent. Build it with keyword arguments or :func:`omniloop.schema.request_from_dict`."""

    task: TaskType
    inputs: list[ModalPart] = attrs.Factory(list)
    diffusion: DiffusionParams = attrs.Factory(DiffusionParams)
    sampling: SamplingParams = attrs.Factory(SamplingParams)
    #: the audio window (audio-producing families; refused by the others)
    audio: AudioParams | None = None
    outputs: OutputSpec = attrs.Factory(OutputSpec)
    node_params: dict[str, dict[str, Any]] = attrs.Factory(dict)
    plugin_params: dict[str, dict[str, Any]] = attrs.Factory(dict)
    #: LoRA adapters to apply, stacked in this order (names the deployment declared)
    adapters: list[AdapterRef] = attrs.Factory(list)
    #: a post-training rollout (``omniloop.rl``): trajectory with per-step log-probs
    rollout: RolloutParams | None = None
    #: an action-conditioned world-model request (families declaring actions; refused by the others)
    action: ActionParams | None = None
    exact: bool = False
    priority: int = field(default=0, metadata=_c(ge=-100, le=100))
    request_id: str = field(
        factory=lambda: uuid.uuid4().hex[:16],
        metadata=_c(max_len=128, pattern=REQUEST_ID_PATTERN,
                    pattern_hint="must be 1-128 letters, digits or _ . : @ + = - (not starting with '.')"),
    )
    schema_version: str = field(default=SCHEMA_VERSION, metadata=_c(choices=(SCHEMA_VERSION,)))

    # -- convenience accessors used by families --------------------------------------------
    def text(self, role: str = "prompt") -> str | None:
        """The joined text of every ``TextPart`` with this role, or None."""
        parts = [p.text for p in self.inputs if isinstance(p, TextPart) and p.role == role]
        return " ".join(parts) if parts else None

    @property
    def prompt(self) -> str | None:
        return self.text("prompt")

    @property
    def negative_prompt(self) -> str | None:
        return self.text("negative_prompt")

    def parts(self, kind: type) -> list[Any]:
        return [p for p in self.inputs if isinstance(p, kind)]

    def image(self) -> ImagePart | None:
        imgs = self.parts(ImagePart)
        return imgs[0] if imgs else None


# --------------------------------------------------------------------------------------------
# Outputs and events
# --------------------------------------------------------------------------------------------


@define
class ErrorInfo:
    type: str
    message: str
    node: str | None = None
    step: int | None = None


@define
class OmniOutput:
    """What a request produced. ``artifacts`` maps names (``video``, ``latents``) to artifacts."""

    request_id: str
    status: Status
    artifacts: dict[str, Any] = attrs.Factory(dict)
    metrics: dict[str, Any] = attrs.Factory(dict)
    error: ErrorInfo | None = None
    #: ``diffusion.num_outputs`` > 1: every sample's own output (``artifacts`` are sample 0's)
    samples: list[OmniOutput] = attrs.Factory(list)

    @property
    def ok(self) -> bool:
        return self.status is Status.COMPLETED


class EventKind(enum.StrEnum):
    """``progress``: one loop step finished (``step``/``total`` set); ``node``: a node finished
    (``node`` set, ``message="done"``); ``partial``: an artifact emitted mid-loop; ``final``: the output."""

    PROGRESS = "progress"
    NODE = "node"
    PARTIAL = "partial"
    FINAL = "final"
    ERROR = "error"


@define
class OmniEvent:
    """The stream unit. ``progress`` carries node/step/total (both always set); ``node`` marks a
    finished node; ``final`` carries the output."""

    request_id: str
    kind: EventKind
    node: str | None = None
    step: int | None = None
    total: int | None = None
    message: str | None = None
    artifact: str | None = None
    value: Any = None
    output: OmniOutput | None = None
