"""What a causal (chunk-by-chunk, KV-cached) rollout of a video denoiser shares: a stream's
chunk-KV slabs and the sessions that keep a stream between requests. Wan's ``rollout: causal``
(:mod:`omniloop_wan.causal`) runs on it; the engine (the family's chunk loop) is its own.

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
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from attrs import define, field

from omniloop.errors import OmniloopError

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


__all__ = ["Cancelled", "ChunkKV", "Session", "SessionError", "SessionLimit", "SessionStore", "slabs_needed"]
