"""Compile a ComfyUI workflow (API or editor format) to native omniloop requests.

ComfyUI runs only what its output nodes (``SaveImage``, ``SaveVideo``, ...) need; so does this
compiler. It walks the graph from the output nodes, checks every input (type of each link, ranges
and choices of each widget value, file names), evaluates the standard chains symbolically, and
emits one :class:`CompiledJob` per sampler chain: an OmniRequest dict and the save nodes its
decoded image feeds (several save nodes on one decode share one request). Nothing runs here.

What maps to what (the full table is in the package README):

========================================  ======================================================
loaders (checkpoint, UNet, CLIP, VAE)     the served model, by file name or the deploy's
                                          ``comfyui.models`` aliases (unknown: a node error)
``CLIPTextEncode``                        ``inputs`` prompt / negative prompt text parts
empty latents                             ``diffusion.width / height / frames`` (+ task t2i / t2v)
``ModelSamplingSD3`` / ``ModelSamplingFlux``  ``diffusion.shift`` (Flux: ``exp(mu)``)
``KSampler`` / ``KSamplerAdvanced``       ``diffusion.steps / seed / guidance_scale``,
                                          ``node_params.denoise.sampler`` (same-math table below);
                                          a Wan 2.2 high/low pair → one two-expert request
``LoraLoader*``                           ``adapters`` (the deploy's ``comfyui.loras`` aliases)
``LoadImage`` + ``VAEEncode`` + denoise   i2i (``node_params.denoise.strength``)
``WanImageToVideo``                       i2v (the start image as the first frame)
``VAEDecode`` → save nodes                the job's outputs
========================================  ======================================================
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from attrs import define, field

from .errors import WorkflowError, node_error, show
from .nodes import SPECS, UI_ONLY, In
from .ui import is_ui_format, to_api_format

#: omniloop's seed range (ComfyUI's goes to 2**64 - 1)
MAX_OMNI_SEED = 2**63 - 1
#: a file-name input: one plain name (ComfyUI's folders may hold subfolders: ``sub/name``), never a path out
FILE_NAME = re.compile(r"^(?!\.)[^/\\\x00:*?\"<>|]{1,200}(/(?!\.)[^/\\\x00:*?\"<>|]{1,200}){0,3}$")
#: a filename_prefix: up to 4 folder levels of plain names inside the output folder
PREFIX = re.compile(r"^(?!\.)[A-Za-z0-9_\-. %:]{1,100}(/(?!\.)[A-Za-z0-9_\-. %:]{1,100}){0,4}$")

#: What the families' samplers are, per family (checked against the families by tests/comfyui):
#: ``schedule`` — the sigma spacing of the family's ``flow-euler`` sampler ("default": diffusers'
#: ``FlowMatchEulerDiscreteScheduler`` spacing; "linear": ``linspace(1, 1/n, n)``, FLUX.1's);
#: ``comfy_shift`` — ComfyUI's default model-sampling shift for the family when the workflow sets
#: none (its ``supported_models`` sampling settings); ``table`` — the size of ComfyUI's sigma table.
FAMILIES: dict[str, dict[str, Any]] = {
    "wan": {"schedule": "default", "comfy_shift": 8.0, "table": 1000, "video": True},
    "sd3": {"schedule": "default", "comfy_shift": 3.0, "table": 1000, "video": False},
    "flux": {"schedule": "linear", "comfy_shift": None, "table": 10000, "video": False},
}

#: the text-encoder loaders (class, ``type``) ComfyUI uses per family (SD3: CLIP-L/G alone, with T5, or all three)
CLIP_LOADERS: dict[str, set[tuple[str, str | None]]] = {
    "wan": {("CLIPLoader", "wan")},
    "flux": {("DualCLIPLoader", "flux")},
    "sd3": {("CLIPLoader", "sd3"), ("DualCLIPLoader", "sd3"), ("TripleCLIPLoader", None)},
}

#: ``(sampler_name, scheduler)`` → (omniloop sampler, the flow-euler spacing it needs). Only pairs
#: whose math is the same: ComfyUI's ``euler`` step on a flow model is ``x + (σ' − σ)·v``, the
#: ``FlowMatchEulerDiscreteScheduler`` step; its ``normal`` scheduler on ``ModelSamplingDiscreteFlow``
#: is ``σ(linspace(1000·σ_max, 1000·σ_min, n))`` — diffusers' default spacing; its ``simple``
#: scheduler takes every (table/n)-th entry of the shifted table, ``linspace(1, 1/n, n)`` shifted
#: when n divides the table size — diffusers' Flux sigmas. Every other pair is a node error.
SAMPLER_TABLE: dict[tuple[str, str], tuple[str, str]] = {
    ("euler", "normal"): ("flow-euler", "default"),
    ("euler", "simple"): ("flow-euler", "linear"),
    ("euler", "sgm_uniform"): ("flow-euler", "sgm_uniform"),
}


@define
class Target:
    """What the compiler compiles against: the served model and the deploy's ``comfyui`` aliases.

    ``model`` None is an *unbound* target (``omniloop comfy compile`` without ``--deploy``, the
    coverage script): loader names are not checked, the family is read from the workflow."""

    model: str | None = None
    family: str | None = None
    tasks: frozenset[str] = frozenset()
    #: loader file name → model name (the deploy's ``comfyui.models``)
    models: dict[str, str] = field(factory=dict)
    #: LoRA file name → adapter name (the deploy's ``comfyui.loras``)
    loras: dict[str, str] = field(factory=dict)
    #: adapter names the deploy declares (``adapters:``)
    adapters: frozenset[str] = frozenset()
    #: the checkpoint's scheduler config (``scheduler/scheduler_config.json``)
    scheduler: dict[str, Any] = field(factory=dict)
    #: Wan 2.2's ``boundary_ratio`` (``model_index.json``), None for one expert
    boundary_ratio: float | None = None
    #: FLUX.1: guidance-distilled (dev) or not (schnell); the checkpoint's default embedded guidance
    guidance_embeds: bool | None = None
    default_guidance: float | None = None
    #: where ``LoadImage`` names are looked up (ComfyUI's input folder); None: LoadImage refused
    input_dir: Path | None = None
    #: the served ``flow-euler``'s sigma spacing when the deploy sets it (``policies.sampler_options:
    #: {flow-euler: {sigma_schedule: linear}}``: "linear"); None: the family's (:data:`FAMILIES`)
    flow_schedule: str | None = None
    #: the VAE's spatial scale (``2 ** (len(block_out_channels) - 1)``, ``vae/config.json``); ComfyUI's
    #: ModelSamplingFlux counts ``width * height / (8 * 8 * 2 * 2)`` tokens, true for a scale of 8
    vae_scale: int | None = None
    #: why the served ``flow-euler`` is not ComfyUI's ``euler`` (an option such as
    #: ``stochastic_sampling`` set by the checkpoint's omniloop.json or the deploy); None: it is
    flow_differs: str | None = None

    @property
    def bound(self) -> bool:
        return self.model is not None

    def names(self) -> dict[str, list[str]]:
        """File names the loader combos offer (``/object_info``)."""
        models = sorted({*([self.model] if self.model else []), *self.models})
        files: list[str] = []
        if self.input_dir is not None and self.input_dir.is_dir():
            files = sorted(p.name for p in self.input_dir.iterdir() if p.is_file() and not p.name.startswith("."))
        return {"checkpoints": models, "diffusion_models": models, "text_encoders": models, "vae": models,
                "clip_vision": models, "loras": sorted({*self.loras, *self.adapters}), "input": files}

    @classmethod
    def from_checkpoint(cls, path: str | Path | None, *, model: str, family: str, tasks: Any = (),
                        comfyui: Mapping[str, Any] | None = None, adapters: Any = (),
                        input_dir: str | Path | None = None, policies: Mapping[str, Any] | None = None) -> Target:
        """Read the scheduler config, ``model_index.json`` and the transformer config of a diffusers
        checkpoint folder (configs only, no weights) and the deploy's ``comfyui`` section."""
        import json

        def read(*parts: str) -> dict[str, Any]:
            if path is None:
                return {}
            p = Path(path, *parts)
            try:
                data = json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}
            except (OSError, ValueError):
                return {}
            return data if isinstance(data, dict) else {}

        comfy = check_comfyui_section(comfyui)
        index = read("model_index.json")
        blocks = read("vae", "config.json").get("block_out_channels")
        vae_scale = 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else None
        tf = read("transformer", "config.json")
        defaults = read("omniloop.json").get("defaults") or {}
        ratio = index.get("boundary_ratio")
        guidance = defaults.get("guidance_scale")
        if family == "flux" and guidance is None:
            guidance = 3.5  # FluxPipeline's default (omniloop_flux.defaults)
        return cls(model=model, family=family, tasks=frozenset(str(getattr(t, "value", t)) for t in tasks),
                   models=dict(comfy.get("models") or {}), loras=dict(comfy.get("loras") or {}),
                   adapters=frozenset(adapters), scheduler=read("scheduler", "scheduler_config.json"),
                   boundary_ratio=float(ratio) if isinstance(ratio, (int, float)) else None,
                   guidance_embeds=bool(tf.get("guidance_embeds")) if family == "flux" else None,
                   default_guidance=float(guidance) if isinstance(guidance, (int, float)) else None,
                   input_dir=Path(input_dir) if input_dir is not None else None, vae_scale=vae_scale,
                   **_flow_euler_options(family, defaults, policies))

    @classmethod
    def from_runtime(cls, runtime: Any, *, model: str, input_dir: str | Path | None = None) -> Target:
        """The target of a loaded :class:`omniloop.runtime.Runtime` (its deploy's ``comfyui`` section)."""
        deploy = runtime.deploy
        return cls.from_checkpoint(runtime.model_path, model=model, family=runtime.family.name,
                                   tasks=runtime.supported_tasks, comfyui=deploy.comfyui,
                                   adapters=deploy.adapters.keys(), input_dir=input_dir, policies=deploy.policies)


def _flow_euler_options(family: str, defaults: Mapping[str, Any], policies: Mapping[str, Any] | None) -> dict[str, Any]:
    """The served ``flow-euler``'s options as the families merge them (the checkpoint's omniloop.json
    ``defaults.sampler_options``, then the deploy's ``policies.sampler_options``; FLUX.1 fixes its
    own): ``flow_schedule`` ("linear" or None) and ``flow_differs`` (an option that makes its step
    differ from ComfyUI's ``euler``, e.g. ``stochastic_sampling``)."""
    if family == "flux":
        return {}
    merged: dict[str, Any] = {}
    for source in ((defaults or {}).get("sampler_options"), (policies or {}).get("sampler_options")
                   if isinstance(policies, Mapping) else None):
        fe = source.get("flow-euler") if isinstance(source, Mapping) else None
        if isinstance(fe, Mapping):
            merged.update(fe)
    schedule = merged.pop("sigma_schedule", None)
    differs = None
    for key, value in sorted(merged.items()):
        if key == "stochastic_sampling" and value is False:
            continue
        differs = f"the served flow-euler sets {key}={value!r} (checkpoint omniloop.json or deploy sampler_options)"
        break
    return {"flow_schedule": schedule if schedule in ("linear", "sgm_uniform") else None, "flow_differs": differs}


def check_comfyui_section(section: Any) -> dict[str, Any]:
    """The deploy's ``comfyui: {models: {FILE: MODEL}, loras: {FILE: ADAPTER}}``; one ValueError naming the key."""
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ValueError("comfyui: expected a mapping with 'models' and/or 'loras'")
    for key in section:
        if key not in ("models", "loras"):
            raise ValueError(f"comfyui.{key}: unknown key (expected 'models' or 'loras')")
    for key in ("models", "loras"):
        value = section.get(key) or {}
        if not isinstance(value, Mapping):
            raise ValueError(f"comfyui.{key}: expected a mapping of file names to names")
        for k, v in value.items():
            if not isinstance(k, str) or not isinstance(v, str) or not k or not v:
                raise ValueError(f"comfyui.{key}.{k}: expected a non-empty name, got {show(v)}")
    return dict(section)


# ------------------------------------------------------------------------------------------------
# symbolic values flowing along links
# ------------------------------------------------------------------------------------------------


@define
class ModelV:
    family: str | None
    loaders: tuple[str, ...]  # loader node ids (the model's file)
    file: str
    shift: float | None = None
    flux_sampling: tuple[float, float, int, int] | None = None
    loras: tuple[tuple[str, float], ...] = ()


@define
class ClipV:
    family: str | None
    loras: tuple[tuple[str, float], ...] = ()


@define
class VaeV:
    pass


@define
class CondV:
    text: str | None
    zero: bool = False
    guidance: float | None = None
    clip_loras: tuple[tuple[str, float], ...] = ()


@define
class ImageV:
    kind: str  # "loaded" | "decoded"
    job: str | None = None
    data_b64: str | None = None
    size: tuple[int, int] | None = None  # (width, height)


@define
class LatentV:
    kind: str  # "empty" | "encoded" | "wan_i2v" | "sampled"
    width: int = 0
    height: int = 0
    frames: int | None = None  # pixel frames (video), None: an image
    batch: int = 1
    image: ImageV | None = None
    sampler: str | None = None  # node id of the sampler that produced it
    video: bool = False


@define
class VideoV:
    images: ImageV
    fps: float


@define
class Opaque:
    what: str


@define
class SaveSpec:
    """One output node fed by a job: what to write (``kind``: image, webp, webm, video)."""

    node_id: str
    class_type: str
    kind: str
    prefix: str
    options: dict[str, Any] = field(factory=dict)
    temp: bool = False


@define
class CompiledJob:
    """One native request (an OmniRequest as a dict) and the output nodes its result feeds."""

    key: str  # the (last) sampler node id
    request: dict[str, Any]
    saves: list[SaveSpec] = field(factory=list)
    #: the workflow's nodes this job stands for (for ComfyUI's ``executing`` messages)
    nodes: list[str] = field(factory=list)
    #: data flow between jobs: ``{index in request["inputs"]: key of the job whose image feeds it}``;
    #: the part's ``data_b64`` is ``FROM_JOB + key`` until :func:`fill_inputs` puts that image there
    inputs_from: dict[int, str] = field(factory=dict)
    #: a two-expert job: the step where the first sampler node hands over to the second
    split: int | None = None

    def ready(self, outputs: Mapping[str, Any]) -> dict[str, Any]:
        """The request with the images of earlier jobs (their outputs by key) filled in."""
        return fill_inputs(self, outputs)


#: the placeholder of an input image another job of the same prompt produces
FROM_JOB = "@from-job:"


def fill_inputs(job: CompiledJob, outputs: Mapping[str, Any]) -> dict[str, Any]:
    """``job.request`` with each ``inputs_from`` part's image taken from the producing job's output
    (an :class:`omniloop.request.OmniOutput` with an ``image`` artifact), as PNG data."""
    if not job.inputs_from:
        return job.request
    import copy
    import io

    from PIL import Image

    request = copy.deepcopy(job.request)
    for index, key in job.inputs_from.items():
        out = outputs[key]
        pixels = out.artifacts["image"].pixels
        buf = io.BytesIO()
        Image.fromarray(pixels.numpy()).save(buf, format="PNG")
        request["inputs"][index]["data_b64"] = base64.b64encode(buf.getvalue()).decode("ascii")
    return request


@define
class NodeReport:
    node_id: str
    class_type: str
    status: str  # "mapped" | "ignored" | "unsupported"
    reason: str = ""


@define
class CompiledPrompt:
    jobs: list[CompiledJob]
    prompt: dict[str, Any]  # the API-format graph compiled
    report: list[NodeReport]


# ------------------------------------------------------------------------------------------------


class _Compiler:
    def __init__(self, prompt: dict[str, Any], target: Target, only: list[str] | None = None) -> None:
        self.prompt = prompt
        self.only = only
        self.t = target
        self.errors: dict[str, list[dict[str, Any]]] = {}
        self.values: dict[str, tuple[Any, ...] | None] = {}
        self.samplers: dict[str, dict[str, Any]] = {}
        self.jobs: dict[str, CompiledJob] = {}
        self.report: dict[str, NodeReport] = {}
        self.family = target.family
        #: ComfySwitchNode id -> the input it selected
        self.switch_choice: dict[str, str] = {}
        #: the end_at_step of the last two-expert chain built
        self.expert_split: int | None = None

    # -- errors ---------------------------------------------------------------------------------
    def err(self, nid: str, type_: str, message: str, input_name: str | None = None, **extra: Any) -> None:
        entry = node_error(type_, message, input_name=input_name, **extra)
        if input_name is not None:
            entry["extra_info"].setdefault("input_config", None)
        self.errors.setdefault(nid, []).append(entry)

    def class_of(self, nid: str) -> str:
        node = self.prompt.get(nid)
        return str(node.get("class_type")) if isinstance(node, dict) else "?"

    # -- the graph ------------------------------------------------------------------------------
    def structure(self) -> list[str]:
        """Check the prompt's shape, find the output nodes; refuse unknown classes (ComfyUI's order)."""
        if not isinstance(self.prompt, dict) or not self.prompt:
            raise WorkflowError("invalid_prompt", "the prompt must be a non-empty object of nodes {id: {class_type, inputs}}")
        for nid, node in self.prompt.items():
            if not isinstance(node, dict) or not isinstance(node.get("class_type"), str):
                raise WorkflowError("invalid_prompt", f"node {show(nid)} has no class_type",
                                    details=f"Node ID '#{nid}'", extra_info={"node_id": str(nid)})
            if not isinstance(node.get("inputs", {}), dict):
                raise WorkflowError("invalid_prompt", f"node {show(nid)}: inputs must be an object",
                                    details=f"Node ID '#{nid}'", extra_info={"node_id": str(nid)})
            ct = node["class_type"]
            if ct not in SPECS:
                title = (node.get("_meta") or {}).get("title") if isinstance(node.get("_meta"), dict) else None
                raise WorkflowError(
                    "missing_node_type",
                    f"Node '{title or ct}' not found. The custom node may not be installed."
                    if ct not in UI_ONLY else f"Node '{ct}' is an editor-only node; queue the API format or the editor workflow",
                    details=f"Node ID '#{nid}'",
                    extra_info={"node_id": str(nid), "class_type": ct, "node_title": title or ct})
        outputs = [nid for nid, node in self.prompt.items() if SPECS[node["class_type"]].output_node]
        if self.only is not None:  # ComfyUI's partial_execution_targets: just these output nodes
            for nid in self.only:
                if nid not in outputs:
                    raise WorkflowError("invalid_prompt", f"partial_execution_targets: {show(nid)} is not an output node "
                                        "of the prompt", extra_info={"node_id": nid})
            outputs = [nid for nid in outputs if nid in self.only]
        if not outputs:
            raise WorkflowError("prompt_no_outputs", "Prompt has no outputs")
        return outputs

    def order(self, outputs: list[str]) -> list[str]:
        """Nodes the outputs need, dependencies first; a cycle or a dangling link is a node error."""
        done: list[str] = []
        state: dict[str, int] = {}

        def visit(nid: str) -> None:
            stack: list[tuple[str, Any]] = [(nid, iter(self._links(nid)))]
            state[nid] = 1
            while stack:
                cur, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    stack.pop()
                    state[cur] = 2
                    done.append(cur)
                    continue
                _name, src = nxt
                if src not in self.prompt:
                    continue  # reported as a dangling link by check_inputs
                s = state.get(src, 0)
                if s == 1:
                    cycle = [c for c, _ in stack]
                    cycle = cycle[cycle.index(src):]
                    for c in cycle:
                        self.err(c, "dependency_cycle", "Dependency cycle detected",
                                 details="nodes " + " -> ".join([*cycle, src]))
                    raise WorkflowError.from_nodes(self._node_errors())
                if s == 0:
                    state[src] = 1
                    stack.append((src, iter(self._links(src))))

        for nid in outputs:
            if state.get(nid, 0) == 0:
                visit(nid)
        return done

    def _links(self, nid: str) -> list[tuple[str, str]]:
        out = []
        for name, v in self.prompt[nid].get("inputs", {}).items():
            if _is_link(v):
                out.append((name, str(v[0])))
        return out

    # -- inputs ---------------------------------------------------------------------------------
    def inputs(self, nid: str) -> dict[str, Any] | None:
        """The node's inputs checked against its spec: values, or the upstream values of links.
        None when it has errors (recorded) or an upstream node failed (no error of its own)."""
        node = self.prompt[nid]
        spec = SPECS[node["class_type"]]
        raw = node.get("inputs", {})
        out: dict[str, Any] = {}
        ok, upstream_failed = True, False
        for i in spec.inputs:  # inputs a node does not take are ignored, as ComfyUI does
            if i.name not in raw:
                if i.optional:
                    continue
                self.err(nid, "required_input_missing", "Required input is missing", i.name)
                ok = False
                continue
            v = raw[i.name]
            if _is_link(v):
                src, slot = str(v[0]), v[1]
                if src not in self.prompt or not isinstance(slot, int) or isinstance(slot, bool):
                    self.err(nid, "dangling_link", f"Input {i.name!r} is linked to node {show(v[0])}, which is not in the prompt",
                             i.name, received_value=v)
                    ok = False
                    continue
                src_spec = SPECS[self.prompt[src]["class_type"]]
                if not 0 <= slot < len(src_spec.outputs):
                    self.err(nid, "dangling_link", f"Input {i.name!r} is linked to output {slot} of node {src} "
                             f"({src_spec.name}), which has {len(src_spec.outputs)} output(s)", i.name, received_value=v)
                    ok = False
                    continue
                got = src_spec.outputs[slot][0]
                if not i.takes(got):
                    self.err(nid, "return_type_mismatch", f"Return type mismatch between linked nodes: {i.name}, "
                             f"received_type({got}) mismatch input_type({i.kind})", i.name,
                             received_type=got, linked_node=v)
                    ok = False
                    continue
                vals = self.values.get(src)
                if vals is None:
                    upstream_failed = True
                    continue
                if i.widget:  # a value computed upstream (a primitive, a switch, a math node): checked as typed
                    checked = self.widget(nid, i, vals[slot])
                    if checked is _BAD:
                        ok = False
                    else:
                        out[i.name] = checked
                    continue
                value = vals[slot]
                if got == "*" and i.kind != "*" and _kind_of(value) != i.kind:  # a switch passing something else
                    self.err(nid, "return_type_mismatch", f"Return type mismatch between linked nodes: {i.name}, "
                             f"received_type({_kind_of(value)}) mismatch input_type({i.kind})", i.name,
                             received_type=_kind_of(value), linked_node=v)
                    ok = False
                    continue
                out[i.name] = value
                continue
            if i.kind == "*":
                if not isinstance(v, (int, float, str, bool)) or (isinstance(v, float) and not math.isfinite(v)):
                    self.err(nid, "invalid_input_type", f"Input {i.name!r}: a link or a finite number, string or "
                             f"boolean, got {show(v)}", i.name, received_value=_jsonable(v))
                    ok = False
                    continue
                out[i.name] = v
                continue
            if not i.widget:
                self.err(nid, "invalid_input_type", f"Input {i.name!r} must be a link [node_id, output_index] to a {i.kind} output, "
                         f"got {show(v)}", i.name, received_value=_jsonable(v))
                ok = False
                continue
            checked = self.widget(nid, i, v)
            if checked is _BAD:
                ok = False
            else:
                out[i.name] = checked
        if not ok or upstream_failed:
            return None
        return out

    def widget(self, nid: str, i: In, v: Any) -> Any:
        if i.kind == "INT":
            if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and math.isfinite(v) and v == int(v))):
                self.err(nid, "invalid_input_type", f"Failed to convert an input value to a INT value: {i.name}, {show(v)}",
                         i.name, received_value=_jsonable(v))
                return _BAD
            v = int(v)
        elif i.kind == "FLOAT":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
                self.err(nid, "invalid_input_type", f"Failed to convert an input value to a FLOAT value: {i.name}, {show(v)}",
                         i.name, received_value=_jsonable(v))
                return _BAD
            v = float(v)
        elif i.kind == "STRING":
            if not isinstance(v, str):
                self.err(nid, "invalid_input_type", f"Failed to convert an input value to a STRING value: {i.name}, {show(v)}",
                         i.name, received_value=_jsonable(v))
                return _BAD
            if "\x00" in v or len(v) > 100_000:
                self.err(nid, "invalid_input_type", f"{i.name}: strings must be under 100000 characters, without NUL", i.name)
                return _BAD
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                self.err(nid, "invalid_input_type", f"{i.name}: not valid Unicode", i.name)
                return _BAD
        elif i.kind == "BOOLEAN":
            if not isinstance(v, bool):
                self.err(nid, "invalid_input_type", f"Failed to convert an input value to a BOOLEAN value: {i.name}, {show(v)}",
                         i.name, received_value=_jsonable(v))
                return _BAD
        elif i.kind == "COMBO":
            if not isinstance(v, str):
                self.err(nid, "value_not_in_list", f"Value not in list: {i.name}: {show(v)}", i.name, received_value=_jsonable(v))
                return _BAD
            if i.choices is not None and v not in i.choices:
                self.err(nid, "value_not_in_list", f"Value not in list: {i.name}: {show(v)} not in {list(i.choices)}", i.name,
                         received_value=v)
                return _BAD
            if i.file is not None and not FILE_NAME.match(v):
                self.err(nid, "value_not_in_list", f"{i.name}: {show(v)} is not a file name (a name from the server's list, "
                         "never a path)", i.name, received_value=v)
                return _BAD
        if i.kind in ("INT", "FLOAT"):
            if i.min is not None and v < i.min:
                self.err(nid, "value_smaller_than_min", f"Value {v} smaller than min of {i.min}: {i.name}", i.name,
                         received_value=v)
                return _BAD
            if i.max is not None and v > i.max:
                self.err(nid, "value_bigger_than_max", f"Value {v} bigger than max of {i.max}: {i.name}", i.name,
                         received_value=v)
                return _BAD
        return v

    # -- evaluation -----------------------------------------------------------------------------
    def run(self) -> CompiledPrompt:
        outputs = self.structure()
        self.family = self.family or _guess_family(self.prompt)
        if self.family == "flux" and not self.t.bound and self.t.guidance_embeds is None:
            # unbound: the variant from the loader's file name (schnell: timestep-distilled, fixed shift)
            names = " ".join(str((n.get("inputs") or {}).get(k, "")) for n in self.prompt.values()
                             for k in ("ckpt_name", "unet_name")).lower()
            self.t = attrs.evolve(self.t, guidance_embeds="schnell" not in names)
        order = self.order(outputs)
        for nid in order:
            if self.class_of(nid) == "ComfySwitchNode":
                self.values[nid] = self.switch(nid)
                if self.values[nid] is not None:
                    self.report[nid] = NodeReport(nid, "ComfySwitchNode", "mapped")
                continue
            ins = self.inputs(nid)
            if ins is None:
                self.values[nid] = None
                continue
            ct = self.class_of(nid)
            before = len(self.errors.get(nid, []))
            try:
                result = getattr(self, "n_" + ct)(nid, ins)
            except _NodeFailed:
                result = None
            if len(self.errors.get(nid, [])) > before:
                result = None
            self.values[nid] = result
            if result is not None and nid not in self.report:
                self.report[nid] = NodeReport(nid, ct, "mapped")
        live = self.live(outputs)
        for nid in list(self.errors):
            if nid not in live:  # only on a branch no switch selects: ComfyUI would not run it either
                del self.errors[nid]
        if self.errors:
            raise WorkflowError.from_nodes(self._node_errors())
        for nid in self.prompt:
            if nid not in live:
                self.report[nid] = NodeReport(nid, self.class_of(nid), "ignored", "on a branch no switch selects")
            if nid not in self.report:
                self.report[nid] = NodeReport(nid, self.class_of(nid), "ignored",
                                              "no output node needs it (ComfyUI does not run it either)")
        needed = {k for j in self.jobs.values() if j.saves for k in j.inputs_from.values()}
        jobs = [j for j in self.jobs.values() if (j.saves or j.key in needed) and j.key in live]  # producers first
        return CompiledPrompt(jobs=jobs, prompt=self.prompt, report=list(self.report.values()))

    def switch(self, nid: str) -> tuple[Any, ...] | None:
        """``ComfySwitchNode``: its switch value, then only the selected input (ComfyUI evaluates
        the other lazily, i.e. never); errors of the unselected branch are dropped by :meth:`live`."""
        spec = SPECS["ComfySwitchNode"]
        raw = self.prompt[nid].get("inputs", {})
        sw_in = spec.input("switch")
        assert sw_in is not None
        sw = raw.get("switch")
        if sw is None:
            self.err(nid, "required_input_missing", "Required input is missing", "switch")
            return None
        if _is_link(sw):
            src = str(sw[0])
            vals = self.values.get(src)
            if src not in self.prompt or vals is None or not isinstance(sw[1], int) or not 0 <= sw[1] < len(vals):
                if src not in self.prompt:
                    self.err(nid, "dangling_link", f"Input 'switch' is linked to node {show(sw[0])}, which is not in the prompt",
                             "switch")
                return None
            sw = vals[sw[1]]
        if not isinstance(sw, bool):
            self.err(nid, "invalid_input_type", f"switch must be a boolean, got {show(sw)}", "switch")
            return None
        name = "on_true" if sw else "on_false"
        self.switch_choice[nid] = name
        v = raw.get(name)
        if v is None:
            self.err(nid, "required_input_missing", f"the selected input {name} is missing", name)
            return None
        if _is_link(v):
            src = str(v[0])
            if src not in self.prompt:
                self.err(nid, "dangling_link", f"Input {name!r} is linked to node {show(v[0])}, which is not in the prompt",
                         name)
                return None
            vals = self.values.get(src)
            if vals is None or not isinstance(v[1], int) or not 0 <= v[1] < len(vals):
                return None
            return (vals[v[1]],)
        return (v,)

    def live(self, outputs: list[str]) -> set[str]:
        """The nodes the outputs need, following only the selected input of each switch."""
        seen: set[str] = set()
        stack = list(outputs)
        while stack:
            nid = stack.pop()
            if nid in seen or nid not in self.prompt:
                continue
            seen.add(nid)
            ins = self.prompt[nid].get("inputs", {})
            names = list(ins)
            if nid in self.switch_choice:
                names = ["switch", self.switch_choice[nid]]
            stack.extend(str(ins[n][0]) for n in names if _is_link(ins.get(n)))
        return seen

    def _node_errors(self) -> dict[str, dict[str, Any]]:
        outputs = [nid for nid, node in self.prompt.items()
                   if isinstance(node, dict) and node.get("class_type") in SPECS and SPECS[node["class_type"]].output_node]
        needs = {o: self.live([o]) for o in outputs}  # what each output node needs (ComfyUI's dependent_outputs)
        return {nid: {"errors": errs, "class_type": self.class_of(nid),
                      "dependent_outputs": [o for o in outputs if nid in needs[o]]}
                for nid, errs in self.errors.items()}

    def fail(self, nid: str, message: str, input_name: str | None = None, type_: str = "unsupported") -> None:
        """A node this runtime cannot run as asked: a node error (never a silent substitute)."""
        self.err(nid, type_, message, input_name)
        raise _NodeFailed

    def ignored(self, nid: str, reason: str) -> None:
        self.report[nid] = NodeReport(nid, self.class_of(nid), "ignored", reason)

    # -- loaders ---------------------------------------------------------------------------------
    def model_name(self, nid: str, input_name: str, file: str) -> None:
        t = self.t
        if not t.bound:
            return
        alias = t.models.get(file)
        if file == t.model or alias == t.model:
            return
        if alias is not None:
            self.fail(nid, f"{input_name} {show(file)} is an alias of model {show(alias)}; this server serves {t.model!r}",
                      input_name, "value_not_in_list")
        self.fail(nid, f"Value not in list: {input_name}: {show(file)} is neither the served model {t.model!r} nor one of "
                  f"the deploy's comfyui.models aliases ({', '.join(sorted(t.models)) or 'none'})", input_name,
                  "value_not_in_list")

    def n_CheckpointLoaderSimple(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        self.model_name(nid, "ckpt_name", ins["ckpt_name"])
        return (ModelV(self.family, (nid,), ins["ckpt_name"]), ClipV(self.family), VaeV())

    def n_UNETLoader(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        self.model_name(nid, "unet_name", ins["unet_name"])
        if ins["weight_dtype"] != "default":
            self.fail(nid, f"weight_dtype {ins['weight_dtype']!r}: the deploy's dtype / linear_precision choose the "
                      "weights' precision here; use 'default'", "weight_dtype")
        return (ModelV(self.family, (nid,), ins["unet_name"]),)

    def clip_type(self, nid: str, loader: str, kind: str | None) -> None:
        """The text-encoder loader must be the one ComfyUI uses for the served family (its ``type``
        picks the tokenizer and the encoder's role; another one would encode the prompt differently)."""
        want = CLIP_LOADERS.get(self.family or "")
        if want is None:
            return
        if (loader, kind) not in want:
            have = ", ".join(f"{cl}" + (f" type {t!r}" if t else "") for cl, t in sorted(want, key=str))
            self.fail(nid, f"{loader}" + (f" type {kind!r}" if kind else "") + f" does not load a {self.family} text "
                      f"encoder (ComfyUI's: {have})", "type" if kind else None, "value_not_in_list")

    def n_CLIPLoader(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        self.model_name(nid, "clip_name", ins["clip_name"])
        self.clip_type(nid, "CLIPLoader", ins["type"])
        return (ClipV(self.family),)

    def n_DualCLIPLoader(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        self.model_name(nid, "clip_name1", ins["clip_name1"])
        self.model_name(nid, "clip_name2", ins["clip_name2"])
        self.clip_type(nid, "DualCLIPLoader", ins["type"])
        return (ClipV(self.family),)

    def n_TripleCLIPLoader(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        for k in ("clip_name1", "clip_name2", "clip_name3"):
            self.model_name(nid, k, ins[k])
        self.clip_type(nid, "TripleCLIPLoader", None)
        return (ClipV(self.family),)

    def n_VAELoader(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        self.model_name(nid, "vae_name", ins["vae_name"])
        return (VaeV(),)

    def n_CLIPVisionLoader(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        self.model_name(nid, "clip_name", ins["clip_name"])
        return (Opaque("clip_vision"),)

    def lora(self, nid: str, file: str) -> str:
        t = self.t
        name = t.loras.get(file)
        if name is None and file in t.adapters:
            name = file
        if name is None and not t.bound:
            name = re.sub(r"[^A-Za-z0-9_.:@+=-]", "_", Path(file).stem)[:64] or "lora"
        if name is None or (t.bound and name not in t.adapters):
            self.fail(nid, f"Value not in list: lora_name: {show(file)} is not an adapter the deploy declares "
                      f"(comfyui.loras aliases: {', '.join(sorted(t.loras)) or 'none'})", "lora_name", "value_not_in_list")
        return name  # type: ignore[return-value]

    def n_LoraLoader(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        name = self.lora(nid, ins["lora_name"])
        # strength_clip scales a LoRA file's text-encoder weights; omniloop's families adapt the
        # denoiser only and the core refuses, at deploy load, an adapter file with any other keys
        # (omniloop-adapters), so a served adapter has no text-encoder weights for it to scale
        sm, sc = ins["strength_model"], ins["strength_clip"]
        m: ModelV = ins["model"]
        c: ClipV = ins["clip"]
        return (ModelV(m.family, m.loaders, m.file, m.shift, m.flux_sampling, (*m.loras, (name, sm))),
                ClipV(c.family, (*c.loras, (name, sc))))

    def n_LoraLoaderModelOnly(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        name = self.lora(nid, ins["lora_name"])
        m: ModelV = ins["model"]
        return (ModelV(m.family, m.loaders, m.file, m.shift, m.flux_sampling, (*m.loras, (name, ins["strength_model"]))),)

    # -- conditioning -----------------------------------------------------------------------------
    def n_CLIPTextEncode(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        return (CondV(ins["text"], clip_loras=ins["clip"].loras),)

    def n_CLIPTextEncodeFlux(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        if ins["clip_l"] != ins["t5xxl"]:
            self.fail(nid, "clip_l and t5xxl differ: omniloop's FLUX.1 family encodes one prompt with both "
                      "text encoders (diffusers' prompt_2 defaults to the prompt)", "t5xxl")
        return (CondV(ins["t5xxl"], guidance=ins["guidance"], clip_loras=ins["clip"].loras),)

    def n_FluxGuidance(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        c: CondV = ins["conditioning"]
        return (CondV(c.text, c.zero, ins["guidance"], c.clip_loras),)

    def n_ConditioningZeroOut(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        c: CondV = ins["conditioning"]
        return (CondV(None, True, c.guidance, c.clip_loras),)

    def n_CLIPVisionEncode(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        self.ignored(nid, "the served i2v checkpoint encodes the start image with its own image encoder")
        return (Opaque("clip_vision_output"),)

    def n_WanImageToVideo(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        img = ins.get("start_image")
        if img is None:
            self.fail(nid, "WanImageToVideo without a start_image: use an empty latent (t2v) instead", "start_image")
        lat = LatentV("wan_i2v", ins["width"], ins["height"], _pixel_frames(ins["length"]), ins["batch_size"],
                      image=img, video=True)
        return (ins["positive"], ins["negative"], lat)

    # -- values ----------------------------------------------------------------------------------
    def n_PrimitiveInt(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        return (ins["value"],)

    n_PrimitiveFloat = n_PrimitiveBoolean = n_PrimitiveString = n_PrimitiveStringMultiline = n_PrimitiveInt

    def n_ComfyMathExpression(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        names = {k: ins.get(f"values.{k}") for k in ("a", "b", "c")}
        for k, v in names.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                self.fail(nid, f"values.{k} must be a number, got {show(v)}", f"values.{k}", "invalid_input_type")
        try:
            value = safe_math(ins["expression"], {k: v for k, v in names.items() if v is not None})
        except ValueError as exc:
            self.fail(nid, f"expression: {exc}", "expression", "invalid_input_type")
        return (float(value), int(value))

    # -- latents ---------------------------------------------------------------------------------
    def n_EmptyLatentImage(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        return (LatentV("empty", ins["width"], ins["height"], None, ins["batch_size"]),)

    n_EmptySD3LatentImage = n_EmptyLatentImage

    def n_EmptyHunyuanLatentVideo(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        return (LatentV("empty", ins["width"], ins["height"], _pixel_frames(ins["length"]), ins["batch_size"], video=True),)

    def n_Wan22ImageToVideoLatent(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        img = ins.get("start_image")
        kind = "wan_i2v" if img is not None else "empty"
        return (LatentV(kind, ins["width"], ins["height"], _pixel_frames(ins["length"]), ins["batch_size"], image=img,
                        video=True),)

    def n_VAEEncode(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        img: ImageV = ins["pixels"]
        if img.kind == "decoded":  # another job's image: this one runs after it, on its output
            producer = self.jobs[img.job]  # type: ignore[index]
            if producer.request["task"] not in ("t2i", "i2i"):
                self.fail(nid, "VAEEncode of a decoded video is not supported (a second pass takes an image)", "pixels")
            w, h = producer.request["diffusion"]["width"], producer.request["diffusion"]["height"]
            return (LatentV("encoded", w, h, None, 1, image=img),)
        if img.size is None:
            self.fail(nid, "VAEEncode needs an image from LoadImage or a VAEDecode", "pixels")
        w, h = img.size  # type: ignore[misc]
        return (LatentV("encoded", w, h, None, 1, image=img),)

    def n_VAEDecode(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        lat: LatentV = ins["samples"]
        if lat.kind != "sampled" or lat.sampler is None:
            self.fail(nid, "VAEDecode of a latent no sampler produced (an empty or encoded latent) is not supported",
                      "samples")
        job = self.job(lat.sampler)  # type: ignore[arg-type]
        job.nodes.append(nid)
        return (ImageV("decoded", job=job.key),)

    # -- model sampling --------------------------------------------------------------------------
    def n_ModelSamplingSD3(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        m: ModelV = ins["model"]
        if ins["shift"] <= 0:
            self.fail(nid, "shift must be > 0", "shift", "value_smaller_than_min")
        return (ModelV(m.family, m.loaders, m.file, float(ins["shift"]), None, m.loras),)

    def n_ModelSamplingFlux(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        m: ModelV = ins["model"]
        fs = (float(ins["max_shift"]), float(ins["base_shift"]), int(ins["width"]), int(ins["height"]))
        return (ModelV(m.family, m.loaders, m.file, None, fs, m.loras),)

    # -- images ------------------------------------------------------------------------------------
    def n_LoadImage(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        name = ins["image"]
        name = re.sub(r" \[(input|output|temp)\]$", "", name)
        folder = self.t.input_dir
        if folder is None:
            if not self.t.bound:  # a compile without a server: the image is named, not read
                return (ImageV("loaded", data_b64=f"@input:{name}", size=(0, 0)), Opaque("mask"))
            self.fail(nid, "LoadImage: this server has no input folder (start it with an output folder)", "image")
        root = folder.resolve()  # type: ignore[union-attr]
        path = (root / name).resolve()
        if root not in path.parents or not path.is_file():
            self.fail(nid, f"Invalid image file: {show(name)} (not in the input folder)", "image", "value_not_in_list")
        data = path.read_bytes()
        try:
            import io

            from PIL import Image

            with Image.open(io.BytesIO(data)) as im:
                size = im.size
        except Exception as exc:
            self.fail(nid, f"Invalid image file: {show(name)} ({type(exc).__name__})", "image")
        return (ImageV("loaded", data_b64=base64.b64encode(data).decode("ascii"), size=size), Opaque("mask"))

    def _save(self, nid: str, images: ImageV, kind: str, prefix: str, options: dict[str, Any], temp: bool = False) -> None:
        if images.kind != "decoded" or images.job is None:
            self.fail(nid, "saving an image no sampler produced (a loaded image) is not supported", "images")
        if not PREFIX.match(prefix) or ".." in prefix.split("/"):
            self.fail(nid, f"filename_prefix {show(prefix)}: up to 5 folder levels of letters, digits, _ - . % : and "
                      "spaces inside the output folder (no absolute paths, no '..', no hidden names)", "filename_prefix",
                      "invalid_input_type")
        job = self.jobs[images.job]  # type: ignore[index]
        job.saves.append(SaveSpec(nid, self.class_of(nid), kind, prefix, options, temp))
        job.nodes.append(nid)

    def n_SaveImage(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        self._save(nid, ins["images"], "image", ins["filename_prefix"], {})
        return ()

    def n_PreviewImage(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        self._save(nid, ins["images"], "image", "ComfyUI_temp", {}, temp=True)
        return ()

    def n_SaveAnimatedWEBP(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        self._save(nid, ins["images"], "webp", ins["filename_prefix"],
                   {"fps": ins["fps"], "lossless": ins["lossless"], "quality": ins["quality"], "method": ins["method"]})
        self._fps(nid, ins["images"], ins["fps"])
        return ()

    def n_SaveWEBM(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        self._save(nid, ins["images"], "webm", ins["filename_prefix"],
                   {"fps": ins["fps"], "codec": ins["codec"], "crf": ins["crf"]})
        self._fps(nid, ins["images"], ins["fps"])
        return ()

    def n_CreateVideo(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        if ins.get("audio") is not None:
            self.fail(nid, "audio in CreateVideo is not supported", "audio")
        return (VideoV(ins["images"], ins["fps"]),)

    def n_SaveVideo(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        v: VideoV = ins["video"]
        self._save(nid, v.images, "video", ins["filename_prefix"], {"fps": v.fps, "format": ins["format"],
                                                                        "codec": ins["codec"]})
        self._fps(nid, v.images, v.fps)
        return ()

    def _fps(self, nid: str, images: ImageV, fps: float) -> None:
        job = self.jobs[images.job]  # type: ignore[index]
        d = job.request["diffusion"]
        if "fps" in d and d["fps"] != fps:
            return  # several saves at other rates: the first names the request's fps; files use their own
        if job.request["task"] in ("t2v", "i2v"):
            d["fps"] = float(fps)

    # -- samplers ----------------------------------------------------------------------------------
    def n_KSampler(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        self.samplers[nid] = {"kind": "simple", **ins, "noise_seed": ins["seed"], "add_noise": "enable",
                              "start_at_step": 0, "end_at_step": 10000, "return_with_leftover_noise": "disable"}
        return self._sampled(nid, ins["latent_image"])

    def n_KSamplerAdvanced(self, nid: str, ins: dict[str, Any]) -> tuple[Any, ...]:
        self.samplers[nid] = {"kind": "advanced", **ins, "seed": ins["noise_seed"], "denoise": 1.0}
        return self._sampled(nid, ins["latent_image"])

    def _sampled(self, nid: str, latent: LatentV) -> tuple[Any, ...]:
        return (LatentV("sampled", latent.width, latent.height, latent.frames, latent.batch, latent.image, nid,
                        latent.video),)

    def job(self, sampler_id: str) -> CompiledJob:
        job = self.jobs.get(sampler_id)
        if job is None:
            request, nodes = self.build(sampler_id)
            deps = {i: str(p["data_b64"])[len(FROM_JOB):] for i, p in enumerate(request["inputs"])
                    if str(p.get("data_b64", "")).startswith(FROM_JOB)}
            job = CompiledJob(key=sampler_id, request=request, nodes=nodes, inputs_from=deps,
                              split=self.expert_split if len(nodes) > 1 else None)
            self.jobs[sampler_id] = job
        return job

    def build(self, sid: str) -> tuple[dict[str, Any], list[str]]:
        """The native request of the sampler chain ending at node ``sid``."""
        s = self.samplers[sid]
        chain = [sid]
        lat: LatentV = s["latent_image"]
        first = s
        if lat.kind == "sampled":  # a second pass: only Wan 2.2's two-expert split is one request
            prev = self.samplers.get(lat.sampler or "")
            if prev is None or not (s["kind"] == prev["kind"] == "advanced"):
                self.fail(sid, "a sampler on another sampler's latent (a second pass) compiles only as Wan 2.2's "
                          "two-expert split (two KSamplerAdvanced nodes); this chain is not supported", "latent_image")
            first = prev  # type: ignore[assignment]
            chain.insert(0, lat.sampler)  # type: ignore[arg-type]
            lat = first["latent_image"]
            if lat.kind == "sampled":
                self.fail(sid, "more than two chained samplers are not supported", "latent_image")
        family = self.family
        fam = FAMILIES.get(family or "")
        if fam is None:
            self.fail(sid, f"no omniloop family for this model (family {family!r}); families with a ComfyUI mapping: "
                      f"{', '.join(FAMILIES)}", "model")
        request: dict[str, Any] = {"task": "", "inputs": [], "diffusion": {}, "node_params": {"denoise": {}}}
        d, dn = request["diffusion"], request["node_params"]["denoise"]
        # -- the sampler math -------------------------------------------------------------------
        pair = (first["sampler_name"], first["scheduler"])
        mapped = SAMPLER_TABLE.get(pair)
        if mapped is None:
            self.fail(chain[0], f"sampler_name {pair[0]!r} with scheduler {pair[1]!r} has no omniloop sampler with the "
                      f"same math; supported: {', '.join(f'{a}/{b}' for a, b in SAMPLER_TABLE)} (see the "
                      "omniloop-comfyui README)", "sampler_name")
        sampler, spacing = mapped  # type: ignore[misc]
        if self.t.flow_differs is not None:
            self.fail(chain[0], f"{pair[0]}/{pair[1]}: {self.t.flow_differs}, which ComfyUI's {pair[0]} does not do",
                      "sampler_name")
        schedule = self.t.flow_schedule or fam["schedule"]  # type: ignore[index]
        if spacing != schedule:
            need = next(f"{a}/{b}" for (a, b), (_, sp) in SAMPLER_TABLE.items() if sp == schedule)
            hint = (f" (a deploy's policies.sampler_options: {{flow-euler: {{sigma_schedule: {spacing}}}}} makes it "
                    f"ComfyUI's euler/{pair[1]})" if family in ("wan", "sd3") and spacing != "default" else "")
            self.fail(chain[0], f"{pair[0]}/{pair[1]} on a {family} model: its flow-euler sampler spaces sigmas "
                      f"{schedule!r}, which is ComfyUI's {need}{hint}", "scheduler")
        dn["sampler"] = sampler
        steps = int(first["steps"])
        if spacing == "linear" and fam["table"] % steps:  # type: ignore[index]
            self.fail(chain[0], f"steps {steps}: ComfyUI's 'simple' schedule rounds to its {fam['table']}-entry sigma "  # type: ignore[index]
                      f"table unless steps divides {fam['table']}; the linear schedule differs otherwise", "steps")
        for s2 in (self.samplers[c] for c in chain[1:]):
            if (s2["sampler_name"], s2["scheduler"], s2["steps"]) != (first["sampler_name"], first["scheduler"], steps):
                self.fail(chain[-1], "the two experts' samplers must share sampler_name, scheduler and steps", "steps")
        seed = int(first["seed"])
        if seed > MAX_OMNI_SEED:
            self.fail(chain[0], f"Value {seed} bigger than max of {MAX_OMNI_SEED}: seed (omniloop seeds are 63-bit)",
                      "seed" if first["kind"] == "simple" else "noise_seed", "value_bigger_than_max")
        if first["add_noise"] != "enable":
            self.fail(chain[0], "add_noise 'disable' on the first sampler: the chain must start from noise", "add_noise")
        d["seed"], d["steps"] = seed, steps
        # -- the model ------------------------------------------------------------------------------
        models = [self.samplers[c]["model"] for c in chain]
        m: ModelV = models[0]
        if m.loras:
            request["adapters"] = [{"name": n, "scale": float(sc)} for n, sc in m.loras]
        # -- latent / task --------------------------------------------------------------------------
        if lat.batch != 1:
            self.fail(chain[0], f"batch_size {lat.batch}: one request makes one image/video here (ComfyUI draws one "
                      "noise tensor for the batch); queue several prompts or seeds instead", "latent_image")
        video = bool(lat.video)
        if video != bool(fam["video"]):  # type: ignore[index]
            self.fail(chain[0], f"a {'video' if video else 'image'} latent on a {family} model", "latent_image")
        d["width"], d["height"] = int(lat.width), int(lat.height)
        if video:
            d["frames"] = int(lat.frames or 1)
        denoise = float(first["denoise"])
        if lat.kind == "empty":
            request["task"] = "t2v" if video else "t2i"
            if denoise != 1.0:
                self.fail(chain[0], f"denoise {denoise} on an empty latent: ComfyUI would start from noise at a partial "
                          "schedule, which no omniloop task does", "denoise")
        elif lat.kind == "encoded":
            request["task"] = "i2i"
            if denoise >= 1.0:
                self.fail(chain[0], "an encoded image with denoise 1.0 ignores the image; set denoise < 1 (image-to-image)",
                          "denoise")
            if denoise <= 0:
                self.fail(chain[0], f"denoise {denoise}: no step would run (ComfyUI returns the image unchanged)",
                          "denoise")
            if first["kind"] != "simple":
                self.fail(chain[0], "image-to-image through KSamplerAdvanced is not supported; use KSampler's denoise",
                          "latent_image")
            total = int(steps / denoise)  # ComfyUI: a schedule of steps/denoise steps, the last `steps` of it
            from omniloop_policies.samplers import strength_start

            strength = steps / total
            if strength_start(total, strength) != total - steps:
                strength = math.nextafter(strength, 1.0)
            d["steps"] = total
            dn["strength"] = strength
            img = lat.image
            if img is not None and img.kind == "decoded":
                request["inputs"].append({"type": "image", "data_b64": FROM_JOB + str(img.job), "role": "image"})
            else:
                request["inputs"].append({"type": "image", "data_b64": img.data_b64, "role": "image"})  # type: ignore[union-attr]
        elif lat.kind == "wan_i2v":
            request["task"] = "i2v"
            if denoise != 1.0:
                self.fail(chain[0], "denoise < 1 on an image-to-video latent is not supported", "denoise")
            img = lat.image
            if img is None or img.kind != "loaded":
                self.fail(chain[0], "the start image must come from LoadImage", "latent_image")
            request["inputs"].append({"type": "image", "data_b64": img.data_b64, "role": "first_frame"})  # type: ignore[union-attr]
        if self.t.bound and self.t.tasks and request["task"] not in self.t.tasks:
            self.fail(chain[0], f"the served model does not do {request['task']!r} (it does: "
                      f"{', '.join(sorted(self.t.tasks))})", "latent_image")
        # -- shift -----------------------------------------------------------------------------------
        shifts = {mm.shift for mm in models}
        if len(shifts) > 1:
            self.fail(chain[-1], "the two experts' ModelSamplingSD3 shifts differ", "model")
        flux_negative = None
        if family == "flux":
            flux_negative = self.flux(chain[0], m, first, d, dn)
        else:
            if m.flux_sampling is not None:
                self.fail(chain[0], "ModelSamplingFlux on a non-FLUX model", "model")
            d["shift"] = float(m.shift if m.shift is not None else fam["comfy_shift"])  # type: ignore[index]
            if self.t.scheduler.get("use_dynamic_shifting"):
                self.fail(chain[0], "this checkpoint shifts its schedule by resolution; a fixed ComfyUI shift differs",
                          "model")
        # -- guidance and text -------------------------------------------------------------------------
        pos: CondV = first["positive"]
        neg: CondV = first["negative"]
        if pos.zero or pos.text is None:
            self.fail(chain[0], "the positive conditioning is zeroed out", "positive")
        if not (pos.text or "").strip():
            self.fail(chain[0], "the positive prompt is empty (omniloop requests need a prompt)", "positive")
        request["inputs"].insert(0, {"type": "text", "text": pos.text, "role": "prompt"})
        if flux_negative:
            request["inputs"].insert(1, {"type": "text", "text": flux_negative, "role": "negative_prompt"})
        cfgs = [float(self.samplers[c]["cfg"]) for c in chain]
        if family != "flux":
            for c, cfg in zip(chain, cfgs, strict=True):
                if cfg < 1.0:
                    self.fail(c, f"cfg {cfg} < 1: ComfyUI still combines cond and uncond, omniloop guides only above 1",
                              "cfg")
            d["guidance_scale"] = cfgs[0]
            if len(chain) > 1:
                dn["guidance_scale_2"] = cfgs[1]
            if max(cfgs) > 1.0:
                if neg.zero:
                    self.fail(chain[0], "a zeroed-out negative with cfg > 1: omniloop's negative is the encoded (empty) "
                              "prompt", "negative")
                if neg.text:
                    request["inputs"].append({"type": "text", "text": neg.text, "role": "negative_prompt"})
        for c in chain[1:]:
            p2, n2 = self.samplers[c]["positive"], self.samplers[c]["negative"]
            if (p2.text, n2.text, p2.zero, n2.zero) != (pos.text, neg.text, pos.zero, neg.zero):
                self.fail(c, "the two experts' prompts differ", "positive")
        # -- the two-expert split ------------------------------------------------------------------------
        if len(chain) == 2:
            self.experts(chain, models, steps, d)
        else:
            if first["kind"] == "advanced":
                if first["start_at_step"] != 0 or first["end_at_step"] < steps:
                    self.fail(chain[0], "start_at_step/end_at_step must run the whole schedule (0 to >= steps) for a "
                              "single sampler", "end_at_step")
                if first["return_with_leftover_noise"] == "enable" and first["end_at_step"] < steps:
                    self.fail(chain[0], "return_with_leftover_noise on the last sampler", "return_with_leftover_noise")
        if not dn:
            del request["node_params"]
        return request, list(chain)

    def flux(self, sid: str, m: ModelV, s: dict[str, Any], d: dict[str, Any], dn: dict[str, Any]) -> str | None:
        """FLUX.1's shift and guidance; returns the negative prompt when true CFG uses one."""
        t = self.t
        dynamic = bool(t.scheduler.get("use_dynamic_shifting")) if t.bound else t.guidance_embeds is not False
        if m.shift is not None:
            self.fail(sid, "ModelSamplingSD3 on a FLUX.1 model: ComfyUI's FLUX.1 shift is ModelSamplingFlux", "model")
        if m.flux_sampling is not None:
            max_shift, base_shift, w, h = m.flux_sampling
            if not dynamic:
                self.fail(sid, "ModelSamplingFlux (a resolution-dependent shift) on a checkpoint with a fixed shift",
                          "model")
            cfgv = t.scheduler
            want = (cfgv.get("max_shift", 1.15), cfgv.get("base_shift", 0.5), cfgv.get("base_image_seq_len", 256),
                    cfgv.get("max_image_seq_len", 4096))
            if t.bound and ((max_shift, base_shift) != (float(want[0]), float(want[1])) or (want[2], want[3]) != (256, 4096)):
                self.fail(sid, f"ModelSamplingFlux max_shift/base_shift {max_shift}/{base_shift} differ from the "
                          f"checkpoint's scheduler config ({want[0]}/{want[1]}, sequence lengths {want[2]}-{want[3]})",
                          "model")
            if t.vae_scale not in (None, 8) or w % 16 or h % 16:
                self.fail(sid, f"ModelSamplingFlux counts width*height/256 tokens; the checkpoint packs "
                          f"{(h // ((t.vae_scale or 8) * 2)) * (w // ((t.vae_scale or 8) * 2))} tokens at {w}x{h} "
                          f"(VAE scale {t.vae_scale or 8}, sizes multiples of 16 match)", "model")
            if (w, h) != (d["width"], d["height"]):
                self.fail(sid, f"ModelSamplingFlux width/height {w}x{h} differ from the latent's {d['width']}x{d['height']}: "
                          "omniloop shifts by the image's own size", "model")
        else:
            if dynamic:
                self.fail(sid, "FLUX.1 [dev] without ModelSamplingFlux: ComfyUI shifts by a constant mu 1.15, this "
                          "checkpoint by resolution (add ModelSamplingFlux with the latent's size)", "model")
            mu = 1.0  # ComfyUI's FLUX.1 [schnell] sampling settings (shift 1.0 as mu: sigma' = e^mu / (e^mu + 1/t - 1))
            d["shift"] = math.exp(mu)
        cfg = float(s["cfg"])
        pos: CondV = s["positive"]
        neg: CondV = s["negative"]
        embedded = pos.guidance if pos.guidance is not None else 3.5  # ComfyUI's FLUX.1 default guidance
        has_embed = t.guidance_embeds if t.bound else dynamic
        if cfg == 1.0:
            dn["cfg"] = "embedded"
            if has_embed:
                d["guidance_scale"] = embedded
        elif cfg > 1.0:
            dn["cfg"] = "classic"
            d["guidance_scale"] = cfg
            if neg.zero:
                self.fail(sid, "a zeroed-out negative with cfg > 1: omniloop's true CFG encodes the negative prompt", "negative")
            if has_embed and t.default_guidance is not None and embedded != t.default_guidance:
                self.fail(sid, f"FluxGuidance {embedded} with cfg > 1: the embedded guidance is then the checkpoint's "
                          f"default ({t.default_guidance})", "positive")
            return neg.text or None
        else:
            self.fail(sid, f"cfg {cfg} < 1 is not supported", "cfg")
        return None

    def experts(self, chain: list[str], models: list[ModelV], steps: int, d: dict[str, Any]) -> None:
        a, b = (self.samplers[c] for c in chain)
        t = self.t
        if self.family != "wan":
            self.fail(chain[1], "two chained samplers compile only as Wan 2.2's two experts", "latent_image")
        if a["return_with_leftover_noise"] != "enable" or a["start_at_step"] != 0:
            self.fail(chain[0], "the high-noise expert must start at step 0 and return with leftover noise",
                      "return_with_leftover_noise")
        if b["add_noise"] != "disable" or b["return_with_leftover_noise"] != "disable":
            self.fail(chain[1], "the low-noise expert must not add noise nor return leftover noise", "add_noise")
        k = int(a["end_at_step"])
        self.expert_split = k
        if b["start_at_step"] != k or b["end_at_step"] < steps:
            self.fail(chain[1], f"the low-noise expert must run from step {k} (where the first ends) to the end",
                      "start_at_step")
        if models[0].loras != models[1].loras:
            self.fail(chain[1], "the two experts' LoRA chains differ; an omniloop request applies one adapter list to "
                      "both experts", "model")
        if models[0].file == models[1].file and t.bound:
            self.fail(chain[1], "both experts load the same file; the low-noise expert is the checkpoint's transformer_2",
                      "model")
        if not t.bound:
            return
        if t.boundary_ratio is None:
            self.fail(chain[1], "the served model has one expert (no boundary_ratio); a two-expert split needs Wan 2.2",
                      "model")
        switch = _switch_step(t.scheduler, d["shift"], steps, t.boundary_ratio, t.flow_schedule)  # type: ignore[arg-type]
        if switch != k:
            self.fail(chain[0], f"end_at_step {k}: the checkpoint switches experts at boundary_ratio "
                      f"{t.boundary_ratio} (step {switch} of {steps} at shift {d['shift']}); set end_at_step {switch}",
                      "end_at_step")


_MATH_FUNCS = {"floor": math.floor, "ceil": math.ceil, "round": round, "abs": abs, "min": min, "max": max,
               "sqrt": math.sqrt, "int": int, "float": float}


def safe_math(expression: str, names: dict[str, float]) -> float:
    """Evaluate ComfyMathExpression's arithmetic without ``eval``: numbers, the names given,
    ``+ - * / // % **`` (exponents up to 64), unary ``- +`` and :data:`_MATH_FUNCS`. ValueError else."""
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
    if len(expression) > 500:
        raise ValueError("longer than 500 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {show(expression)}") from None

    def ev(node: Any, depth: int = 0) -> Any:
        if depth > 50:
            raise ValueError("nested too deeply")
        if isinstance(node, ast.Expression):
            return ev(node.body, depth + 1)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in names:
                raise ValueError(f"unknown name {node.id!r} (a, b, c are the inputs)")
            return names[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand, depth + 1)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            a, b = ev(node.left, depth + 1), ev(node.right, depth + 1)
            if isinstance(node.op, ast.Pow) and abs(b) > 64:
                raise ValueError("exponents above 64 are refused")
            try:
                return ops[type(node.op)](a, b)
            except (ZeroDivisionError, OverflowError) as exc:
                raise ValueError(str(exc)) from None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _MATH_FUNCS
                and not node.keywords and 1 <= len(node.args) <= 4):
            try:
                return _MATH_FUNCS[node.func.id](*(ev(a, depth + 1) for a in node.args))
            except (ValueError, OverflowError, TypeError) as exc:
                raise ValueError(str(exc)) from None
        raise ValueError(f"not allowed in an expression: {type(node).__name__}")

    value = ev(tree)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the result is not a finite number: {show(value)}")
    return value


def _switch_step(scheduler: dict[str, Any], shift: float, steps: int, ratio: float, schedule: str | None = None) -> int:
    """The first step whose timestep is below ``ratio * num_train_timesteps``: where the family's
    boundary router hands over to the low-noise expert (``flow-euler`` with ``schedule``'s spacing)."""
    from omniloop_policies.samplers import FlowEulerSampler

    s = FlowEulerSampler.from_config({**scheduler, "_class_name": scheduler.get("_class_name", "FlowMatchEulerDiscreteScheduler")},
                                     sigma_schedule=schedule if schedule in ("linear", "sgm_uniform") else None)
    st = s.init(steps, shift=shift)
    boundary = ratio * s.num_train_timesteps
    for i, t in enumerate(st.timestep_values):
        if t < boundary:
            return i
    return steps


class _NodeFailed(Exception):
    pass


_BAD = object()


def _kind_of(value: Any) -> str:
    """The ComfyUI type of a value flowing along a link (what a ``*`` output actually carries)."""
    kinds = {ModelV: "MODEL", ClipV: "CLIP", VaeV: "VAE", CondV: "CONDITIONING", LatentV: "LATENT", ImageV: "IMAGE",
             VideoV: "VIDEO"}
    if type(value) in kinds:
        return kinds[type(value)]
    if isinstance(value, Opaque):
        return {"clip_vision": "CLIP_VISION", "clip_vision_output": "CLIP_VISION_OUTPUT", "mask": "MASK"}.get(value.what, "*")
    if isinstance(value, bool):
        return "BOOLEAN"
    return {int: "INT", float: "FLOAT", str: "STRING"}.get(type(value), "*")


def _is_link(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and isinstance(v[0], (str, int)) and not isinstance(v[0], bool)


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool)) or v is None else show(v)


def _pixel_frames(length: int) -> int:
    """The frames ComfyUI decodes from a video latent of ``length``: ``((length - 1) // 4) * 4 + 1``."""
    return ((int(length) - 1) // 4) * 4 + 1


def _guess_family(prompt: dict[str, Any]) -> str | None:
    """An unbound target's family, from the loaders (text encoder type, file names) and latent nodes."""
    kinds = set()
    for node in prompt.values():
        ct, ins = node.get("class_type"), node.get("inputs") or {}
        if ct == "CLIPLoader" and ins.get("type") in ("wan", "sd3"):
            kinds.add(ins["type"])
        if ct == "DualCLIPLoader" and ins.get("type") in ("flux", "sd3"):
            kinds.add(ins["type"])
        if ct == "TripleCLIPLoader":
            kinds.add("sd3")
        if ct in ("WanImageToVideo", "Wan22ImageToVideoLatent"):
            kinds.add("wan")
        if ct == "ModelSamplingFlux" or ct == "FluxGuidance":
            kinds.add("flux")
        for key in ("ckpt_name", "unet_name"):
            name = str(ins.get(key, "")).lower()
            for fam in ("flux", "wan", "sd3"):
                if name.startswith(fam) or f"/{fam}" in name:
                    kinds.add(fam)
    return next(iter(kinds)) if len(kinds) == 1 else None


def load_workflow(workflow: Any) -> dict[str, Any]:
    """Either format → the API format (a copy); anything else is ``invalid_prompt``."""
    if is_ui_format(workflow):
        return to_api_format(workflow)
    if isinstance(workflow, dict) and isinstance(workflow.get("prompt"), dict) and "class_type" not in workflow:
        workflow = workflow["prompt"]  # a saved {"prompt": ...} body
    if not isinstance(workflow, dict):
        raise WorkflowError("invalid_prompt", "a workflow is a JSON object: the API format {id: {class_type, inputs}} "
                            "or the editor format {nodes, links}")
    return {str(k): v for k, v in workflow.items()}


def compile_workflow(workflow: Any, target: Target | None = None, *, outputs: list[str] | None = None) -> CompiledPrompt:
    """Compile ``workflow`` (API or editor format) against ``target``; raises :class:`WorkflowError`.
    ``outputs``: only these output nodes (ComfyUI's ``partial_execution_targets``), else all."""
    prompt = load_workflow(workflow)
    c = _Compiler(prompt, target or Target(), outputs)
    out = c.run()
    return out


def check_workflow(workflow: Any, target: Target | None = None) -> tuple[list[NodeReport], WorkflowError | None]:
    """Coverage: each node mapped / ignored (with the reason) / unsupported (with the error)."""
    prompt = load_workflow(workflow)
    c = _Compiler(prompt, target or Target())
    try:
        out = c.run()
        return out.report, None
    except WorkflowError as exc:
        rows: list[NodeReport] = []
        for nid, node in prompt.items():
            ct = str(node.get("class_type")) if isinstance(node, dict) else "?"
            if nid in exc.node_errors:
                rows.append(NodeReport(nid, ct, "unsupported", "; ".join(e["message"] for e in exc.node_errors[nid]["errors"])))
            elif exc.extra_info.get("node_id") == nid:
                rows.append(NodeReport(nid, ct, "unsupported", exc.message))
            elif nid in c.report:
                rows.append(c.report[nid])
            elif ct in SPECS:
                rows.append(NodeReport(nid, ct, "mapped" if c.values.get(nid) is not None else "ignored",
                                       "" if c.values.get(nid) is not None else "depends on an unsupported node"))
            else:
                rows.append(NodeReport(nid, ct, "unsupported", "unknown node class"))
        return rows, exc
