"""A toy model family on a real (tiny) torch model, for core tests and plugin authors.

It exercises every contract a real family does: a checkpoint on disk with validation, a text
encoder, a denoise ``LoopStage`` (flow-matching Euler, classic CFG with ``cond``/``uncond``
branches, blocks through ``run_blocks``, step interceptors through ``call_model``, taps, batched
steps) and a decoder writing uint8 video frames. It is registered only where a test asks for it
(``toy_plugin``), never through an entry point.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from attrs import define, field
from torch import nn

from ..artifacts import Embeddings, Latents, VideoFrames
from ..capabilities import FamilyCapabilities
from ..context import StageContext
from ..errors import CheckpointError, RequestError
from ..family import LoadedModel
from ..graph import Node, PipelineSpec
from ..hookspecs import hookimpl
from ..interceptors import call_model, run_blocks
from ..loop import LoopState, RequestState, StepContext, StepResult
from ..request import OmniRequest, TaskType
from ..resolved import Workload, bounds

CONFIG_NAME = "omniloop_toy.json"
WEIGHTS_NAME = "toy.pt"
DEFAULT_CONFIG = {"family": "toy", "channels": 4, "dim": 32, "layers": 4, "vocab": 97, "scale": 4}


def tokenize(text: str, vocab: int) -> torch.Tensor:
    ids = [zlib.crc32(w.encode()) % (vocab - 1) + 1 for w in text.lower().split()] or [0]
    return torch.tensor(ids, dtype=torch.long)


class ToyTextEncoder(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embed(ids).mean(dim=0, keepdim=True)  # [1, dim]
        return out


class ToyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))
        self.mod = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.mlp(self.norm(x) * (1 + self.mod(cond)))
        return out


class ToyTransformer(nn.Module):
    def __init__(self, channels: int, dim: int, layers: int) -> None:
        super().__init__()
        self.dim = dim
        self.proj_in = nn.Linear(channels, dim)
        self.time = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim) for _ in range(layers))
        self.proj_out = nn.Linear(dim, channels)

    def time_embed(self, t: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        out: torch.Tensor = self.time(torch.cat([args.sin(), args.cos()], dim=-1))
        return out

    def forward(
        self, latents: torch.Tensor, t: torch.Tensor, text: torch.Tensor, block_ctx: Any = None
    ) -> torch.Tensor:
        b, c, f, h, w = latents.shape
        x = latents.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)
        x = self.proj_in(x)
        cond = (self.time_embed(t) + text)[:, None, :]
        x = run_blocks(self.blocks, x, block_ctx, lambda blk, hid: blk(hid, cond))
        x = self.proj_out(x)
        out: torch.Tensor = x.reshape(b, f, h, w, c).permute(0, 4, 1, 2, 3)
        return out


class ToyDecoder(nn.Module):
    def __init__(self, channels: int, scale: int) -> None:
        super().__init__()
        self.scale = scale
        self.proj = nn.Conv3d(channels, 3, kernel_size=1)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        x = self.proj(latents)
        out: torch.Tensor = torch.nn.functional.interpolate(x, scale_factor=(1, self.scale, self.scale), mode="nearest")
        return out


def build_toy_checkpoint(path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a toy checkpoint (config + weights) to ``path`` and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**DEFAULT_CONFIG, **overrides}
    torch.manual_seed(seed)
    comps = _make_components(cfg)
    (path / CONFIG_NAME).write_text(json.dumps(cfg, indent=1))
    torch.save({k: m.state_dict() for k, m in comps.items()}, path / WEIGHTS_NAME)
    return path


def _make_components(cfg: dict[str, Any]) -> dict[str, nn.Module]:
    return {
        "text_encoder": ToyTextEncoder(cfg["vocab"], cfg["dim"]),
        "transformer": ToyTransformer(cfg["channels"], cfg["dim"], cfg["layers"]),
        "decoder": ToyDecoder(cfg["channels"], cfg["scale"]),
    }


# --------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------


@define(frozen=True)
class ToyDenoiseParams:
    """Per-request knobs of the toy denoise node."""

    guidance_scale: float | None = field(default=None, metadata={"ge": 0.0})


@define(frozen=True)
class ToyResolved:
    """A toy request resolved once (``ToyFamily.resolve``): defaults applied, sizes checked."""

    task: TaskType
    steps: int
    guidance_scale: float
    frames: int
    height: int
    width: int
    fps: float
    warnings: tuple[str, ...] = ()

    @property
    def branches(self) -> tuple[str, ...]:
        return ("cond", "uncond") if self.guidance_scale > 1.0 else ("cond",)

    def workload(self) -> Workload:
        return Workload(steps=self.steps, branches=len(self.branches), frames=self.frames,
                        height=self.height, width=self.width,  # bounded: what the deploy's limits bound
                        bounded=bounds(steps=self.steps, frames=self.frames, height=self.height, width=self.width))


def resolve_toy(model: LoadedModel | None, request: OmniRequest, node_params: Any = None) -> ToyResolved:
    """Check a toy request and apply the defaults; ``node_params`` are the validated node params."""
    defaults = ToyFamily.defaults
    d = request.diffusion
    scale = model.config["scale"] if model is not None else DEFAULT_CONFIG["scale"]
    for name in ("height", "width"):
        v = getattr(d, name)
        if v is not None and v % scale:
            raise RequestError(f"diffusion.{name}", f"must be a multiple of {scale}, got {v}")
    if request.task is TaskType.T2I and d.frames not in (None, 1):
        raise RequestError("diffusion.frames", "a t2i request makes one frame")
    if not request.prompt:
        raise RequestError("inputs", "a prompt (text part with role 'prompt') is required")
    params = (node_params or {}).get("denoise")
    g = params.guidance_scale if params is not None and params.guidance_scale is not None else d.guidance_scale
    return ToyResolved(
        task=request.task, steps=d.steps or defaults["steps"],
        guidance_scale=defaults["guidance_scale"] if g is None else g,
        frames=d.frames or defaults["frames"], height=d.height or defaults["height"],
        width=d.width or defaults["width"], fps=d.fps or 8.0,
    )


def _resolved(ctx: StageContext, state: RequestState) -> ToyResolved:
    r = ctx.resolved
    if isinstance(r, ToyResolved):
        return r
    # a stage driven by hand, outside a runtime: the same resolution, from this node's params
    return resolve_toy(None, state.request, {ctx.node.name: ctx.params})


class EncodeText:
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        enc = ctx.components["text_encoder"]
        vocab = enc.embed.num_embeddings
        with torch.no_grad():
            pos = enc(tokenize(state.request.prompt or "", vocab).to(ctx.device))
            neg = enc(tokenize(state.request.negative_prompt or "", vocab).to(ctx.device))
        state.write("prompt_embeds", Embeddings(tensor=pos), ctx.node.name)
        state.write("negative_embeds", Embeddings(tensor=neg), ctx.node.name)


class Denoise:
    """Flow-matching Euler with classic CFG; one solver step per ``step()``."""

    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        r = _resolved(ctx, state)
        steps, guidance, frames, height, width = r.steps, r.guidance_scale, r.frames, r.height, r.width
        tr: ToyTransformer = ctx.components["transformer"]
        c = tr.proj_in.in_features
        scale = ctx.components["decoder"].scale
        latents = torch.randn((1, c, frames, height // scale, width // scale), generator=state.generator).to(ctx.device)
        sigmas = torch.linspace(1.0, 0.0, steps + 1)
        loop = LoopState(total=steps, branches=r.branches)
        loop.tensors["latents"] = latents
        loop.extra.update(sigmas=sigmas, guidance=guidance)
        return loop

    def _predict(self, ctx: StageContext, state: RequestState, loop: LoopState, step: StepContext) -> torch.Tensor:
        tr: ToyTransformer = ctx.components["transformer"]
        lat = loop.tensors["latents"]
        t = torch.tensor([step.timestep], device=lat.device)
        preds: dict[str, torch.Tensor] = {}
        for branch in loop.branches:
            sc = step.with_branch(branch)
            text = state.read("prompt_embeds" if branch == "cond" else "negative_embeds", Embeddings).tensor
            bctx = ctx.block_context(sc, loop)

            def compute(text: torch.Tensor = text, bctx: Any = bctx) -> torch.Tensor:
                out: torch.Tensor = tr(lat, t, text, bctx)
                return out

            preds[branch] = call_model(ctx.step_interceptors, sc, loop, {"latents": lat}, compute)
            if ctx.taps_enabled:
                ctx.tap("noise_pred", preds[branch], sc)
        if "uncond" in preds:
            g = loop.extra["guidance"]
            guided: torch.Tensor = preds["uncond"] + g * (preds["cond"] - preds["uncond"])
            return guided
        return preds["cond"]

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        sigmas = loop.extra["sigmas"]
        i = loop.step
        step = StepContext(state.request.request_id, ctx.node.name, i, loop.total, float(sigmas[i] * 1000))
        with torch.no_grad():
            v = self._predict(ctx, state, loop, step)
            if ctx.taps_enabled:
                ctx.tap("guided", v, step)
            lat = loop.tensors["latents"] + (sigmas[i + 1] - sigmas[i]) * v
        loop.tensors["latents"] = lat
        if ctx.taps_enabled:
            ctx.tap("latents", lat, step)
        return StepResult(done=i + 1 >= loop.total)

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        state.write("latents", Latents(tensor=loop.tensors["latents"]), ctx.node.name)

    # batched step: same shape, steps and guidance → one forward over the stacked batch
    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None:
        if ctx.block_interceptor is not None or ctx.step_interceptors or ctx.taps_enabled:
            return None
        return (tuple(loop.tensors["latents"].shape), loop.total, loop.step, loop.extra["guidance"], loop.branches)

    def step_batch(
        self, ctxs: Sequence[StageContext], states: Sequence[RequestState], loops: Sequence[LoopState]
    ) -> list[StepResult]:
        tr: ToyTransformer = ctxs[0].components["transformer"]
        loop0 = loops[0]
        i = loop0.step
        sigmas = loop0.extra["sigmas"]
        lat = torch.cat([lp.tensors["latents"] for lp in loops])
        t = torch.full((len(loops),), float(sigmas[i] * 1000), device=lat.device)
        with torch.no_grad():
            preds = {}
            for branch in loop0.branches:
                name = "prompt_embeds" if branch == "cond" else "negative_embeds"
                text = torch.cat([s.read(name, Embeddings).tensor for s in states])
                preds[branch] = tr(lat, t, text)
            v = preds["cond"]
            if "uncond" in preds:
                v = preds["uncond"] + loop0.extra["guidance"] * (preds["cond"] - preds["uncond"])
            new = lat + (sigmas[i + 1] - sigmas[i]) * v
        for j, lp in enumerate(loops):
            lp.tensors["latents"] = new[j : j + 1]
        return [StepResult(done=i + 1 >= lp.total) for lp in loops]


class Decode:
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        lat = state.read("latents", Latents).tensor
        with torch.no_grad():
            x = ctx.components["decoder"](lat)[0]  # [3, T, H, W]
        frames = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).contiguous().cpu()
        fps = _resolved(ctx, state).fps
        state.write("video", VideoFrames(frames=frames, fps=fps), ctx.node.name)


# --------------------------------------------------------------------------------------------
# The family
# --------------------------------------------------------------------------------------------


class ToyFamily:
    name = "toy"
    tasks = frozenset({TaskType.T2V, TaskType.T2I})
    #: what it can do beyond the required methods (omniloop.capabilities)
    #: step_batch_retry_alone: Denoise.step_batch changes no request state until its forward has
    #: returned, so a batched forward that raises is re-run one request at a time (failure isolation)
    capabilities = FamilyCapabilities(block_interceptors=True, returns_latents=True, inspect=True, resolve=True,
                                      task_defaults=True, step_batch_retry_alone={"denoise"})
    defaults: ClassVar[dict[str, Any]] = {"steps": 4, "guidance_scale": 3.0, "frames": 3, "height": 16, "width": 16}

    def task_defaults(self, model: LoadedModel, task: TaskType) -> dict[str, Any]:
        d = {**self.defaults, "fps": 8.0}
        if task is TaskType.T2I:
            d["frames"] = 1
        return d

    def detect(self, path: Path) -> bool:
        f = Path(path) / CONFIG_NAME
        return f.is_file() and json.loads(f.read_text()).get("family") == "toy"

    def inspect(self, path: Path, *, options: dict[str, Any]) -> LoadedModel:
        """The checkpoint's config without its weights (optional family method): the runtime's
        weight-free request checks (``Deployment.check``) run ``validate_request`` on it."""
        return LoadedModel(family=self.name, path=Path(path), components={}, config=self._config(Path(path)))

    def _config(self, path: Path) -> dict[str, Any]:
        cfg_file = path / CONFIG_NAME
        if not cfg_file.is_file():
            raise CheckpointError(f"{cfg_file}: missing (not a toy checkpoint)")
        try:
            return {**DEFAULT_CONFIG, **json.loads(cfg_file.read_text())}
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{cfg_file}: malformed JSON: {exc}") from None

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        path = Path(path)
        weights = path / WEIGHTS_NAME
        cfg = self._config(path)
        if not weights.is_file():
            raise CheckpointError(f"{weights}: missing weights file")
        try:
            state = torch.load(weights, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"{weights}: cannot read weights: {exc}") from None
        comps = _make_components(cfg)
        for name, mod in comps.items():
            if name not in state:
                raise CheckpointError(f"{weights}: no weights for component {name!r}")
            try:
                mod.load_state_dict(state[name])
            except RuntimeError as exc:
                raise CheckpointError(f"{weights}: weights for {name!r} do not match the config: {exc}") from None
            mod.to(device=device, dtype=dtype).eval()
        return LoadedModel(family=self.name, path=path, components=comps, config=cfg, device=device, dtype=dtype)

    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        return PipelineSpec(
            family=self.name,
            task=task,
            nodes=(
                Node("text_encode", EncodeText(), writes={"prompt_embeds": Embeddings, "negative_embeds": Embeddings},
                     uses=("text_encoder",)),
                Node("denoise", Denoise(), reads={"prompt_embeds": Embeddings, "negative_embeds": Embeddings},
                     writes={"latents": Latents}, params_schema=ToyDenoiseParams, uses=("transformer",)),
                Node("decode", Decode(), reads={"latents": Latents}, writes={"video": VideoFrames}, uses=("decoder",)),
            ),
            outputs={"video": "video", "latents": "latents"},
        )

    def resolve(self, model: LoadedModel, request: OmniRequest, limits: Any, *, node_params: Any = None) -> ToyResolved:
        """The request resolved once (``Runtime.prepare`` calls this; stages read ``ctx.resolved``)."""
        return resolve_toy(model, request, node_params)

    def validate_request(self, model: LoadedModel, request: OmniRequest, limits: Any) -> list[str]:
        return list(resolve_toy(model, request).warnings)


class ToyPlugin:
    """The toy family as an in-process plugin object: ``manager.add("toy", ToyPlugin())``."""

    OMNILOOP_HOOK_API = ">=1.0,<2"

    @hookimpl
    def omniloop_register_families(self, register: Any) -> None:
        register(ToyFamily())
