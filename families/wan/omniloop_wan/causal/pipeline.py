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

Sessions (``node_params.rollout``): ``keep_session: true`` keeps the stream after the request
(its id in ``output.metrics["session"]``); ``session: <id>`` continues it with this request's
prompt. Cancelling or failing a request frees its slabs (``release``). Sessions, engines and the
slab pool belong to the loaded model (``model.config["causal"]``), one pool per video size.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from attrs import define, field

from omniloop.artifacts import Conditioning, Embeddings, VideoFrames
from omniloop.context import StageContext
from omniloop.errors import DeployError, RequestError
from omniloop.family import LoadedModel
from omniloop.graph import Node, PipelineSpec
from omniloop.loop import LoopState, RequestState, StepResult
from omniloop.request import TaskType
from omniloop_kvcache import CacheManager

from ..stages import TextEncode, Validate, to_uint8_frames
from .rollout import CausalOptions, CausalWan, ChunkOut
from .sessions import SessionError, SessionStore

ROLLOUTS = ("bidirectional", "causal")
_SESSION_RE = re.compile(r"^sess-[0-9a-f]{24}$")


def rollout_mode(options: Mapping[str, Any] | None) -> str:
    """``options.rollout``: ``bidirectional`` (default) or ``causal``; anything else is refused."""
    mode = (options or {}).get("rollout", "bidirectional")
    if mode not in ROLLOUTS:
        raise DeployError(f"options.rollout: must be one of {', '.join(ROLLOUTS)}, not {mode!r}")
    return str(mode)


def causal_options(options: Mapping[str, Any] | None) -> CausalOptions:
    """``options.rollout_options`` as :class:`CausalOptions`; a bad key or value names its path."""
    raw = (options or {}).get("rollout_options") or {}
    if not isinstance(raw, Mapping):
        raise DeployError(f"options.rollout_options: expected a mapping, got {type(raw).__name__}")
    known = {a.name for a in CausalOptions.__attrs_attrs__}  # type: ignore[attr-defined]
    bad = sorted(set(raw) - known)
    if bad:
        raise DeployError(f"options.rollout_options.{bad[0]}: unknown key (known: {', '.join(sorted(known))})")
    try:
        return CausalOptions(**raw)
    except ValueError as exc:
        raise DeployError(f"options.{exc}") from None


@define(frozen=True)
class RolloutParams:
    """``node_params.rollout``: continue a session, or keep this request's stream as one."""

    session: str | None = field(default=None, metadata={
        "pattern": _SESSION_RE.pattern, "max_len": 29,
        "pattern_hint": "must be a session id as returned in output.metrics.session ('sess-' and 24 hex digits)"})
    keep_session: bool = False


class CausalDeployment:
    """The causal engines of one loaded model, one per video size (each with its slab pool and
    its sessions)."""

    def __init__(self, model: LoadedModel, options: CausalOptions) -> None:
        self.model = model
        self.options = options
        self._lock = threading.Lock()
        self._engines: dict[tuple[int, int], tuple[CausalWan, SessionStore]] = {}

    def engine(self, height: int, width: int) -> tuple[CausalWan, SessionStore]:
        with self._lock:
            got = self._engines.get((height, width))
            if got is None:
                comps = self.model.components
                eng = CausalWan(comps["transformer"], comps.get("vae"), options=self.options, height=height, width=width)
                got = self._engines[(height, width)] = (eng, SessionStore(eng))
            return got

    def pools(self) -> list[CacheManager]:
        with self._lock:
            return [e.manager for e, _ in self._engines.values()]


def deployment(model: LoadedModel, options: Mapping[str, Any] | None) -> CausalDeployment:
    opts = causal_options(options)
    dep = model.config.get("causal")
    if not isinstance(dep, CausalDeployment) or dep.options != opts:
        dep = model.config["causal"] = CausalDeployment(model, opts)
    return dep


def plan_chunks(frames: int, chunk_frames: int, t_scale: int = 4) -> int:
    """Chunks of a request of ``frames`` frames (``4k+1``); refused when they do not divide."""
    latent = (frames - 1) // t_scale + 1
    if latent % chunk_frames:
        lo = max(1, latent // chunk_frames) * chunk_frames
        ok = [(n - 1) * t_scale + 1 for n in (lo, lo + chunk_frames)]
        raise RequestError("diffusion.frames", f"causal rollout makes whole chunks of {chunk_frames} latent frames: "
                           f"{frames} frames are {latent} latent frames; use e.g. {ok[0]} or {ok[1]}")
    return latent // chunk_frames


def guidance_of(request: Any, options: CausalOptions) -> float:
    """The request's ``diffusion.guidance_scale``, else the deployment's ``rollout_options``'."""
    g = getattr(getattr(request, "diffusion", None), "guidance_scale", None)
    return float(options.guidance_scale if g is None else g)


def _node_params(state: RequestState, node: str) -> Mapping[str, Any]:
    raw = getattr(state.request, "node_params", None) or {}
    got = raw.get(node) if isinstance(raw, Mapping) else None
    return got if isinstance(got, Mapping) else {}


class RolloutCheck:
    """Cheap checks before the text encoder runs: the task, the chunk count, the video size and
    the session named in ``node_params.rollout`` (validated by the core as :class:`RolloutParams`)."""

    def __init__(self, dep: CausalDeployment) -> None:
        self.dep = dep

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p = state.read("params", Conditioning).values["params"]
        if p.task is not TaskType.T2V:
            raise RequestError("task", "causal rollout does text-to-video only")
        chunks = plan_chunks(p.frames, self.dep.options.chunk_frames)
        try:
            eng, store = self.dep.engine(p.height, p.width)
        except ValueError as exc:
            raise RequestError("diffusion.height", str(exc)) from None
        d = state.request.diffusion
        if d.shift is not None and not 0.01 <= d.shift <= 100.0:
            raise RequestError("diffusion.shift", f"causal rollout: must be in [0.01, 100], got {d.shift!r}")
        g = guidance_of(state.request, self.dep.options)
        if not 0.0 <= g <= 100.0:
            raise RequestError("diffusion.guidance_scale", f"causal rollout: must be in [0, 100], got {g!r}")
        cfg = g != 1.0
        if state.request.negative_prompt and not cfg:
            state.metrics.setdefault("warnings", []).append(
                "causal rollout runs without CFG at guidance_scale 1: negative_prompt ignored")
        rp = ctx.params if isinstance(ctx.params, RolloutParams) else RolloutParams()
        before = 0
        if rp.session is not None:
            try:
                sess = store.get(rp.session)
            except SessionError as exc:
                raise RequestError("node_params.rollout.session", str(exc)) from None
            before = sess.chunks
            if cfg and not sess.stream.cfg:
                raise RequestError("diffusion.guidance_scale", f"causal rollout: session {rp.session} was started "
                                   "without CFG (guidance_scale 1); continue it with guidance_scale 1 or start a new session")
            cfg = sess.stream.cfg  # a CFG session keeps both branches' slabs up to date
        need, have = eng.slabs_for(before + chunks, cfg), eng.manager.num_blocks
        if need > have:
            raise RequestError("diffusion.frames", f"causal rollout: {before + chunks} chunks need {need} slabs at once, "
                               f"this deployment's pool holds {have} (rollout_options.kv_slabs); set "
                               "rollout_options.window to stream longer videos")
        state.write("rollout_plan", Conditioning(values={"chunks": chunks, "rollout": rp, "guidance": g, "cfg": cfg}),
                    ctx.node.name)


class CausalRollout:
    """One chunk per ``step()``; each finished chunk's frames are emitted as ``video_chunk``."""

    def __init__(self, dep: CausalDeployment) -> None:
        self.dep = dep

    def kv_demand(self, state: RequestState) -> tuple[CacheManager, int] | None:
        """(pool, slabs) a new stream reserves at ``init``; a continued session reserves none
        (its blocks come from the free list as it grows). Read from the raw request only to size
        admission; ``init`` reads the validated ``ctx.params``."""
        p = state.resolved
        if p is None or _node_params(state, "rollout").get("session"):
            return None
        try:
            eng, _ = self.dep.engine(p.height, p.width)
            cfg = guidance_of(state.request, self.dep.options) != 1.0
            need = eng.slabs_for(plan_chunks(p.frames, self.dep.options.chunk_frames), cfg)
            # more than the whole pool: admit it, and let the rollout node refuse it (never wait forever)
            return (eng.manager, need) if need <= eng.manager.num_blocks else None
        except (ValueError, RequestError):
            return None

    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        p = state.read("params", Conditioning).values["params"]
        plan = state.read("rollout_plan", Conditioning).values
        rp: RolloutParams = plan["rollout"]
        chunks = int(plan["chunks"])
        text = state.read("prompt_embeds", Embeddings).tensor
        cfg, guidance = bool(plan.get("cfg", False)), float(plan.get("guidance", 1.0))
        uncond = state.read("negative_embeds", Embeddings).tensor if cfg else None
        steps = state.request.diffusion.steps or self.dep.options.steps
        shift = state.request.diffusion.shift
        eng, store = self.dep.engine(p.height, p.width)
        seed = int(state.metrics.get("seed", 0))
        x: dict[str, Any] = {"frames": [], "fps": p.fps, "steps": steps}
        if rp.session is not None or rp.keep_session:
            sid = rp.session
            if sid is None:
                sid = store.create(seed, reserve_chunks=chunks, cfg=cfg).id
            x["session"] = sid
            try:
                it: Iterator[ChunkOut] = store.generate(sid, text, chunks, steps=steps, shift=shift,
                                                        uncond=uncond, guidance=guidance)
            except SessionError as exc:
                raise RequestError("node_params.rollout.session", str(exc)) from None
            state.metrics["session"] = sid
        else:
            stream = eng.open_stream(seed, reserve_chunks=chunks, cfg=cfg)
            x["stream"] = stream
            it = eng.run(stream, text, chunks, steps=steps, shift=shift, uncond=uncond, guidance=guidance)
        x["it"] = it
        return LoopState(step=0, total=chunks, extra=x)

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        x = loop.extra
        out: ChunkOut = next(x["it"])
        assert out.video is not None
        frames = to_uint8_frames(out.video)
        x["frames"].append(frames)
        done = loop.step + 1 >= loop.total
        state.metrics.setdefault("chunks", []).append({"index": out.index, "frames": int(frames.shape[0])})
        return StepResult(done=done, emit={"video_chunk": VideoFrames(frames=frames, fps=x["fps"])})

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        x = loop.extra
        it = x.pop("it", None)
        if it is not None:
            for _ in it:  # runs the iterator's epilogue (the session's last_used / busy flag)
                raise RuntimeError("causal rollout: the chunk iterator yielded past the request's chunks")
        if "stream" in x:
            x.pop("stream").free()
        state.write("video", VideoFrames(frames=torch.cat(x["frames"], dim=0), fps=x["fps"]), ctx.node.name)

    def release(self, state: RequestState, node: str) -> None:
        """Cancel / failure: stop the chunk iterator and free the slabs (a session is closed)."""
        loop = state.loops.get(node)
        if loop is None:
            return
        it = loop.extra.pop("it", None)
        if it is not None:
            it.close()
        stream = loop.extra.pop("stream", None)
        if stream is not None:
            stream.free()


def refuse_interceptors(options: Mapping[str, Any]) -> None:
    """Block and step interceptors (caches, skippers) act on the bidirectional denoise loop's
    forwards; the chunk forwards never call them, so a deploy enabling one is refused, not ignored."""
    deploy, registry = options.get("deploy"), options.get("registry")
    if deploy is None or registry is None:
        return
    for name in getattr(deploy, "plugins", {}) or {}:
        spec = registry.interceptors.get(name)
        if spec is not None:
            raise DeployError(f"plugins.{name}: a {spec.kind} does not run in rollout: causal (the chunk forwards "
                              "do not go through interceptors); remove it or use rollout: bidirectional")


def build_causal_pipeline(model: LoadedModel, task: TaskType, options: Mapping[str, Any], menu: Any) -> PipelineSpec:
    """validate → rollout (checks, session) → text_encode → chunks (streams ``video_chunk``) → ``video``."""
    if task is not TaskType.T2V:
        raise RequestError("task", f"rollout: causal does text-to-video only, not {task.value!r}")
    if model.config.get("boundary_ratio") is not None:
        raise DeployError("options.rollout: causal needs a one-transformer Wan checkpoint (not Wan2.2 A14B's two experts)")
    if model.config.get("expand_timesteps"):
        raise DeployError("options.rollout: causal does not support Wan2.2 TI2V (per-token timesteps)")
    refuse_interceptors(options)
    dep = deployment(model, options)
    nodes = [
        Node("validate", Validate(model, menu), writes={"params": Conditioning}),
        Node("rollout", RolloutCheck(dep), reads={"params": Conditioning}, writes={"rollout_plan": Conditioning},
             params_schema=RolloutParams),
        Node("text_encode", TextEncode(model.config.get("text_cache")), reads={"params": Conditioning},
             writes={"prompt_embeds": Embeddings, "negative_embeds": Embeddings}, uses=("text_encoder",)),
        Node("chunks", CausalRollout(dep), reads={"params": Conditioning, "prompt_embeds": Embeddings,
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
