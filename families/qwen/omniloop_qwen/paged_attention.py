"""Paged attention over the :class:`~omniloop_kvcache.CacheManager`'s storage: a Triton kernel that
reads the block table itself, and the torch reference it is tested against.

Nothing here is Qwen-specific: the inputs are the manager's per-layer K/V tensors
(``[num_blocks * block_size, kv_heads, head_dim]``, a token's slot is ``block * block_size +
offset``), a block table and per-row lengths, so any family that keeps K/V in a ``CacheManager``
(the causal video's chunk slabs included) can call :func:`paged_attention`.

**Query rows.** The kernel attends ``R`` query rows, each of one token and ``q_heads`` heads
(``q: [R, q_heads, head_dim]``). Row ``r`` belongs to sequence ``row_seq[r]`` (a row of
``block_table``) and attends to the first ``kv_lens[r]`` tokens that sequence holds, in slot order.

* A decode step is one row per sequence with ``kv_lens`` = the tokens held (the new one included).
* A prefill chunk of ``n`` tokens appended to a sequence holding ``L`` tokens afterwards is ``n``
  rows with ``kv_lens = L - n + 1 .. L``: the causal mask is a prefix in slot order (new tokens are
  appended last), also after ``drop_front``.

**GQA.** One program serves every query head of one KV head (``q_heads / kv_heads`` of them, padded
to 16 for ``tl.dot``), so a K/V tile is loaded once per group, not once per query head.

**Split-K (flash-decoding).** With few rows (batch 1) the ``rows × kv_heads`` programs cannot fill
the GPU, so the context is cut into ``splits`` equal ranges, each program reduces one range to a
partial (max, sum, weighted V) in float32, and a second kernel merges the partials. The host picks
``splits`` from the row count, the longest ``kv_lens`` and the device's SM count (no device sync:
the lengths come from the cache manager's bookkeeping).

**Numerics.** Scores, softmax statistics and the accumulator are float32; with a float32 cache
both dots are IEEE float32, with bf16/fp16 ``Q·K`` and ``P·V`` run on the tensor cores in the
cache's dtype (P rounded to it), as flash-attention kernels do. Not bit-equal to SDPA: the tests
state the tolerance (float32 2e-5 absolute; bf16 2e-2, about one bf16 ulp of the output). Under
Triton's interpreter the dots always run in float32 (its bf16 ``tl.dot`` is wrong in triton 3.6).

**Backends.** ``triton`` needs CUDA tensors, or ``TRITON_INTERPRET=1`` (Triton's interpreter runs
the same kernel on CPU tensors, slowly: what the CPU tests do). :func:`triton_unavailable`
says why the kernel cannot run for a device. The ``torch`` reference gathers each row's K/V
through the block table and runs a float32 softmax.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

#: values of the qwen family's ``attention`` deploy option
BACKENDS = ("auto", "torch", "triton")

#: tokens per K/V tile of the kernel's inner loop
BLOCK_N = 64
#: most context splits of one row (the merge kernel loads them all at once)
MAX_SPLITS = 64


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_unavailable(device: str | torch.device) -> str | None:
    """Why the Triton kernel cannot run for tensors on ``device`` (None when it can)."""
    if not triton_available():
        return "the 'triton' package is not installed"
    dev = torch.device(device)
    if dev.type == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available on this machine"
    if interpreting():
        return None
    return f"it needs a CUDA device (got {str(dev)!r}; or TRITON_INTERPRET=1 for Triton's CPU interpreter)"


def resolve_backend(choice: str, device: str | torch.device) -> str:
    """``auto`` → ``triton`` on CUDA when Triton imports, else ``torch``; ``triton`` where it cannot
    run raises ``ValueError`` saying why; ``torch`` as is."""
    if choice not in BACKENDS:
        raise ValueError(f"must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "torch":
        return "torch"
    why = triton_unavailable(device)
    if choice == "triton":
        if why is not None:
            raise ValueError(f"'triton' cannot run: {why}")
        return "triton"
    return "triton" if why is None and torch.device(device).type == "cuda" else "torch"


# ------------------------------------------------------------------------------------------------
# the torch reference
# ------------------------------------------------------------------------------------------------


def paged_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    kv_lens: torch.Tensor, row_seq: torch.Tensor, *, block_size: int, scale: float,
) -> torch.Tensor:
    """The reference of :func:`paged_attention` (same arguments): each row's K/V gathered through
    the block table, a float32 softmax over its ``kv_lens`` tokens, the output in ``q.dtype``."""
    r, hq, d = q.shape
    hkv = k_cache.shape[1]
    width = int(kv_lens.max()) if r else 0
    pos = torch.arange(width, device=q.device)
    table = block_table.long()[row_seq.long()]  # [R, blocks]
    slots = table[:, pos // block_size] * block_size + pos % block_size  # [R, W]
    valid = pos[None, :] < kv_lens.long()[:, None]
    slots = slots.masked_fill(~valid, 0)
    k = k_cache[slots].float().repeat_interleave(hq // hkv, dim=2)  # [R, W, Hq, D]
    v = v_cache[slots].float().repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("rhd,rwhd->rhw", q.float(), k) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("rhw,rwhd->rhd", p, v).to(q.dtype).view(r, hq, d)


# ------------------------------------------------------------------------------------------------
# the Triton kernels (defined on first use: TRITON_INTERPRET is read when a kernel is defined)
# ------------------------------------------------------------------------------------------------

_KERNELS: dict[bool, tuple[Any, Any]] = {}


def _kernels() -> tuple[Any, Any]:
    mode = interpreting()
    if mode in _KERNELS:
        return _KERNELS[mode]
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attn_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, rowseq_ptr,
        out_ptr, part_ptr, stats_ptr,
        stride_qr, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb,
        stride_or, stride_oh, split_tokens, n_splits, scale, n_seqs, table_width, num_pages,
        GROUPS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        PAGE: tl.constexpr, BLOCK: tl.constexpr, DIRECT: tl.constexpr, FP32: tl.constexpr,
    ):
        # (n_splits is a runtime value, so a growing context never recompiles; DIRECT: one split, no merge)
        # FP32: both dots in float32 (IEEE); else Q·K and P·V in the cache dtype, accumulated in float32
        # every index that forms an address is clamped into its buffer (defence in depth: the host
        # checks shapes and dtypes, not values, which would cost a device sync); offsets are int64
        row = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq = tl.load(rowseq_ptr + row).to(tl.int64)
        seq = tl.minimum(tl.maximum(seq, 0), n_seqs - 1)
        length = tl.load(lens_ptr + row)
        length = tl.minimum(length, table_width * PAGE)  # never past the table's last column
        lo = split * split_tokens
        hi = tl.minimum(length, lo + split_tokens)

        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        gmask = g < GROUPS
        dmask = d < D
        heads = kvh * GROUPS + g
        q = tl.load(q_ptr + row * stride_qr + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)  # [G_PAD, D_PAD]

        m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        n_off = tl.arange(0, BLOCK)
        start = lo
        while start < hi:  # (a while loop: Triton's interpreter cannot range() over loaded bounds)
            n = start + n_off
            nmask = n < hi
            col = tl.minimum(n // PAGE, table_width - 1)
            page = tl.load(table_ptr + seq * stride_tb + col, mask=nmask, other=0)
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)  # a pad/-1 entry stays in the pool
            slot = page * PAGE + n % PAGE
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            if FP32:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(nmask[None, :], s * scale, float("-inf"))  # [G_PAD, BLOCK]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            if FP32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
            start += BLOCK

        out_mask = gmask[:, None] & dmask[None, :]
        if DIRECT:
            o = acc / l_sum[:, None]
            tl.store(out_ptr + row * stride_or + heads[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            # partials: part [R, Hq, n_splits, D_PAD], stats [R, Hq, n_splits, 2] (max, sum), float32
            n_heads = tl.num_programs(1) * GROUPS
            base = (row * n_heads + heads.to(tl.int64)) * n_splits + split  # [G_PAD]
            tl.store(part_ptr + base[:, None] * D_PAD + d[None, :], acc, mask=out_mask)
            tl.store(stats_ptr + base * 2, m, mask=gmask)
            tl.store(stats_ptr + base * 2 + 1, l_sum, mask=gmask)

    @triton.jit
    def merge_kernel(
        part_ptr, stats_ptr, out_ptr, stride_or, stride_oh, n_splits,
        D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        n_heads = tl.num_programs(1)
        sp = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        smask = sp < n_splits
        base = (row * n_heads + head) * n_splits + sp
        m = tl.load(stats_ptr + base * 2, mask=smask, other=float("-inf"))
        l_sum = tl.load(stats_ptr + base * 2 + 1, mask=smask, other=0.0)
        m_all = tl.max(m, axis=0)  # split 0 always holds a token, so this is finite
        w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)
        part = tl.load(part_ptr + base[:, None] * D_PAD + d[None, :], mask=smask[:, None], other=0.0)
        o = tl.sum(part * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
        tl.store(out_ptr + row * stride_or + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < D)

    _KERNELS[mode] = (paged_attn_kernel, merge_kernel)
    return _KERNELS[mode]


def prepare() -> None:
    """Define the kernels now (outside any timed region or ``torch.compile`` trace)."""
    _kernels()


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


_SMS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def choose_splits(rows: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Context splits per row: enough programs for about two waves over the SMs, each split at
    least one ``BLOCK_N`` tile, at most ``MAX_SPLITS``."""
    programs = max(1, rows * kv_heads)
    want = -(-2 * _sm_count(device) // programs)
    return max(1, min(want, -(-max_len // BLOCK_N), MAX_SPLITS))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    kv_lens: torch.Tensor, row_seq: torch.Tensor, *, block_size: int, scale: float,
    max_len: int | None = None, splits: int | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` (``[R, q_heads, head_dim]``) over paged K/V, by the Triton kernel.

    ``k_cache`` / ``v_cache``: ``[slots, kv_heads, head_dim]`` (a ``CacheManager`` layer; the last
    dim contiguous); ``block_table``: int32 ``[B, blocks]`` (row ``b``: the blocks sequence ``b``
    holds, in order; padding is never read); ``kv_lens``: int32 ``[R]``, each ``>= 1``; ``row_seq``:
    int32 ``[R]`` (rows of ``block_table``). ``max_len``: ``max(kv_lens)`` when the caller knows it
    (host side, saves a device sync); ``splits``: context splits (default :func:`choose_splits`).
    Returns ``[R, q_heads, head_dim]`` in ``q.dtype`` (into ``out`` when given)."""
    r, hq, d = q.shape
    hkv = k_cache.shape[1]
    if hq % hkv:
        raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hkv})")
    if k_cache.shape[2] != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"K/V caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match q's head_dim {d}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    _check_index_tensors(q, k_cache, block_table, kv_lens, row_seq, block_size)
    if out is None:
        out = torch.empty((r, hq, d), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out: expected shape {tuple(q.shape)} with a contiguous last dimension")
    if r == 0:
        return out
    if max_len is None:
        max_len = int(kv_lens.max())
    groups = hq // hkv
    s = splits or choose_splits(r, hkv, max_len, q.device)
    s = max(1, min(int(s), MAX_SPLITS, -(-max_len // BLOCK_N)))
    split_tokens = -(-max_len // s)
    split_tokens = -(-split_tokens // BLOCK_N) * BLOCK_N  # whole tiles per split
    s = -(-max_len // split_tokens)
    d_pad = _pow2(d, 16)
    if _DEBUG_BOUNDS and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        check_bounds(q, k_cache, v_cache, block_table, kv_lens, row_seq, block_size=block_size, out=out)
    attn, merge = _kernels()
    if s > 1:
        part = torch.empty((r, hq, s, d_pad), dtype=torch.float32, device=q.device)
        stats = torch.empty((r, hq, s, 2), dtype=torch.float32, device=q.device)
    else:
        part = stats = out  # unused
    attn[(r, hkv, s)](
        q, k_cache, v_cache, block_table, kv_lens, row_seq, out, part, stats,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1), split_tokens, s, float(scale),
        block_table.shape[0], block_table.shape[1], k_cache.shape[0] // block_size,
        GROUPS=groups, G_PAD=_pow2(groups, 16), D=d, D_PAD=d_pad, PAGE=block_size, BLOCK=BLOCK_N, DIRECT=s == 1,
        FP32=q.dtype == torch.float32 or interpreting(),  # the interpreter's bf16 tl.dot is wrong: dot in float32 there
    )
    if s > 1:
        merge[(r, hq)](part, stats, out, out.stride(0), out.stride(1), s, D=d, D_PAD=d_pad, S_PAD=_pow2(s))
    return out


#: ``OMNILOOP_PAGED_ATTENTION_CHECK=1``: every :func:`paged_attention` call outside a CUDA-graph
#: capture first runs :func:`check_bounds` (a device sync and a host copy per call: debugging only)
_DEBUG_BOUNDS = os.environ.get("OMNILOOP_PAGED_ATTENTION_CHECK", "0").strip().lower() in ("1", "true", "on", "yes")


def _check_index_tensors(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, kv_lens: torch.Tensor,
                         row_seq: torch.Tensor, block_size: int) -> None:
    """What the kernel assumes of its index tensors, checked from metadata only (no device sync)."""
    r = q.shape[0]
    for name, t in (("block_table", block_table), ("kv_lens", kv_lens), ("row_seq", row_seq)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name}: expected int32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, q on {q.device}")
    if k_cache.device != q.device:
        raise ValueError(f"k_cache/v_cache: on {k_cache.device}, q on {q.device}")
    if kv_lens.shape != (r,) or row_seq.shape != (r,):
        raise ValueError(f"kv_lens {tuple(kv_lens.shape)} / row_seq {tuple(row_seq.shape)}: expected ({r},), one per q row")
    if r > 1 and (kv_lens.stride(0) != 1 or row_seq.stride(0) != 1):  # (one row: any stride reads index 0)
        raise ValueError("kv_lens and row_seq must be contiguous")
    if block_table.dim() != 2 or (block_table.shape[1] > 1 and block_table.stride(1) != 1):
        raise ValueError(f"block_table: expected [sequences, blocks] with contiguous rows, got shape "
                         f"{tuple(block_table.shape)} strides {block_table.stride()}")
    if r and (block_table.shape[0] < 1 or block_table.shape[1] < 1):
        raise ValueError(f"block_table: {tuple(block_table.shape)} holds no block for {r} rows")
    if k_cache.shape[0] % block_size:
        raise ValueError(f"k_cache: {k_cache.shape[0]} slots is not a whole number of {block_size}-token blocks")


def check_bounds(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, kv_lens: torch.Tensor,
    row_seq: torch.Tensor, *, block_size: int, out: torch.Tensor | None = None,
) -> dict[str, int]:
    """Every address :func:`paged_attention` would touch, computed on the host from the block table,
    lengths and strides; raises ``AssertionError`` naming the first index that leaves its buffer.

    Checks (without relying on the kernel's clamps): each ``row_seq`` names a row of
    ``block_table``; each ``kv_lens`` is ``>= 1`` and fits that row's columns; every block id read
    (columns ``0 .. ceil(kv_lens / block_size) - 1``) is a block of the pool; the largest element
    offset of K, V, Q and ``out`` is inside its tensor's storage. Returns the largest offsets (tests
    print them). Used by the tests on the shapes the runtime produces; ``OMNILOOP_PAGED_ATTENTION_CHECK=1``
    runs it before every kernel launch."""
    r, hq, d = q.shape
    hkv = k_cache.shape[1]
    table = block_table.detach().cpu().long()
    lens = kv_lens.detach().cpu().long()
    seqs = row_seq.detach().cpu().long()
    n_seqs, width = table.shape
    num_pages = k_cache.shape[0] // block_size
    max_slot = -1
    for i in range(r):
        s_, n = int(seqs[i]), int(lens[i])
        assert 0 <= s_ < n_seqs, f"row {i}: row_seq {s_} is not a row of the {n_seqs}-row block table"
        assert n >= 1, f"row {i}: kv_lens {n} < 1"
        cols = -(-n // block_size)
        assert cols <= width, f"row {i}: kv_lens {n} needs {cols} blocks, the table has {width} columns"
        pages = table[s_, :cols]
        bad = pages[(pages < 0) | (pages >= num_pages)]
        assert bad.numel() == 0, f"row {i}: block id {int(bad[0])} read, the pool has {num_pages} blocks"
        pos = torch.arange(n)
        max_slot = max(max_slot, int((pages[pos // block_size] * block_size + pos % block_size).max()))

    def last(t: torch.Tensor, idx: tuple[int, ...]) -> int:
        return t.storage_offset() + sum(i * st for i, st in zip(idx, t.stride(), strict=True))

    def inside(name: str, t: torch.Tensor, off: int) -> None:
        room = t.untyped_storage().nbytes() // t.element_size()
        assert off < room, f"{name}: element offset {off} past its storage of {room} elements"

    found = {"max_slot": max_slot}
    if r:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            found[name] = last(t, (max_slot, hkv - 1, d - 1))
            inside(name, t, found[name])
        found["q"] = last(q, (r - 1, hq - 1, d - 1))
        inside("q", q, found["q"])
        if out is not None:
            found["out"] = last(out, (r - 1, hq - 1, d - 1))
            inside("out", out, found["out"])
    return found


def attention_rows(lengths_after: list[int], new_tokens: list[int]) -> tuple[list[int], list[int]]:
    """(``row_seq``, ``kv_lens``) of a forward that appends ``new_tokens[b]`` tokens to sequence
    ``b``, which then holds ``lengths_after[b]`` tokens: one row per new token, causal."""
    row_seq: list[int] = []
    kv_lens: list[int] = []
    for b, (held, n) in enumerate(zip(lengths_after, new_tokens, strict=True)):
        row_seq.extend([b] * n)
        kv_lens.extend(range(held - n + 1, held + 1))
    return row_seq, kv_lens


__all__ = [
    "BACKENDS", "attention_rows", "check_bounds", "choose_splits", "interpreting", "paged_attention", "paged_attention_torch",
    "prepare", "resolve_backend", "triton_available", "triton_unavailable",
]
