"""What a causal (chunk-by-chunk, KV-cached) rollout of a video denoiser shares: the chunk engine,
a stream's chunk-KV slabs, the sessions that keep a stream between requests and the pipeline's
nodes. Wan's ``rollout: causal`` (:mod:`omniloop_wan.causal`) runs on it: the family gives its
model's chunk forward (and masked reference), its KV layout and its streaming VAE decoder. The
engine builds its slab pool with omniloop-kvcache (a family using it depends on that package).

**Chunk-KV slabs** (:class:`ChunkKV`): one sequence of an :class:`omniloop_kvcache.CacheManager`
per stream. The manager's ``block_size`` is one chunk's tokens, so one block is one *slab* (a
chunk's clean K/V for every layer). A finished chunk's K/V is written once (:meth:`ChunkKV.commit`);
the next chunks read every held slab (:meth:`ChunkKV.context`). With a rolling ``window`` the
oldest slabs past the window are released with ``drop_front(keep=sink)``: the first ``sink``
chunks stay (attention sinks), positions keep counting (RoPE uses absolute frame indices).

**Sessions** (:class:`SessionStore`): a stream kept after its request, so a follow-up request (a
new prompt) continues the same video. A store belongs to one engine (``open_stream``, ``run``,
``check_guidance``, ``options.max_sessions`` / ``session_ttl_s``, ``manager``): at most
``max_sessions`` live at once, each expiring ``ttl_s`` seconds after its last use. A session keeps
its slabs and its VAE feature cache; closing, expiring or cancelling it frees both. Session ids
are made here (``secrets``), never taken from a client, and never become file names. One session
runs one request at a time. ``cancel`` during a request stops it at the next chunk boundary (the
chunk being denoised finishes, then the slabs are freed); closing the iterator returned by
:meth:`SessionStore.generate` (a client that went away) frees them at once.

**The chunk engine** (:class:`CausalEngine`; the family gives its chunk forward) — causal chunk rollout: denoise a video chunk by chunk, each chunk attending to the clean K/V
of the earlier ones, and hand each finished chunk (latents, and frames when a VAE is given) out
as soon as it is done.

Per chunk ``i`` (``chunk_frames`` latent frames, RoPE frames ``i*chunk_frames ..``):

1. noise from a generator seeded by ``(seed, i)`` — a chunk's noise does not depend on how the
   video was split into requests, so a session continued twice equals one long request;
2. ``steps`` steps (sigmas ``linspace(1, 0, steps + 1)`` with the flow ``shift``, timestep
   ``1000 * sigma``), each one :meth:`CausalEngine.chunk_forward` over the chunk with the cached
   slabs as context, then a move from ``s`` to ``s'`` by ``options.sampler``
   (:func:`causal_step`): ``"euler"`` (default) the flow-Euler step ``x + (s' - s) v``;
   ``"fresh"`` (DMD2 / Self-Forcing's few-step sampler) the x0 prediction ``x0 = x - s v``
   re-noised with fresh noise, ``(1 - s') x0 + s' n``, ``n`` from a CPU generator seeded by
   ``(seed, i, step)`` (:func:`step_noise`, float32: the same on every device, and a session
   continued equals one long request as for the chunk noise). The chunk's last step lands on x0
   (``s' = 0``) with the Euler formula either way;
3. one more forward of the clean chunk at ``context_timestep`` (0: clean) that records its K/V,
   written once as the chunk's slab (:class:`ChunkKV`); the window slides;

With classifier-free guidance (a stream opened with ``cfg=True``; guidance-distilled causal
checkpoints run without, the default ``guidance_scale`` 1) every chunk runs a conditional and an
unconditional branch, each with **its own slabs**: the unconditional branch's context is the
clean chunks' K/V computed with the negative prompt's text states. Both branches go through one
batch-2 forward when the two text states have the same shape (else two forwards); the step uses
``v = v_uncond + g * (v_cond - v_uncond)`` (diffusers' ``WanPipeline`` combination) and the
clean chunk both branches record is the guided one.

Image conditioning of the first chunk (engine level, :meth:`CausalEngine.open_stream`'s
``first_latents``): the first ``p`` latent frames of chunk 0 are given clean latents (an image
encoded by a causal VAE is one latent frame, Wan's ``encode_first_frame``); they stay fixed
through the chunk's steps with their tokens at ``context_timestep`` (Wan2.2 TI2V's
``expand_timesteps`` scheme: ``x = mask * x + (1 - mask) * condition``, per-token timesteps). When
``p == chunk_frames`` chunk 0 *is* the image: no sampler step runs, its context forward writes its
slab and the decoder reconstructs the image as frame 0. The runtime's ``rollout: causal`` pipeline
does not expose it (text-to-video only).

4. the chunk's latents are VAE-decoded incrementally (the engine's ``decoder``).

:meth:`CausalEngine.reference` runs the same schedule without a cache: every step one
:meth:`CausalEngine.masked_forward` over all clean chunks so far plus the noisy one, with the
block-causal (windowed) mask — the test oracle.

**The pipeline's nodes** (:class:`RolloutCheck`, :class:`CausalRollout`; ``options.rollout: causal``,
``options.rollout_options`` as :class:`CausalOptions`) — see ``omniloop_wan.causal.pipeline``.
"""

from __future__ import annotations

import itertools
import math
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from attrs import define, field

from omniloop.artifacts import Conditioning, Embeddings, VideoFrames
from omniloop.context import StageContext
from omniloop.errors import DeployError, OmniloopError, RequestError
from omniloop.family import LoadedModel
from omniloop.loop import LoopState, RequestState, StepResult
from omniloop.request import TaskType

if TYPE_CHECKING:
    from omniloop_kvcache import CacheManager, KVHandle


def slabs_needed(chunks: int, window: int | None, sink: int) -> int:
    """Slabs one stream of ``chunks`` chunks holds at most (window + sink when windowed)."""
    return chunks if window is None else min(chunks, window + sink)


class ChunkKV:
    """One stream's slabs; ``context`` / ``record`` plug into the family's chunk forward (Wan's
    :func:`omniloop_wan.causal.model.chunk_forward`)."""

    def __init__(self, manager: CacheManager, *, window: int | None = None, sink: int = 0,
                 reserve_chunks: int = 0) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window: must be >= 1 chunk (the chunk itself counts), got {window}")
        if sink < 0:
            raise ValueError(f"sink: must be >= 0, got {sink}")
        self.manager = manager
        self.window = window
        self.sink = sink
        self.handle: KVHandle | None = manager.allocate(
            reserve_tokens=slabs_needed(reserve_chunks, window, sink) * manager.block_size, tag="chunk-kv"
        )
        self.committed = 0  # chunks written
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def live(self) -> bool:
        return self.handle is not None and self.manager.is_live(self.handle)

    def _h(self) -> KVHandle:
        if self.handle is None:
            raise ValueError("chunk KV: this stream's slabs were freed")
        return self.handle

    def held_chunks(self) -> int:
        return len(self.manager.block_table(self._h()))

    def context(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every held slab's K/V of ``layer`` as ``[1, L, heads, head_dim]`` (sinks first)."""
        h = self._h()
        if self.committed == 0:
            return None
        k, v = self.manager.gather(layer, self.manager.slots(h))
        return k.unsqueeze(0), v.unsqueeze(0)

    def record(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep one layer's K/V of the chunk being finalised (``[1, S, H, D]``) for :meth:`commit`."""
        if k.shape[0] != 1:
            raise ValueError(f"chunk KV: one stream per sequence (batch 1), got batch {k.shape[0]}")
        self._pending[layer] = (k[0], v[0])

    def commit(self) -> None:
        """Write the recorded chunk as one new slab, then slide the window."""
        h = self._h()
        layers = len(self.manager.k)
        if sorted(self._pending) != list(range(layers)):
            raise RuntimeError(f"chunk KV: commit needs all {layers} layers recorded, got {sorted(self._pending)}")
        tokens = self._pending[0][0].shape[0]
        if tokens != self.manager.block_size:
            raise ValueError(f"chunk KV: a chunk has {tokens} tokens, the slabs hold {self.manager.block_size}")
        slots = self.manager.append(h, tokens).to(self.manager.k[0].device)
        for layer, (k, v) in self._pending.items():
            self.manager.write(layer, slots, k, v)
        self._pending.clear()
        self.committed += 1
        if self.window is not None:
            non_sink = self.held_chunks() - min(self.sink, self.committed)
            excess = non_sink - (self.window - 1)
            if excess > 0 and self.committed > self.sink:
                self.manager.drop_front(h, excess, keep=self.sink)

    def free(self) -> None:
        """Release every slab (idempotent)."""
        if self.handle is not None:
            self.manager.free(self.handle)
            self.handle = None
        self._pending.clear()


class SessionError(OmniloopError):
    """An unknown, expired, closed or busy session."""


class SessionLimit(OmniloopError):
    """The deployment already holds its maximum number of sessions."""


class Cancelled(OmniloopError):
    """The session was cancelled during a request; its slabs are freed."""


@define
class Session:
    id: str
    stream: Any
    created: float
    last_used: float
    busy: bool = False
    cancelled: bool = False
    requests: int = 0
    meta: dict[str, Any] = field(factory=dict)

    @property
    def chunks(self) -> int:
        return self.stream.next_chunk


class SessionStore:
    """The sessions of one deployment; thread-safe accounting (one lock)."""

    def __init__(self, engine: Any, *, max_sessions: int | None = None, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.max_sessions = engine.options.max_sessions if max_sessions is None else max_sessions
        self.ttl_s = engine.options.session_ttl_s if ttl_s is None else ttl_s
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions: must be >= 1, got {self.max_sessions}")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s: must be > 0, got {self.ttl_s}")
        self.clock = clock
        self._lock = threading.RLock()
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def create(self, seed: int, *, reserve_chunks: int = 0, cfg: bool = False,
               first_latents: torch.Tensor | None = None) -> Session:
        """A new session (expired ones are freed first); ``cfg``: it keeps the unconditional
        branch's slabs too (classifier-free guidance); ``first_latents`` conditions its first chunk
        (the engine's ``open_stream``). Raises :class:`SessionLimit` or ``CacheFull``."""
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed: must be an integer in [0, 2**63), got {seed!r}")
        with self._lock:
            self.expire()
            if len(self._sessions) >= self.max_sessions:
                raise SessionLimit(f"this deployment holds its maximum of {self.max_sessions} sessions; close one or wait "
                                   f"for one to expire ({self.ttl_s:g} s after its last use)")
            stream = self.engine.open_stream(seed, reserve_chunks=reserve_chunks, cfg=cfg, first_latents=first_latents)
            now = self.clock()
            sid = "sess-" + secrets.token_hex(12)
            s = Session(sid, stream, now, now)
            self._sessions[sid] = s
            return s

    def get(self, session_id: str) -> Session:
        with self._lock:
            self.expire()
            s = self._sessions.get(session_id) if isinstance(session_id, str) else None
            if s is None:
                raise SessionError("session: unknown or expired session id")
            return s

    def close(self, session_id: str) -> bool:
        """Free the session's slabs and VAE cache; False when it was not there."""
        with self._lock:
            s = self._sessions.pop(session_id, None)
        if s is None:
            return False
        if not s.busy:
            s.stream.free()
        else:  # freed by the running request when it reaches a chunk boundary / ends
            s.cancelled = True
        return True

    def cancel(self, session_id: str) -> bool:
        """Stop the session's running request (at the next chunk boundary) and free it."""
        return self.close(session_id)

    def expire(self, now: float | None = None) -> list[str]:
        """Free every idle session unused for ``ttl_s``; return their ids."""
        t = self.clock() if now is None else now
        with self._lock:
            old = [sid for sid, s in self._sessions.items() if not s.busy and t - s.last_used >= self.ttl_s]
        for sid in old:
            self.close(sid)
        return old

    def generate(self, session_id: str, text: torch.Tensor, chunks: int, *, decode: bool = True,
                 steps: int | None = None, shift: float | None = None, uncond: torch.Tensor | None = None,
                 guidance: float | None = None) -> Iterator[Any]:
        """Continue the session's video with ``chunks`` chunks conditioned on ``text`` (a CFG
        session also takes the negative prompt's ``uncond`` states and ``guidance``).

        Validates before any compute; the returned iterator yields each chunk when final."""
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks: must be a positive integer, got {chunks!r}")
        s = self.get(session_id)
        try:
            self.engine.check_guidance(s.stream, uncond, guidance)
        except ValueError as exc:
            raise SessionError(f"session: {exc}") from None
        return self._run(s, text, chunks, decode, steps, shift, uncond, guidance)

    def _run(self, s: Session, text: torch.Tensor, chunks: int, decode: bool, steps: int | None,
             shift: float | None, uncond: torch.Tensor | None = None,
             guidance: float | None = None) -> Iterator[Any]:
        with self._lock:  # claimed on the first next(): an iterator never started holds nothing
            if s.busy:
                raise SessionError("session: a request is already running on this session")
            if self._sessions.get(s.id) is not s:
                raise SessionError("session: unknown or expired session id")
            s.busy = True
            s.requests += 1
        done = False
        try:
            for _ in range(chunks):
                if s.cancelled:
                    raise Cancelled("session: cancelled; its slabs are freed")
                yield from self.engine.run(s.stream, text, 1, decode=decode, steps=steps, shift=shift,
                                           uncond=uncond, guidance=guidance)
            done = True
        finally:
            with self._lock:
                s.busy = False
                s.last_used = self.clock()
                if not done or s.cancelled:  # cancelled, failed or abandoned mid-stream: free it
                    self._sessions.pop(s.id, None)
                    s.stream.free()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"sessions": len(self._sessions), "max_sessions": self.max_sessions, "ttl_s": self.ttl_s,
                    "kv": self.engine.manager.stats()}



# -- the chunk engine -----------------------------------------------------------------------------
def _pos_int(name: str) -> Any:
    def check(_i: Any, _a: Any, v: Any) -> None:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"rollout_options.{name}: must be a positive integer, got {v!r}")
    return check


def _finite(name: str, lo: float, hi: float) -> Any:
    def check(_i: Any, _a: Any, v: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            raise ValueError(f"rollout_options.{name}: must be a finite number in [{lo}, {hi}], got {v!r}")
    return check


def _window(_i: Any, _a: Any, v: Any) -> None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        raise ValueError(f"rollout_options.window: must be null or a positive integer (chunks, itself included), got {v!r}")


#: how a chunk's step moves from ``s`` to ``s'`` (``rollout_options.sampler``, :func:`causal_step`)
SAMPLERS = ("euler", "fresh")


def _sampler(_i: Any, _a: Any, v: Any) -> None:
    if v not in SAMPLERS:
        raise ValueError(f"rollout_options.sampler: must be one of {', '.join(SAMPLERS)}, got {v!r}")


def _sink(_i: Any, _a: Any, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"rollout_options.sink: must be a non-negative integer (chunks), got {v!r}")


@define(frozen=True)
class CausalOptions:
    """The deploy's ``rollout: causal`` settings (``options.rollout_options`` / ``omniloop.json``)."""

    chunk_frames: int = field(default=3, validator=_pos_int("chunk_frames"))
    steps: int = field(default=4, validator=_pos_int("steps"))
    shift: float = field(default=5.0, validator=_finite("shift", 0.01, 100.0))
    window: int | None = field(default=None, validator=_window)  # chunks attended, itself included
    sink: int = field(default=0, validator=_sink)  # first chunks always kept when windowed
    context_timestep: float = field(default=0.0, validator=_finite("context_timestep", 0.0, 1000.0))
    #: the CFG scale when a request gives none (1: no CFG, what guidance-distilled checkpoints want)
    guidance_scale: float = field(default=1.0, validator=_finite("guidance_scale", 0.0, 100.0))
    max_sessions: int = field(default=4, validator=_pos_int("max_sessions"))
    session_ttl_s: float = field(default=600.0, validator=_finite("session_ttl_s", 0.001, 86400.0 * 7))
    kv_slabs: int = field(default=64, validator=_pos_int("kv_slabs"))  # the slab pool's size
    #: ``"euler"``: flow-Euler steps; ``"fresh"``: x0 re-noised with fresh noise (:func:`causal_step`)
    sampler: str = field(default="euler", validator=_sampler)

    def sigmas(self) -> list[float]:
        base = torch.linspace(1.0, 0.0, self.steps + 1, dtype=torch.float64)
        s = self.shift * base / (1 + (self.shift - 1) * base)
        return [float(x) for x in s]


@define
class ChunkOut:
    """One finished chunk: its index, latents ``[1, z, f, h, w]`` and, with a VAE, its frames
    ``[1, 3, T, H, W]`` in [-1, 1] (``None`` without a decoder)."""

    index: int
    latents: torch.Tensor
    video: torch.Tensor | None = None


class Stream:
    """One video in progress: its slabs (and, with CFG, the unconditional branch's slabs), its
    VAE feature cache and where it has got to."""

    def __init__(self, kv: ChunkKV, decoder: Any, seed: int,
                 kv_uncond: ChunkKV | None = None, first_latents: torch.Tensor | None = None) -> None:
        self.kv = kv
        self.kv_uncond = kv_uncond
        self.first_latents = first_latents  # clean latents fixed at the start of chunk 0 (image conditioning)
        self.decoder = decoder
        self.seed = seed
        self.next_chunk = 0

    @property
    def cfg(self) -> bool:
        """Was the stream opened with classifier-free guidance (two sets of slabs)?"""
        return self.kv_uncond is not None

    def free(self) -> None:
        self.kv.free()
        if self.kv_uncond is not None:
            self.kv_uncond.free()
        self.decoder = None


def _pair_context(a: ChunkKV, b: ChunkKV) -> Any:
    """A context for a batch-2 forward: row 0 reads ``a``'s slabs, row 1 ``b``'s."""
    def context(layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        ca, cb = a.context(layer), b.context(layer)
        if ca is None or cb is None:
            return None
        return torch.cat([ca[0], cb[0]], dim=0), torch.cat([ca[1], cb[1]], dim=0)
    return context


def _pair_record(a: ChunkKV, b: ChunkKV) -> Any:
    def record(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        a.record(layer, k[:1], v[:1])
        b.record(layer, k[1:], v[1:])
    return record


def chunk_noise(seed: int, index: int, shape: Sequence[int]) -> torch.Tensor:
    """The noise of chunk ``index`` (float32, CPU generator: the same on every device)."""
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + index) % (2**63))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32)


def step_noise(seed: int, index: int, step: int, shape: Sequence[int]) -> torch.Tensor:
    """The fresh noise of chunk ``index``'s step ``step`` (``sampler: fresh``; float32, CPU
    generator: the same on every device; its seed never depends on how the video was split into
    requests)."""
    g = torch.Generator().manual_seed(((int(seed) * 1_000_003 + index) * 8_191 + 4_099 + step) % (2**63))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32)


def causal_step(x: torch.Tensor, v: torch.Tensor, s: float, s_next: float,
                fresh: torch.Tensor | None = None) -> torch.Tensor:
    """One step of a chunk from sigma ``s`` to ``s_next`` with the flow prediction ``v``, in float32:
    the flow-Euler step ``x + (s' - s) v`` without ``fresh``; with it, the x0 prediction ``x - s v``
    re-noised to ``s'`` with that noise, ``(1 - s') x0 + s' fresh``."""
    if fresh is None:
        return x.float() + (s_next - s) * v.float()
    return (1.0 - s_next) * (x.float() - s * v.float()) + s_next * fresh.to(x.device)


class CausalEngine:
    """Chunk rollout of one video transformer (+ optional VAE) at one latent size; the family
    subclasses it with its model's :meth:`chunk_forward`, :meth:`masked_forward`,
    :meth:`check_model`, :meth:`kv_layout` and streaming ``decoder`` class (Wan's ``CausalWan``).

    ``height`` / ``width`` are the *video* size; the slab pool (one :class:`CacheManager`,
    ``options.kv_slabs`` chunks of ``tokens_per_chunk`` tokens) is sized for it.
    """

    #: ``decoder(vae)``: decodes a stream's latent chunks in order (``decode(latents)``)
    decoder: Any = None

    @staticmethod
    def chunk_forward(model: Any, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, frame0: int, *,
                      context: Any = None, record: Any = None) -> torch.Tensor:
        """The flow prediction of one chunk whose first latent frame is ``frame0``, its self-attention
        keys extended with ``context(layer)``; ``record(layer, k, v)`` receives its own K/V."""
        raise NotImplementedError

    @staticmethod
    def masked_forward(model: Any, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """The whole sequence at once with per-token timesteps and a ``[S, S]`` self-attention mask."""
        raise NotImplementedError

    @staticmethod
    def check_model(model: Any) -> None:
        """Refuse a transformer the chunk forward cannot run (one clear error, before compute)."""

    @staticmethod
    def kv_layout(model: Any) -> Any:
        """What one token stores (an ``omniloop_kvcache.KVLayout``)."""
        raise NotImplementedError

    def __init__(self, transformer: Any, vae: Any = None, *, options: CausalOptions | None = None,
                 height: int, width: int, manager: CacheManager | None = None) -> None:
        self.check_model(transformer)
        self.model = transformer
        self.vae = vae
        self.options = options or CausalOptions()
        sf = 8 if vae is None else int(getattr(vae.config, "scale_factor_spatial", 8))
        _, ph, pw = transformer.config.patch_size
        if height % (sf * ph) or width % (sf * pw) or height < 1 or width < 1:
            raise ValueError(f"causal rollout: height and width must be positive multiples of {sf * ph}, got {height}x{width}")
        self.height, self.width = height, width
        self.latent_hw = (height // sf, width // sf)
        self.channels = int(transformer.config.out_channels)
        self.tokens_per_chunk = self.options.chunk_frames * (self.latent_hw[0] // ph) * (self.latent_hw[1] // pw)
        from omniloop_kvcache import CacheManager

        self.manager = manager or CacheManager(
            self.kv_layout(transformer), block_size=self.tokens_per_chunk, num_blocks=self.options.kv_slabs, name="chunk-kv"
        )
        if self.manager.block_size != self.tokens_per_chunk:
            raise ValueError(f"causal rollout: the slab pool holds {self.manager.block_size} tokens per block, "
                             f"a chunk has {self.tokens_per_chunk}")

    # -- streams ----------------------------------------------------------------------------------
    def open_stream(self, seed: int, reserve_chunks: int = 0, *, cfg: bool = False,
                    first_latents: torch.Tensor | None = None) -> Stream:
        """A new stream; ``cfg`` gives it a second set of slabs for the unconditional branch;
        ``first_latents`` ``[1, z, p, h, w]`` (``1 <= p <= chunk_frames``, normalised, e.g.
        :func:`encode_first_frame`) conditions the first chunk on them (raises ``CacheFull`` when
        the pool cannot reserve its slabs)."""
        o = self.options
        if first_latents is not None:
            want = (1, self.channels, *self.latent_hw)
            got = tuple(first_latents.shape)
            if first_latents.ndim != 5 or (got[0], got[1], got[3], got[4]) != want or not 1 <= got[2] <= o.chunk_frames:
                raise ValueError(f"first_latents: expected [1, {self.channels}, 1..{o.chunk_frames}, "
                                 f"{self.latent_hw[0]}, {self.latent_hw[1]}], got {list(got)}")
            if not torch.isfinite(first_latents).all():
                raise ValueError("first_latents: has non-finite values")
        kv = ChunkKV(self.manager, window=o.window, sink=o.sink, reserve_chunks=reserve_chunks)
        kv_u = None
        if cfg:
            try:
                kv_u = ChunkKV(self.manager, window=o.window, sink=o.sink, reserve_chunks=reserve_chunks)
            except BaseException:
                kv.free()
                raise
        return Stream(kv, self.decoder(self.vae) if self.vae is not None and self.decoder is not None else None, seed, kv_u,
                      None if first_latents is None else first_latents.detach().clone())

    def slabs_for(self, chunks: int, cfg: bool = False) -> int:
        return slabs_needed(chunks, self.options.window, self.options.sink) * (2 if cfg else 1)

    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        return (1, self.channels, self.options.chunk_frames, *self.latent_hw)

    def _dev(self) -> tuple[torch.device, torch.dtype]:
        p = next(self.model.parameters())
        return p.device, p.dtype

    def check_guidance(self, stream: Stream, uncond: torch.Tensor | None, guidance: float | None) -> float:
        """The guidance scale this chunk runs with; refuses what the stream cannot do (before compute)."""
        g = self.options.guidance_scale if guidance is None else guidance
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or not 0.0 <= g <= 100.0:
            raise ValueError(f"guidance_scale: must be a finite number in [0, 100], got {g!r}")
        if stream.cfg and uncond is None:
            raise ValueError("causal rollout: this stream runs classifier-free guidance; give the unconditional text states (uncond)")
        if not stream.cfg and g != 1.0:
            raise ValueError(f"causal rollout: guidance_scale {g:g} needs a stream opened with cfg=True "
                             "(its unconditional branch has its own slabs from the first chunk on)")
        return float(g)

    @torch.no_grad()
    def denoise_chunk(self, stream: Stream, text: torch.Tensor, steps: int | None = None,
                      shift: float | None = None, *, uncond: torch.Tensor | None = None,
                      guidance: float | None = None) -> torch.Tensor:
        """Denoise the stream's next chunk with ``text`` states ``[1, L, D]`` (``steps``, ``shift``,
        ``guidance``: the options' unless given; ``uncond``: the negative prompt's states, needed
        by a CFG stream); commit its slab(s)."""
        o = self.options
        if steps is not None or shift is not None:
            o = attrs.evolve(o, steps=o.steps if steps is None else steps, shift=o.shift if shift is None else shift)
        g = self.check_guidance(stream, uncond, guidance)
        dev, dt = self._dev()
        i = stream.next_chunk
        frame0 = i * o.chunk_frames
        x = chunk_noise(stream.seed, i, self.chunk_shape()).to(dev, dt)
        text = text.to(dev, dt)
        sig = o.sigmas()
        t_ctx = torch.full((1,), o.context_timestep, device=dev, dtype=dt)
        fixed = stream.first_latents.to(dev, dt) if i == 0 and stream.first_latents is not None else None
        p = 0 if fixed is None else fixed.shape[2]
        if fixed is not None:
            x[:, :, :p] = fixed
            if p == o.chunk_frames:
                sig = []  # the whole chunk is given: nothing to denoise

        def step_t(s: float, batch: int) -> torch.Tensor:
            if fixed is None:
                return torch.full((batch,), s * 1000.0, device=dev, dtype=dt)
            per = self.tokens_per_chunk // o.chunk_frames
            t = torch.full((batch, self.tokens_per_chunk), s * 1000.0, device=dev, dtype=dt)
            t[:, : p * per] = o.context_timestep
            return t

        def refix(x: torch.Tensor) -> torch.Tensor:
            if fixed is not None:
                x[:, :, :p] = fixed
            return x

        def move(k: int, x: torch.Tensor, v: torch.Tensor, s: float, s_next: float) -> torch.Tensor:
            return refix(self._step(o, stream.seed, i, k, len(sig) - 1, x, v, s, s_next).to(dt))

        if not stream.cfg:
            for k, (s, s_next) in enumerate(itertools.pairwise(sig)):
                v = self.chunk_forward(self.model, x, step_t(s, 1), text, frame0, context=stream.kv.context)
                x = move(k, x, v, s, s_next)
            self.chunk_forward(self.model, x, t_ctx, text, frame0, context=stream.kv.context, record=stream.kv.record)
            stream.kv.commit()
        else:
            assert uncond is not None and stream.kv_uncond is not None
            kc, ku = stream.kv, stream.kv_uncond
            uncond = uncond.to(dev, dt)
            batched = uncond.shape == text.shape
            both = torch.cat([text, uncond], dim=0) if batched else None
            for k, (s, s_next) in enumerate(itertools.pairwise(sig)):
                if batched:
                    v_c, v_u = self.chunk_forward(self.model, torch.cat([x, x], dim=0), step_t(s, 2), both, frame0,
                                             context=_pair_context(kc, ku)).float().chunk(2, dim=0)
                else:
                    t = step_t(s, 1)
                    v_c = self.chunk_forward(self.model, x, t, text, frame0, context=kc.context).float()
                    v_u = self.chunk_forward(self.model, x, t, uncond, frame0, context=ku.context).float()
                v = v_u + g * (v_c - v_u)
                x = move(k, x, v, s, s_next)
            if batched:
                self.chunk_forward(self.model, torch.cat([x, x], dim=0), t_ctx.expand(2), both, frame0,
                              context=_pair_context(kc, ku), record=_pair_record(kc, ku))
            else:
                self.chunk_forward(self.model, x, t_ctx, text, frame0, context=kc.context, record=kc.record)
                self.chunk_forward(self.model, x, t_ctx, uncond, frame0, context=ku.context, record=ku.record)
            kc.commit()
            ku.commit()
        stream.next_chunk += 1
        return x

    def _step(self, o: CausalOptions, seed: int, index: int, k: int, steps: int, x: torch.Tensor,
              v: torch.Tensor, s: float, s_next: float) -> torch.Tensor:
        """Step ``k`` of ``steps`` of chunk ``index`` by ``o.sampler`` (the last one is Euler's to x0)."""
        fresh = step_noise(seed, index, k, x.shape) if o.sampler == "fresh" and k < steps - 1 else None
        return causal_step(x, v, s, s_next, fresh)

    def run(self, stream: Stream, text: torch.Tensor, chunks: int, *, decode: bool = True,
            steps: int | None = None, shift: float | None = None, uncond: torch.Tensor | None = None,
            guidance: float | None = None) -> Iterator[ChunkOut]:
        """Generate ``chunks`` more chunks of ``stream``, yielding each as soon as it is final."""
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks: must be a positive integer, got {chunks!r}")
        self.check_guidance(stream, uncond, guidance)
        return self._run(stream, text, chunks, decode, steps, shift, uncond, guidance)

    def _run(self, stream: Stream, text: torch.Tensor, chunks: int, decode: bool, steps: int | None,
             shift: float | None, uncond: torch.Tensor | None, guidance: float | None) -> Iterator[ChunkOut]:
        for _ in range(chunks):
            lat = self.denoise_chunk(stream, text, steps, shift, uncond=uncond, guidance=guidance)
            video = stream.decoder.decode(lat) if decode and stream.decoder is not None else None
            yield ChunkOut(stream.next_chunk - 1, lat, video)

    def run_schedule(self, stream: Stream, schedule: Sequence[tuple[torch.Tensor, int]], *,
                     decode: bool = True, uncond: torch.Tensor | None = None,
                     guidance: float | None = None) -> Iterator[ChunkOut]:
        """One request over several prompts: ``schedule`` is ``[(text, chunks), ...]`` in order."""
        for text, chunks in schedule:
            yield from self.run(stream, text, chunks, decode=decode, uncond=uncond, guidance=guidance)

    # -- the uncached oracle ----------------------------------------------------------------------
    @torch.no_grad()
    def reference(self, text: torch.Tensor, chunks: int, seed: int, *, uncond: torch.Tensor | None = None,
                  guidance: float | None = None, first_latents: torch.Tensor | None = None) -> torch.Tensor:
        """The same rollout of ``chunks`` chunks with ``text`` and no cache: every step is one
        :meth:`masked_forward` over the clean chunks so far (at ``context_timestep``) plus
        the noisy one (at the step's timestep), with the block-causal (windowed) mask. With
        ``uncond`` (CFG) a second masked forward over the same sequence with the unconditional
        text gives ``v_uncond`` (its clean chunks' keys are the unconditional branch's), combined
        as ``v_uncond + g (v_cond - v_uncond)``. Returns the latents ``[1, z, chunks*f, h, w]``."""
        g = self.options.guidance_scale if guidance is None else float(guidance)
        o = self.options
        dev, dt = self._dev()
        f = o.chunk_frames
        n = self.tokens_per_chunk
        text = text.to(dev, dt)
        clean: list[torch.Tensor] = []
        sig = o.sigmas()
        for i in range(chunks):
            x = chunk_noise(seed, i, self.chunk_shape()).to(dev, dt)
            p = first_latents.shape[2] if i == 0 and first_latents is not None else 0
            if p:
                x[:, :, :p] = first_latents.to(dev, dt)
            mask = block_causal_mask([n] * (i + 1), o.window, o.sink).to(dev)
            for k, (s, s_next) in enumerate(itertools.pairwise(sig) if p < f else ()):
                seq = torch.cat([*clean, x], dim=2)
                ts = torch.cat([torch.full((n * i,), o.context_timestep), torch.full((n,), s * 1000.0)])
                ts[: p * (n // f)] = o.context_timestep  # the given frames' tokens are clean
                v = self.masked_forward(self.model, seq, ts.to(dev, dt)[None], text, mask)[:, :, i * f :].float()
                if uncond is not None:
                    v_u = self.masked_forward(self.model, seq, ts.to(dev, dt)[None], uncond.to(dev, dt), mask)[:, :, i * f :].float()
                    v = v_u + g * (v - v_u)
                x = self._step(o, seed, i, k, len(sig) - 1, x, v, s, s_next).to(dt)
                if p:
                    x[:, :, :p] = first_latents.to(dev, dt)
            clean.append(x)
        return torch.cat(clean, dim=2)


def chunk_visibility(n_chunks: int, window: int | None = None, sink: int = 0) -> torch.Tensor:
    """``[n, n]`` bool: may chunk ``i`` see chunk ``j``? Itself and earlier chunks, of which only
    the last ``window - 1`` earlier ones (``window`` counts the chunk itself) and the first
    ``sink`` ones when a window is set — what the cache holds when chunk ``i`` is denoised."""
    i = torch.arange(n_chunks)[:, None]
    j = torch.arange(n_chunks)[None, :]
    vis = j <= i
    if window is not None:
        vis &= (j > i - window) | (j < sink)
    return vis


def block_causal_mask(chunk_tokens: Sequence[int], window: int | None = None, sink: int = 0) -> torch.Tensor:
    """Token-level ``[S, S]`` bool mask for chunks of ``chunk_tokens`` tokens each (see
    :func:`chunk_visibility`)."""
    vis = chunk_visibility(len(chunk_tokens), window, sink)
    owner = torch.repeat_interleave(torch.arange(len(chunk_tokens)), torch.tensor(list(chunk_tokens)))
    return vis[owner][:, owner]


# -- the ``rollout: causal`` pipeline's nodes -----------------------------------------------------
ROLLOUTS = ("bidirectional", "causal")
_SESSION_RE = re.compile(r"^sess-[0-9a-f]{24}$")


def rollout_mode(options: Mapping[str, Any] | None) -> str:
    """``options.rollout``: ``bidirectional`` (default) or ``causal``; anything else is refused."""
    from .options import choice_option

    return choice_option(options, "rollout", ROLLOUTS)


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
    """The causal engines (``engine``: the family's :class:`CausalEngine` class) of one loaded model,
    one per video size (each with its slab pool and its sessions)."""

    def __init__(self, model: LoadedModel, options: CausalOptions, engine: type[CausalEngine]) -> None:
        self.model = model
        self.options = options
        self.engine_class = engine
        self._lock = threading.Lock()
        self._engines: dict[tuple[int, int], tuple[CausalEngine, SessionStore]] = {}

    def engine(self, height: int, width: int) -> tuple[CausalEngine, SessionStore]:
        with self._lock:
            got = self._engines.get((height, width))
            if got is None:
                comps = self.model.components
                eng = self.engine_class(comps["transformer"], comps.get("vae"), options=self.options, height=height,
                                        width=width)
                got = self._engines[(height, width)] = (eng, SessionStore(eng))
            return got

    def pools(self) -> list[CacheManager]:
        with self._lock:
            return [e.manager for e, _ in self._engines.values()]


def deployment(model: LoadedModel, options: Mapping[str, Any] | None, engine: type[CausalEngine]) -> CausalDeployment:
    """The model's causal deployment (``model.config["causal"]``), made anew when the options change."""
    opts = causal_options(options)
    dep = model.config.get("causal")
    if not isinstance(dep, CausalDeployment) or dep.options != opts or dep.engine_class is not engine:
        dep = model.config["causal"] = CausalDeployment(model, opts, engine)
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
    """One chunk per ``step()``; each finished chunk's frames (``frames(video)``: the family's
    uint8 ``[T, H, W, 3]``) are emitted as ``video_chunk``."""

    def __init__(self, dep: CausalDeployment, frames: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.dep = dep
        self.frames = frames

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
        frames = self.frames(out.video)
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


__all__ = ["ROLLOUTS", "SAMPLERS", "Cancelled", "CausalDeployment", "CausalEngine", "CausalOptions", "CausalRollout",
           "ChunkKV", "ChunkOut", "RolloutCheck", "RolloutParams", "Session", "SessionError", "SessionLimit",
           "SessionStore", "Stream", "block_causal_mask", "causal_options", "causal_step", "chunk_noise",
           "chunk_visibility", "deployment", "plan_chunks", "refuse_interceptors", "rollout_mode", "slabs_needed",
           "step_noise"]
