"""omniloop-kvcache, the cache manager: handle-based paged KV blocks with a static budget (PROPOSAL
§6.3.2). A library the families that keep KV use (omniloop-qwen, omniloop-wan's causal rollout); it
was ``omniloop.kvcache`` before omniloop 0.2 (issue 34: a minimal core).

One :class:`CacheManager` is one *pool* of one cache class: a fixed number of equally sized
blocks carved at construction from a byte budget. Text KV uses small blocks (16 tokens, a
vLLM-style paged allocator); causal video's chunk KV uses the same manager with one latent
chunk per block (a *slab*), so both classes sit behind the same :class:`KVHandle` interface
with independent budgets. Families never keep KV in ad-hoc dicts: they hold handles (in their
``LoopState``) and ask the manager for slots.

Accounting (pure Python, no tensors needed)::

    mgr = CacheManager(layout, block_size=16, budget_bytes=2 * 2**30)
    h = mgr.allocate(reserve_tokens=prompt + max_tokens)   # admission: raises CacheFull, or
    mgr.can_allocate(prompt + max_tokens)                  # ... ask first (what a scheduler does)
    slots = mgr.append(h, n)       # room for n more tokens; their flat slot indices
    child = mgr.fork(h)            # shares every block (refcount); copy-on-write on append
    mgr.free(h)                    # decrefs; blocks at refcount 0 return to the free list
    mgr.drop_front(h, n_blocks, keep=1)  # out-of-window recycling, keeping a sink block (video chunks)

Storage (when a :class:`KVLayout` is given): ``k[layer]`` / ``v[layer]`` of shape
``[num_blocks * block_size, kv_heads, head_dim]``; :meth:`write` stores new tokens at their
slots, :meth:`gather` reads a padded batch ``[B, L, kv_heads, head_dim]`` from a slot table;
a paged-attention kernel reads the storage directly through :meth:`block_tables` (int32 block
table + held lengths; e.g. ``omniloop_qwen.paged_attention``).
A token's slot is ``block * block_size + offset``.

*Reservations* make admission safe without preemption: a sequence allocated with
``reserve_tokens`` owns the blocks it will need (counted as used for admission), so a running
sequence can never run out of blocks mid-decode. ``free`` releases what was not used.

Not thread-safe beyond one lock around accounting; a scheduler drives it from one thread.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import torch
from attrs import define, field

from omniloop.errors import OmniloopError


class CacheFull(OmniloopError):
    """Not enough free blocks in the pool for what was asked."""


@define(frozen=True)
class KVLayout:
    """What one token stores: K and V of ``kv_heads × head_dim`` for each of ``layers`` layers."""

    layers: int = field(validator=lambda _i, _a, v: _positive("layers", v))
    kv_heads: int = field(validator=lambda _i, _a, v: _positive("kv_heads", v))
    head_dim: int = field(validator=lambda _i, _a, v: _positive("head_dim", v))
    dtype: torch.dtype = torch.float32
    device: torch.device = field(factory=lambda: torch.device("cpu"), converter=torch.device)

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * elem


def _positive(name: str, v: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"KVLayout.{name}: must be a positive integer, got {v!r}")


@define(frozen=True, eq=True)
class KVHandle:
    """An opaque reference to one sequence's blocks in one manager (hashable, cheap to copy)."""

    id: int
    pool: int


@define
class _Seq:
    blocks: list[int]
    length: int = 0  # tokens written (or appended) so far, counting dropped ones
    dropped: int = 0  # blocks dropped (out-of-window), after the ``sink`` first blocks
    sink: int = 0  # leading blocks kept however much is dropped (attention sinks)
    reserved: int = 0  # blocks still reserved for this sequence, not yet in ``blocks``
    tag: Any = None


_POOLS = itertools.count(1)


class CacheManager:
    """A pool of ``num_blocks`` blocks of ``block_size`` tokens; see the module docstring."""

    def __init__(
        self,
        layout: KVLayout | None = None,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        budget_bytes: int | None = None,
        name: str = "kv",
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: must be a positive integer, got {block_size!r}")
        if (num_blocks is None) == (budget_bytes is None):
            raise ValueError("give exactly one of num_blocks or budget_bytes")
        self.layout = layout
        self.block_size = block_size
        self.name = name
        if num_blocks is None:
            if layout is None:
                raise ValueError("budget_bytes needs a KVLayout (bytes per block come from it)")
            assert budget_bytes is not None
            num_blocks = int(budget_bytes) // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"the budget holds no block (num_blocks={num_blocks}; one block is {self.bytes_per_block} bytes)"
            )
        self.num_blocks = int(num_blocks)
        self._pool = next(_POOLS)
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._refs = [0] * self.num_blocks
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() gives low ids first
        self._seqs: dict[int, _Seq] = {}
        self._reserved = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        if layout is not None:
            slots = self.num_blocks * block_size
            shape = (slots, layout.kv_heads, layout.head_dim)
            self.k = [torch.zeros(shape, dtype=layout.dtype, device=layout.device) for _ in range(layout.layers)]
            self.v = [torch.zeros(shape, dtype=layout.dtype, device=layout.device) for _ in range(layout.layers)]

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        return 0 if self.layout is None else self.layout.bytes_per_token * self.block_size

    @property
    def capacity_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-max(0, int(tokens)) // self.block_size)

    @property
    def free_blocks(self) -> int:
        """Blocks neither in use nor reserved: what admission may still hand out."""
        with self._lock:
            return len(self._free) - self._reserved

    @property
    def used_blocks(self) -> int:
        with self._lock:
            return self.num_blocks - len(self._free)

    @property
    def reserved_blocks(self) -> int:
        with self._lock:
            return self._reserved

    @property
    def sequences(self) -> int:
        with self._lock:
            return len(self._seqs)

    def can_allocate(self, tokens: int) -> bool:
        """Whether a new sequence reserving ``tokens`` tokens would be admitted now."""
        return self.blocks_for(tokens) <= self.free_blocks

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "num_blocks": self.num_blocks, "block_size": self.block_size,
                "used_blocks": self.num_blocks - len(self._free), "reserved_blocks": self._reserved,
                "free_blocks": len(self._free) - self._reserved, "sequences": len(self._seqs),
                "bytes_per_block": self.bytes_per_block,
            }

    # -- handles ----------------------------------------------------------------------------------
    def allocate(self, tokens: int = 0, *, reserve_tokens: int = 0, tag: Any = None) -> KVHandle:
        """A new sequence with room for ``tokens`` tokens now (length stays 0 until ``append``)
        and ``reserve_tokens`` in total reserved for it. Raises :class:`CacheFull`."""
        want = self.blocks_for(max(tokens, reserve_tokens))
        with self._lock:
            if want > len(self._free) - self._reserved:
                raise CacheFull(
                    f"KV cache {self.name!r}: {want} blocks needed ({max(tokens, reserve_tokens)} tokens), "
                    f"{len(self._free) - self._reserved} free of {self.num_blocks}"
                )
            now = self.blocks_for(tokens)
            seq = _Seq(blocks=[self._take() for _ in range(now)], reserved=want - now, tag=tag)
            self._reserved += seq.reserved
            hid = next(self._ids)
            self._seqs[hid] = seq
            return KVHandle(hid, self._pool)

    def fork(self, handle: KVHandle, *, reserve_tokens: int = 0, tag: Any = None) -> KVHandle:
        """A new sequence sharing every block of ``handle`` (refcounted; the first append to a
        shared partially filled block copies it). ``reserve_tokens``: extra tokens reserved."""
        with self._lock:
            src = self._seq(handle)
            extra = self.blocks_for(reserve_tokens) + (1 if src.length % self.block_size else 0)
            if extra > len(self._free) - self._reserved:
                raise CacheFull(f"KV cache {self.name!r}: cannot fork, {extra} blocks needed, {self.free_blocks} free")
            for b in src.blocks:
                self._refs[b] += 1
            seq = _Seq(blocks=list(src.blocks), length=src.length, dropped=src.dropped, sink=src.sink, reserved=extra,
                       tag=tag)
            self._reserved += extra
            hid = next(self._ids)
            self._seqs[hid] = seq
            return KVHandle(hid, self._pool)

    def free(self, handle: KVHandle) -> None:
        """Release the sequence: its blocks are decref'd, its unused reservation returned. Idempotent."""
        with self._lock:
            if handle.pool != self._pool:
                raise ValueError(f"{handle} does not belong to KV cache {self.name!r}")
            seq = self._seqs.pop(handle.id, None)
            if seq is None:
                return
            for b in seq.blocks:
                self._decref(b)
            self._reserved -= seq.reserved

    def is_live(self, handle: KVHandle) -> bool:
        with self._lock:
            return handle.pool == self._pool and handle.id in self._seqs

    def length(self, handle: KVHandle) -> int:
        """Tokens appended to the sequence so far (dropped ones included: positions keep counting)."""
        with self._lock:
            return self._seq(handle).length

    def start(self, handle: KVHandle) -> int:
        """Position of the first token still held (> 0 after ``drop_front`` without a sink)."""
        with self._lock:
            seq = self._seq(handle)
            return 0 if seq.sink else seq.dropped * self.block_size

    def positions(self, handle: KVHandle) -> torch.Tensor:
        """Absolute positions of the tokens still held, in slot order (sink blocks first)."""
        with self._lock:
            seq = self._seq(handle)
            bs = self.block_size
            head = torch.arange(seq.sink * bs)
            tail = torch.arange((seq.sink + seq.dropped) * bs, seq.length)
            return torch.cat([head, tail])

    def block_table(self, handle: KVHandle) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._seq(handle).blocks)

    def append(self, handle: KVHandle, n: int) -> torch.Tensor:
        """Grow the sequence by ``n`` tokens; return their flat slot indices (int64 ``[n]``).

        Blocks come from the sequence's reservation first, then the free list. A shared last
        block (after ``fork``) is copied before it is written (copy-on-write)."""
        if n < 0:
            raise ValueError(f"append: n must be >= 0, got {n}")
        with self._lock:
            seq = self._seq(handle)
            bs = self.block_size
            held = seq.length - seq.dropped * bs  # tokens in seq.blocks
            if held % bs and self._refs[seq.blocks[-1]] > 1 and n > 0:
                old = seq.blocks[-1]
                new = self._take_for(seq)
                self._copy_block(old, new, held % bs)
                self._decref(old)
                seq.blocks[-1] = new
            need = self.blocks_for(held + n) - len(seq.blocks)
            if need > seq.reserved + len(self._free) - self._reserved:
                raise CacheFull(
                    f"KV cache {self.name!r}: {need} more blocks needed, {self.free_blocks} free of {self.num_blocks}"
                )
            for _ in range(need):
                seq.blocks.append(self._take_for(seq))
            blocks = seq.blocks
            slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(held, held + n)], dtype=torch.long)
            seq.length += n
            return slots

    def slots(self, handle: KVHandle) -> torch.Tensor:
        """Flat slot indices of every token still held, in order (int64 ``[length - start]``)."""
        with self._lock:
            seq = self._seq(handle)
            held = seq.length - seq.dropped * self.block_size
            table = torch.tensor(seq.blocks, dtype=torch.long)
            pos = torch.arange(held)
            return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slot_table(self, handles: Sequence[KVHandle], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots of every token still held by each of ``handles``, padded with ``pad``:
        (``[B, L_max]`` int64, held lengths ``[B]``) — one batched gather index for a forward."""
        with self._lock:
            seqs = [self._seq(h) for h in handles]
            bs = self.block_size
            held = [s.length - s.dropped * bs for s in seqs]
            width = max(held, default=0)
            nb = max((len(s.blocks) for s in seqs), default=0)
            table = torch.tensor([s.blocks + [0] * (nb - len(s.blocks)) for s in seqs], dtype=torch.long).view(len(seqs), nb)
            lengths = torch.tensor(held, dtype=torch.long)
        pos = torch.arange(width)
        slots = table[:, pos // bs] * bs + pos % bs if width else torch.zeros((len(seqs), 0), dtype=torch.long)
        return slots.masked_fill(pos[None, :] >= lengths[:, None], pad), lengths

    def block_tables(self, handles: Sequence[KVHandle], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks each of ``handles`` holds, in slot order, padded with ``pad``: (int32
        ``[B, max_blocks]``, held tokens int32 ``[B]``) — what a paged-attention kernel reads
        (token ``i`` of sequence ``b`` is at slot ``table[b, i // block_size] * block_size + i %
        block_size``; the same order as :meth:`slot_table`)."""
        with self._lock:
            seqs = [self._seq(h) for h in handles]
            bs = self.block_size
            held = [s.length - s.dropped * bs for s in seqs]
            nb = max((len(s.blocks) for s in seqs), default=0)
            rows = [s.blocks + [pad] * (nb - len(s.blocks)) for s in seqs]
        table = torch.tensor(rows, dtype=torch.int32).view(len(seqs), nb)
        return table, torch.tensor(held, dtype=torch.int32)

    def drop_front(self, handle: KVHandle, n_blocks: int, *, keep: int = 0) -> None:
        """Release the oldest ``n_blocks`` full blocks after the first ``keep`` (out-of-window
        recycling; ``keep`` leading blocks are attention sinks, fixed by the first drop that keeps
        any). Positions keep counting."""
        with self._lock:
            seq = self._seq(handle)
            if seq.dropped and keep != seq.sink:
                raise ValueError(f"drop_front: this sequence keeps {seq.sink} sink blocks, got keep={keep}")
            full = (seq.length - seq.dropped * self.block_size) // self.block_size - keep
            if keep < 0 or not 0 <= n_blocks <= full:
                raise ValueError(f"drop_front: can drop 0..{max(0, full)} full blocks after {keep} kept, got {n_blocks}")
            for b in seq.blocks[keep : keep + n_blocks]:
                self._decref(b)
            del seq.blocks[keep : keep + n_blocks]
            seq.dropped += n_blocks
            if n_blocks:
                seq.sink = keep

    # -- storage ----------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[n, kv_heads, head_dim]``) of ``layer`` at ``slots`` (``[n]``)."""
        self.k[layer].index_copy_(0, slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v[layer].dtype))

    def gather(self, layer: int, slot_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slot_table`` (any shape ``S``) as ``[*S, kv_heads, head_dim]``."""
        return self.k[layer][slot_table], self.v[layer][slot_table]

    # -- checks -----------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the accounting invariants (tests call this; cheap enough for debugging)."""
        with self._lock:
            refs = [0] * self.num_blocks
            for seq in self._seqs.values():
                for b in seq.blocks:
                    refs[b] += 1
            if refs != self._refs:
                raise AssertionError("block refcounts disagree with the block tables")
            free = set(self._free)
            if len(free) != len(self._free):
                raise AssertionError("a block is on the free list twice")
            in_use = {b for b, r in enumerate(refs) if r}
            if free & in_use or len(free) + len(in_use) != self.num_blocks:
                raise AssertionError("free list and used blocks do not partition the pool")
            if self._reserved != sum(s.reserved for s in self._seqs.values()) or self._reserved > len(self._free):
                raise AssertionError("reservations are inconsistent")

    # -- internals --------------------------------------------------------------------------------
    def _seq(self, handle: KVHandle) -> _Seq:
        if handle.pool != self._pool:
            raise ValueError(f"{handle} does not belong to KV cache {self.name!r}")
        try:
            return self._seqs[handle.id]
        except KeyError:
            raise ValueError(f"{handle} was freed") from None

    def _take(self) -> int:
        b = self._free.pop()
        self._refs[b] = 1
        return b

    def _take_for(self, seq: _Seq) -> int:
        if seq.reserved > 0:
            seq.reserved -= 1
            self._reserved -= 1
        elif len(self._free) - self._reserved < 1:
            raise CacheFull(f"KV cache {self.name!r}: no free block ({self.num_blocks} in use or reserved)")
        return self._take()

    def _decref(self, b: int) -> None:
        self._refs[b] -= 1
        if self._refs[b] == 0:
            self._free.append(b)

    def _copy_block(self, src: int, dst: int, tokens: int) -> None:
        bs = self.block_size
        for cache in (*self.k, *self.v):
            cache[dst * bs : dst * bs + tokens] = cache[src * bs : src * bs + tokens]


def padded_slot_table(slot_lists: Sequence[torch.Tensor], pad: int = 0) -> torch.Tensor:
    """Stack per-sequence slot vectors into ``[B, L_max]`` (padding with ``pad``) for :meth:`CacheManager.gather`."""
    width = max((len(s) for s in slot_lists), default=0)
    out = torch.full((len(slot_lists), width), pad, dtype=torch.long)
    for i, s in enumerate(slot_lists):
        out[i, : len(s)] = s
    return out
