"""Chunk-KV slabs: one sequence of a :class:`omniloop_kvcache.CacheManager` per stream.

The manager's ``block_size`` is one chunk's tokens, so one block is one *slab* (a chunk's clean
K/V for every layer). A finished chunk's K/V is written once (:meth:`ChunkKV.commit`); the next
chunks read every held slab (:meth:`ChunkKV.context`). With a rolling ``window`` the oldest
slabs past the window are released with ``drop_front(keep=sink)``: the first ``sink`` chunks stay
(attention sinks), positions keep counting (RoPE uses absolute frame indices).
"""

from __future__ import annotations

from typing import Any

import torch

from omniloop_kvcache import CacheManager, KVHandle, KVLayout


def chunk_layout(model: Any, dtype: torch.dtype | None = None, device: Any = None) -> KVLayout:
    """What one token stores for ``model`` (a ``WanTransformer3DModel``): K and V per block."""
    cfg = model.config
    return KVLayout(
        layers=len(model.blocks), kv_heads=int(cfg.num_attention_heads), head_dim=int(cfg.attention_head_dim),
        dtype=dtype or model.dtype, device=torch.device(device) if device is not None else model.device,
    )


def slabs_needed(chunks: int, window: int | None, sink: int) -> int:
    """Slabs one stream of ``chunks`` chunks holds at most (window + sink when windowed)."""
    return chunks if window is None else min(chunks, window + sink)


class ChunkKV:
    """One stream's slabs; ``context`` / ``recorder`` plug into :func:`.model.chunk_forward`."""

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


__all__ = ["ChunkKV", "chunk_layout", "slabs_needed"]
