"""Triton kernel: residual add + LayerNorm + modulation + per-row e4m3, in one pass (CUDA only).

What a Wan block computes in front of its FP8 GEMMs (diffusers' ``WanTransformerBlock.forward``;
``h`` the bf16 residual stream, the vectors float32 per batch element):

* before self-attention's Q/K/V: ``n = (norm1(h.float()) * (1 + scale) + shift).type_as(h)``;
* before cross-attention's Q: ``h = (h.float() + attn * gate).type_as(h)``, then
  ``n = norm2(h.float()).type_as(h)`` (``norm2`` has a weight and a bias);
* before the FFN: ``h = h + attn`` (in bf16), then ``n = (norm3(h.float()) * (1 + c_scale) + c_shift).type_as(h)``;

each followed by the per-row quantisation of ``n`` the FP8 GEMM needs
(:func:`omniloop_quant.fp8.quantize_rows`). :func:`residual_norm_quantize_rows` does any of the three
in one pass: one program owns one row, held in registers as two power-of-two pieces (1,536 = 1,024 +
512; 5,120 = 4,096 + 1,024), reads ``h`` (and the delta) once and writes the new residual (when there
is a delta), the e4m3 row and its scale. :func:`reference` is the same computation in torch ops.

**Used by** the Wan family's ``options.norm_quant: fused`` (:mod:`omniloop_wan.blocks`, which hands the rows to
``FP8Linear.forward_quantized`` / ``FP8FeedForward.forward_quantized``). In one Wan 1.3B FP8 forward on the H200,
inductor's fusions of these computations take 28.4 ms (0.10–0.24 ms a call where the bytes need
0.03–0.07 ms; ``bench/results/wan_gpu-1.3b-fwd-fp8-pieces-profile-h200-2026-12-05.json``).
``bench/quant_kernels.py`` times this kernel against them on Wan's shapes: on an H100 a block's three
sites take 0.80 ms instead of inductor's 0.99 at 1.3B, 1.73 instead of 3.45 at 14B
(``bench/results/quant_kernels-norm-h100-2026-12-05.json``); wired, the whole FP8 step gains 1.8 % at 1.3B and
1.4 % at 14B on an H100 (bench/README.md, "Session 19"). Numerics: the mean and variance are summed per row in float32 (torch's LayerNorm uses
Welford's update), products may be fused (FMA): the values equal torch's up to float32 rounding
before the rounding to bf16.
"""

from __future__ import annotations

from typing import Any

import torch

from .kernels import _TRITON, E4M3_MAX

_TINY_AMAX = 1e-12
#: the widest row the kernel takes (two pieces of at most 8,192 each)
MAX_ROW = 16384
#: the narrowest row (and the GEMM's alignment: FP8 linears need multiples of 16)
MIN_ROW = 64


def two_pieces(n: int) -> tuple[int, int]:
    """``(P1, P2)``: the largest power of two ≤ ``n`` and the power of two covering the rest (0: none)."""
    if n < 1:
        raise ValueError(f"a row needs at least one column, not {n}")
    p1 = 1 << (n.bit_length() - 1)
    rest = n - p1
    return p1, (1 << (rest - 1).bit_length()) if rest else 0


def supported(x: torch.Tensor) -> bool:
    """Whether :func:`residual_norm_quantize_rows` takes ``x`` (a contiguous CUDA bf16 ``[B, L, N]``)."""
    return (_TRITON and x.is_cuda and x.dim() == 3 and x.is_contiguous() and x.dtype == torch.bfloat16
            and MIN_ROW <= x.shape[-1] <= MAX_ROW and x.shape[-1] % 16 == 0)


if _TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _residual_piece(x_row, d_row, g_vec, start, n, SIZE: tl.constexpr, HAS_DELTA: tl.constexpr,
                        HAS_GATE: tl.constexpr):
        # the row's piece of the residual stream after the add, as stored (bf16), in float32
        cols = start + tl.arange(0, SIZE)
        mask = cols < n
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            d = tl.load(d_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_GATE:
                x = x + d * tl.load(g_vec + cols, mask=mask, other=0.0)
            else:
                x = x + d
            x = x.to(tl.bfloat16).to(tl.float32)
        return x

    @triton.jit
    def _normed_piece(x, mean, rstd, w_ptr, b_ptr, sc_vec, sh_vec, start, n, SIZE: tl.constexpr,
                      AFFINE: tl.constexpr, MODULATE: tl.constexpr):
        cols = start + tl.arange(0, SIZE)
        mask = cols < n
        y = (x - mean) * rstd
        if AFFINE:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0) + tl.load(b_ptr + cols, mask=mask, other=0.0)
        if MODULATE:
            y = y * (1.0 + tl.load(sc_vec + cols, mask=mask, other=0.0)) + tl.load(sh_vec + cols, mask=mask, other=0.0)
        y = y.to(tl.bfloat16).to(tl.float32)  # .type_as(h)
        return tl.where(mask, y, 0.0)

    @triton.jit
    def _store_piece(q_row, r_row, x, y, scale, start, n, SIZE: tl.constexpr, HAS_DELTA: tl.constexpr):
        cols = start + tl.arange(0, SIZE)
        mask = cols < n
        q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
        tl.store(q_row + cols, q.to(tl.float8e4nv), mask=mask)
        if HAS_DELTA:
            tl.store(r_row + cols, x.to(tl.bfloat16), mask=mask)

    @triton.jit
    def residual_norm_quant_rows(x_ptr, d_ptr, r_ptr, g_ptr, w_ptr, b_ptr, sc_ptr, sh_ptr, q_ptr, s_ptr, n,
                                 rows_per_vector, eps, P1: tl.constexpr, P2: tl.constexpr,
                                 HAS_DELTA: tl.constexpr, HAS_GATE: tl.constexpr, AFFINE: tl.constexpr,
                                 MODULATE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        off = row * n
        vec = (row // rows_per_vector) * n
        x1 = _residual_piece(x_ptr + off, d_ptr + off, g_ptr + vec, 0, n, P1, HAS_DELTA, HAS_GATE)
        total = tl.sum(x1, axis=0)  # masked lanes hold 0
        if P2 > 0:
            x2 = _residual_piece(x_ptr + off, d_ptr + off, g_ptr + vec, P1, n, P2, HAS_DELTA, HAS_GATE)
            total += tl.sum(x2, axis=0)
        mean = total / n
        c1 = x1 - mean  # P1 <= n: the first piece has no masked lanes
        var = tl.sum(c1 * c1, axis=0)
        if P2 > 0:
            c2 = tl.where(P1 + tl.arange(0, P2) < n, x2 - mean, 0.0)
            var += tl.sum(c2 * c2, axis=0)
        rstd = 1.0 / tl.sqrt(var / n + eps)
        y1 = _normed_piece(x1, mean, rstd, w_ptr, b_ptr, sc_ptr + vec, sh_ptr + vec, 0, n, P1, AFFINE, MODULATE)
        amax = tl.max(tl.abs(y1), axis=0)
        if P2 > 0:
            y2 = _normed_piece(x2, mean, rstd, w_ptr, b_ptr, sc_ptr + vec, sh_ptr + vec, P1, n, P2, AFFINE, MODULATE)
            amax = tl.maximum(amax, tl.max(tl.abs(y2), axis=0))
        scale = tl.maximum(amax, 1e-12) / 448.0
        _store_piece(q_ptr + off, r_ptr + off, x1, y1, scale, 0, n, P1, HAS_DELTA)
        if P2 > 0:
            _store_piece(q_ptr + off, r_ptr + off, x2, y2, scale, P1, n, P2, HAS_DELTA)
        tl.store(s_ptr + row, scale)

    _KERNEL: Any = residual_norm_quant_rows
else:
    _KERNEL = None


def _vectors(v: torch.Tensor | None, b: int, n: int, name: str) -> torch.Tensor | None:
    """A per-batch-element vector (``[B, 1, N]``, ``[B, N]`` or ``[N]``) as a contiguous float32 ``[B, N]``."""
    if v is None:
        return None
    if v.numel() not in (n, b * n):
        raise ValueError(f"{name}: {tuple(v.shape)} is neither one vector of {n} nor one per batch element ({b})")
    return v.float().reshape(-1, n).expand(b, n).contiguous()


def _launch(x: torch.Tensor, delta: torch.Tensor | None, gate: torch.Tensor | None, weight: torch.Tensor | None,
            bias: torch.Tensor | None, scale: torch.Tensor | None, shift: torch.Tensor | None, eps: float,
            num_warps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, length, n = x.shape
    q = torch.empty((b * length, n), device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((b * length, 1), device=x.device, dtype=torch.float32)
    r = torch.empty_like(x) if delta is not None else x.new_empty(0)
    p1, p2 = two_pieces(n)
    dummy = s  # pointers the kernel never reads (their flags are off)
    _KERNEL[(b * length,)](
        x, delta if delta is not None else x, r if delta is not None else x, gate if gate is not None else dummy,
        weight if weight is not None else dummy, bias if bias is not None else dummy,
        scale if scale is not None else dummy, shift if shift is not None else dummy, q, s, n, length, eps,
        P1=p1, P2=p2, HAS_DELTA=delta is not None, HAS_GATE=gate is not None, AFFINE=weight is not None,
        MODULATE=scale is not None, num_warps=num_warps or 4)
    return r, q, s


_OP: Any = None
if _TRITON:

    @torch.library.custom_op("omniloop_quant::residual_norm_quantize_rows", mutates_args=())
    def _op(x: torch.Tensor, delta: torch.Tensor | None, gate: torch.Tensor | None, weight: torch.Tensor | None,
            bias: torch.Tensor | None, scale: torch.Tensor | None, shift: torch.Tensor | None, eps: float,
            num_warps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _launch(x, delta, gate, weight, bias, scale, shift, eps, num_warps)

    @_op.register_fake
    def _(x, delta, gate, weight, bias, scale, shift, eps, num_warps):  # type: ignore[no-untyped-def]
        b, length, n = x.shape
        r = torch.empty_like(x) if delta is not None else x.new_empty(0)
        return r, x.new_empty((b * length, n), dtype=torch.float8_e4m3fn), x.new_empty((b * length, 1), dtype=torch.float32)

    _OP = _op


def residual_norm_quantize_rows(
    x: torch.Tensor, *, eps: float, delta: torch.Tensor | None = None, gate: torch.Tensor | None = None,
    weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None, num_warps: int = 0,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(residual or None, q [B*L, N] e4m3, scale [B*L, 1] float32)`` for ``x`` ``[B, L, N]`` bf16
    (check :func:`supported`), computing what :func:`reference` computes (see the module docstring).

    ``delta`` (``[B, L, N]`` bf16): added to ``x`` first — times ``gate`` in float32 when given, else in
    bf16 — and the sum returned as the new residual; ``weight`` / ``bias`` (``[N]``): the LayerNorm's
    affine; ``scale`` / ``shift``: the modulation ``n * (1 + scale) + shift``. ``gate``, ``scale`` and
    ``shift`` are one float32 vector per batch element (``[B, 1, N]`` as Wan's blocks have them)."""
    if (scale is None) != (shift is None):
        raise ValueError("scale and shift come together (the modulation n * (1 + scale) + shift)")
    if gate is not None and delta is None:
        raise ValueError("gate scales the delta: pass delta with it")
    if (weight is None) != (bias is None):
        raise ValueError("weight and bias come together (the LayerNorm's affine)")
    if not (eps > 0 and eps == eps and eps != float("inf")):
        raise ValueError(f"eps must be a finite positive number, not {eps!r}")
    if _OP is None:
        raise RuntimeError("residual_norm_quantize_rows needs triton (check supported() first)")
    b, _length, n = x.shape
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"delta: {tuple(delta.shape)} is not x's shape {tuple(x.shape)}")
    vec = {k: _vectors(v, b, n, k) for k, v in (("gate", gate), ("scale", scale), ("shift", shift))}
    w = None if weight is None else weight.float().reshape(n).contiguous()
    bi = None if bias is None else bias.float().reshape(n).contiguous()
    r, q, s = _OP(x, None if delta is None else delta.contiguous(), vec["gate"], w, bi, vec["scale"], vec["shift"],
                  float(eps), int(num_warps))
    return (r if delta is not None else None), q, s


def reference(x: torch.Tensor, *, eps: float, delta: torch.Tensor | None = None, gate: torch.Tensor | None = None,
              weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
              shift: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The torch ops :func:`residual_norm_quantize_rows` fuses, written as diffusers' Wan block writes them
    (any device; the vectors broadcast as ``[B, 1, N]``)."""
    n = x.shape[-1]

    def per_batch(v: torch.Tensor | None) -> torch.Tensor | None:
        return None if v is None else v.float().reshape(-1, 1, n)

    gate, scale, shift = per_batch(gate), per_batch(scale), per_batch(shift)
    r = x
    if delta is not None:
        r = (x.float() + delta * gate).type_as(x) if gate is not None else x + delta
    y = torch.nn.functional.layer_norm(r.float(), (n,), None if weight is None else weight.float(),
                                       None if bias is None else bias.float(), eps)
    if scale is not None:
        y = y * (1 + scale) + shift
    y = y.type_as(x).reshape(-1, n).float()
    s = y.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY_AMAX) / E4M3_MAX
    q = (y / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (r if delta is not None else None), q, s


__all__ = ["MAX_ROW", "MIN_ROW", "reference", "residual_norm_quantize_rows", "supported", "two_pieces"]
