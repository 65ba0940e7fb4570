"""Triton kernels of omniloop-quant (CUDA only; every caller keeps a torch path for elsewhere).

:func:`gelu_quantize_rows` — the feed-forward's middle in one pass: ``y = gelu(h)`` (rounded to
``h``'s dtype, as ``torch.nn.functional.gelu`` returns it), then the per-row e4m3 quantisation of
:func:`omniloop_quant.fp8.quantize_rows` (``scale = max|y| / 448``, ``q = round_e4m3(y / scale)``).
One program owns one row: the row is read once, kept in registers (rows up to
:data:`MAX_ROW` wide) and written once in e4m3 with its float32 scale. The row is held as up to four
power-of-two pieces that add up to its width (:func:`pieces`: 8,960 = 8,192 + 512 + 256), not as one
block padded to the next power of two: the kernel is bound by its arithmetic (the GELU and the
division, ~35 instructions an element) as much as by its bytes, and a padded 16,384-wide block spent
83 % more of it on masked lanes at Wan 1.3B's width. Under ``torch.compile``
inductor fuses the same ops itself, but as a looped reduction that reads the 8,960-wide bf16 row of
Wan 1.3B's FFN twice and recomputes the GELU (H200 profile, ``bench/results/wan_gpu-1.3b-fwd-fp8-
profile-h200-2026-12-04.json``: 33 ms of a 389 ms FP8 forward, ~1.1 ms per block where the bytes
moved need ~0.3 ms).

The GELU formulas are torch's: ``approximate="tanh"`` is ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``
(tanh written as ``1 - 2 / (exp(2u) + 1)``), ``"none"`` is ``0.5 x (1 + erf(x / sqrt 2))``; in float32, so
the result equals torch's up to float32 rounding before the rounding to ``h``'s dtype.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

#: largest finite e4m3 magnitude (as in omniloop_quant.fp8)
E4M3_MAX = 448.0
#: rows wider than this are left to the torch path (the whole row lives in one program's registers)
MAX_ROW = 16384
_TINY_AMAX = 1e-12

#: looked up once, at import (a call inside a compiled block must not reach importlib)
_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON


def supported(h: torch.Tensor) -> bool:
    """Whether :func:`gelu_quantize_rows` takes ``h`` (else the caller computes with torch)."""
    return (h.is_cuda and h.dim() == 2 and h.stride(-1) == 1 and h.shape[-1] <= MAX_ROW
            and h.dtype in (torch.bfloat16, torch.float16, torch.float32) and _TRITON)


if _TRITON:
    # Defined at import, as module globals (where Triton finds the helper a kernel calls), never
    # inside a compiled region: building a triton.jit function reads Triton's settings through calls
    # dynamo cannot trace (an H200 run of 2026-12-05 failed so when the kernel was built lazily on
    # its first, compiled, call).
    import triton
    import triton.language as tl

    @triton.jit
    def gelu_rounded(x, TANH: tl.constexpr, ROUND_BF16: tl.constexpr, ROUND_F16: tl.constexpr,
                     GELU: tl.constexpr):
        # one return at the end (no early return under a constexpr branch: device functions compile that way
        # on every Triton); GELU off: the rows as they are (quantize_rows), already in their dtype
        y = x
        if GELU:
            if TANH:
                u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
                t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
                y = 0.5 * x * (1.0 + t)
            else:
                y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
            if ROUND_BF16:  # the activation as torch returns it, in the input's dtype
                y = y.to(tl.bfloat16).to(tl.float32)
            if ROUND_F16:
                y = y.to(tl.float16).to(tl.float32)
        return y

    @triton.jit
    def gelu_quant_rows(h_ptr, q_ptr, s_ptr, n_cols, stride_h, stride_q, BLOCK: tl.constexpr, TANH: tl.constexpr,
                        ROUND_BF16: tl.constexpr, ROUND_F16: tl.constexpr):
        # the whole row in registers: h read once
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        y = gelu_rounded(x, TANH, ROUND_BF16, ROUND_F16, True)
        amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0)
        scale = tl.maximum(amax, 1e-12) / 448.0
        q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
        tl.store(q_ptr + row * stride_q + cols, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def gelu_quant_rows_chunked(h_ptr, q_ptr, s_ptr, n_cols, stride_h, stride_q, CHUNK: tl.constexpr,
                                TANH: tl.constexpr, ROUND_BF16: tl.constexpr, ROUND_F16: tl.constexpr):
        # the row in CHUNK-wide pieces: the GELU's amax first, then again to quantise (h read twice,
        # the second time mostly from cache; fewer registers per thread than the whole-row kernel)
        row = tl.program_id(0)
        amax = tl.zeros((CHUNK,), dtype=tl.float32)
        for start in range(0, n_cols, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            mask = cols < n_cols
            x = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
            y = gelu_rounded(x, TANH, ROUND_BF16, ROUND_F16, True)
            amax = tl.maximum(amax, tl.where(mask, tl.abs(y), 0.0))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
        for start in range(0, n_cols, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            mask = cols < n_cols
            x = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
            y = gelu_rounded(x, TANH, ROUND_BF16, ROUND_F16, True)
            q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
            tl.store(q_ptr + row * stride_q + cols, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _gelu_piece(h_row, start, n_cols, SIZE: tl.constexpr, TANH: tl.constexpr, ROUND_BF16: tl.constexpr,
                    ROUND_F16: tl.constexpr, GELU: tl.constexpr):
        cols = start + tl.arange(0, SIZE)
        x = tl.load(h_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        return gelu_rounded(x, TANH, ROUND_BF16, ROUND_F16, GELU)  # gelu(0) = 0: masked lanes add nothing to amax

    @triton.jit
    def _store_piece(q_row, y, start, n_cols, scale, SIZE: tl.constexpr):
        cols = start + tl.arange(0, SIZE)
        q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
        tl.store(q_row + cols, q.to(tl.float8e4nv), mask=cols < n_cols)

    @triton.jit
    def gelu_quant_rows_pieces(h_ptr, q_ptr, s_ptr, n_cols, stride_h, stride_q, P1: tl.constexpr, P2: tl.constexpr,
                               P3: tl.constexpr, P4: tl.constexpr, TANH: tl.constexpr, ROUND_BF16: tl.constexpr,
                               ROUND_F16: tl.constexpr, GELU: tl.constexpr):
        # the row as up to four power-of-two pieces in registers (P2..P4 may be 0: absent), read once
        row = tl.program_id(0).to(tl.int64)
        h_row = h_ptr + row * stride_h
        q_row = q_ptr + row * stride_q
        y1 = _gelu_piece(h_row, 0, n_cols, P1, TANH, ROUND_BF16, ROUND_F16, GELU)
        amax = tl.max(tl.abs(y1), axis=0)
        if P2 > 0:
            y2 = _gelu_piece(h_row, P1, n_cols, P2, TANH, ROUND_BF16, ROUND_F16, GELU)
            amax = tl.maximum(amax, tl.max(tl.abs(y2), axis=0))
        if P3 > 0:
            y3 = _gelu_piece(h_row, P1 + P2, n_cols, P3, TANH, ROUND_BF16, ROUND_F16, GELU)
            amax = tl.maximum(amax, tl.max(tl.abs(y3), axis=0))
        if P4 > 0:
            y4 = _gelu_piece(h_row, P1 + P2 + P3, n_cols, P4, TANH, ROUND_BF16, ROUND_F16, GELU)
            amax = tl.maximum(amax, tl.max(tl.abs(y4), axis=0))
        scale = tl.maximum(amax, 1e-12) / 448.0
        _store_piece(q_row, y1, 0, n_cols, scale, P1)
        if P2 > 0:
            _store_piece(q_row, y2, P1, n_cols, scale, P2)
        if P3 > 0:
            _store_piece(q_row, y3, P1 + P2, n_cols, scale, P3)
        if P4 > 0:
            _store_piece(q_row, y4, P1 + P2 + P3, n_cols, scale, P4)
        tl.store(s_ptr + row, scale)

    _KERNEL, _KERNEL_CHUNKED, _KERNEL_PIECES = gelu_quant_rows, gelu_quant_rows_chunked, gelu_quant_rows_pieces
else:
    _KERNEL = _KERNEL_CHUNKED = _KERNEL_PIECES = None

#: the smallest piece :func:`pieces` makes (a narrower remainder is padded up to it)
MIN_PIECE = 64


def pieces(n: int) -> tuple[int, int, int, int]:
    """Up to four powers of two (0: absent), largest first, whose sum covers ``n`` columns with little
    padding: the top binary digits of ``n``, the last piece rounded up (8,960 → 8,192 + 512 + 256;
    13,824 → 8,192 + 4,096 + 1,024 + 512; 100 → 64 + 64)."""
    if n < 1:
        raise ValueError(f"a row needs at least one column, not {n}")
    out: list[int] = []
    rest = n
    while rest > 0 and len(out) < 3:
        p = 1 << (rest.bit_length() - 1)
        if p < MIN_PIECE:
            break
        out.append(p)
        rest -= p
    if rest > 0:
        out.append(max(MIN_PIECE, 1 << (rest - 1).bit_length()))
    return tuple(out + [0] * (4 - len(out)))  # type: ignore[return-value]


def default_warps(block: int) -> int:
    """The ``num_warps`` of the padded (``pow2``) and chunked layouts for ``block`` columns in one program."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


#: the ``num_warps`` of the default layout (the row as :func:`pieces`): the fastest of 2/4/8/16/32 on the
#: H200 at both Wan widths (bench/quant_kernels.py, two runs on 2026-12-05: 1.3B 0.724 / 0.435–0.463 /
#: 0.472–0.474 / 0.561–0.622 / 0.736 ms, the padded layout at 16 warps 0.733–0.759; 14B 1.128 /
#: 0.730–0.761 / 0.761–0.797 / 0.838–0.884 / 0.944 ms, padded 0.728–0.759 — within the runs' spread)
PIECES_WARPS = 4


def _launch(h: torch.Tensor, tanh: bool, num_warps: int = 0, chunk: int = 0,
            pow2: bool = False, gelu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = h.shape
    q = torch.empty((m, n), device=h.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty((m, 1), device=h.device, dtype=torch.float32)
    rounding = {"TANH": tanh, "ROUND_BF16": h.dtype == torch.bfloat16, "ROUND_F16": h.dtype == torch.float16}
    if not gelu:  # quantize_rows: the row as it is, in pieces
        p1, p2, p3, p4 = pieces(n)
        _KERNEL_PIECES[(m,)](h, q, scale, n, h.stride(0), q.stride(0), P1=p1, P2=p2, P3=p3, P4=p4, **rounding,
                             GELU=False, num_warps=num_warps or PIECES_WARPS)
    elif chunk:
        _KERNEL_CHUNKED[(m,)](h, q, scale, n, h.stride(0), q.stride(0), CHUNK=chunk, **rounding,
                              num_warps=num_warps or default_warps(chunk))
    elif not pow2:
        p1, p2, p3, p4 = pieces(n)
        _KERNEL_PIECES[(m,)](h, q, scale, n, h.stride(0), q.stride(0), P1=p1, P2=p2, P3=p3, P4=p4, **rounding,
                             GELU=True, num_warps=num_warps or PIECES_WARPS)
    else:
        block = max(16, 1 << max(0, (n - 1).bit_length()))
        _KERNEL[(m,)](h, q, scale, n, h.stride(0), q.stride(0), BLOCK=block, **rounding,
                      num_warps=num_warps or default_warps(block))
    return q, scale


#: the kernel as an opaque torch operator (``torch.ops.omniloop_quant.gelu_quantize_rows``, with its
#: shapes declared): ``torch.compile(fullgraph=True)`` calls it without tracing into the launch (a
#: Triton launch traced by dynamo breaks on Triton's internals in some Triton versions); None where
#: Triton is missing. ``num_warps`` / ``chunk`` 0: the defaults (whole row in one pass, warps by width)
_OP: Any = None
if _TRITON:

    @torch.library.custom_op("omniloop_quant::gelu_quantize_rows", mutates_args=())
    def _gelu_quantize_rows_op(h: torch.Tensor, tanh: bool, num_warps: int = 0, chunk: int = 0,
                               pow2: bool = False, gelu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch(h, tanh, num_warps, chunk, pow2, gelu)

    @_gelu_quantize_rows_op.register_fake
    def _(h: torch.Tensor, tanh: bool, num_warps: int = 0, chunk: int = 0,
          pow2: bool = False, gelu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        m, n = h.shape
        return h.new_empty((m, n), dtype=torch.float8_e4m3fn), h.new_empty((m, 1), dtype=torch.float32)

    _OP = _gelu_quantize_rows_op


def prepare() -> None:
    """Nothing left to do: the kernel is built at import (kept for callers of the 0.3 API)."""


def gelu_quantize_rows(h: torch.Tensor, approximate: str, *, num_warps: int = 0, chunk: int = 0,
                       pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, N] e4m3, scale [M, 1] float32)`` of ``gelu(h, approximate)`` for a 2-D ``h`` (check
    :func:`supported`): what ``quantize_rows(gelu(h))`` computes, in one pass over ``h``.

    Launch variants, for tuning (``bench/quant_kernels.py``; the defaults are what the FP8
    feed-forward uses): ``num_warps`` (0: :data:`PIECES_WARPS`, or by width for ``pow2`` / ``chunk``:
    :func:`default_warps`); ``chunk`` (0: the whole
    row in registers, read once, as :func:`pieces`; a power of two ≥ 16: the row in ``chunk``-wide
    pieces, read twice); ``pow2`` (with ``chunk`` 0: the whole row as one block padded to a power of
    two — the first form of the kernel). Every variant computes the same values."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', not {approximate!r}")
    if num_warps not in (0, 1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be 0 (default) or a power of two up to 32, not {num_warps!r}")
    if chunk and (chunk < 16 or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be 0 (whole row) or a power of two >= 16, not {chunk!r}")
    if chunk and pow2:
        raise ValueError("pow2 is a layout of the whole-row kernel: it does not go with chunk")
    if _OP is None:
        raise RuntimeError("gelu_quantize_rows needs triton (check supported() first)")
    return _OP(h, approximate == "tanh", num_warps, chunk, pow2)


def quantize_rows(h: torch.Tensor, *, num_warps: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, N] e4m3, scale [M, 1] float32)`` of a 2-D ``h`` (check :func:`supported`): what
    :func:`omniloop_quant.fp8.quantize_rows` computes, as the GELU kernel's pieces layout without the
    GELU — for rows an opaque kernel produced (an attention output), which inductor cannot fuse
    into their producer and quantises with a looped row reduction instead."""
    if num_warps not in (0, 1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be 0 (default) or a power of two up to 32, not {num_warps!r}")
    if _OP is None:
        raise RuntimeError("quantize_rows needs triton (check supported() first)")
    return _OP(h, False, num_warps, 0, False, False)


def reference(h: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch computation :func:`gelu_quantize_rows` fuses (any device)."""
    y = torch.nn.functional.gelu(h, approximate=approximate).float()
    scale = y.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY_AMAX) / E4M3_MAX
    return (y / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


__all__ = ["E4M3_MAX", "MAX_ROW", "MIN_PIECE", "PIECES_WARPS", "default_warps", "gelu_quantize_rows", "pieces", "prepare", "quantize_rows", "reference", "supported", "triton_available"]
