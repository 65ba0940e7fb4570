"""Fused QK RMS-norm + rotary embedding for Wan self-attention (one Triton kernel, CUDA only).

Wan normalizes the query and key projections with an RMS norm *across all heads*
(``qk_norm="rms_norm_across_heads"``: one mean square over ``heads * head_dim`` channels) and then
rotates interleaved channel pairs ``(2i, 2i+1)`` of every head by the token's angle. Eager
PyTorch runs this as a handful of kernels; ``torch.compile`` fuses it into one, but on the H200
that kernel ran at about a fifth of memory bandwidth (0.43 ms per 1.3B block for 400 MB of
traffic; ``bench/results/wan_gpu-forward-profile-h200-2026-11-29.json``). :func:`qk_norm_rope`
does the same math in one pass per row: load the row once, reduce, scale, rotate, store.

Numerics: everything is computed in float32 and rounded once to the input dtype. Eager PyTorch
rounds the normed activations to the input dtype before rotating, so the result is not bit-equal
to diffusers in bfloat16 (relative RMS difference ~1e-3 in bf16, ~1e-7 in float32; the tests
say the tolerance). The kernel is opt-in (``options.qk_norm_rope: fused``); the reference path stays the
default and bit-equal to diffusers.

FP8: :func:`qk_norm_rope_fp8` writes the result straight to e4m3 with a static per-tensor scale
(:func:`fp8_descale`), so an FP8 attention backend that takes quantised q/k (``cudnn-fp8``,
``fa3-fp8``) gets them with no extra pass over them (``omniloop_wan.attention``). Without freqs the
kernel is the norm alone: with ``omniloop_wan.attention.FUSE_FP8_CROSS_QUANT`` (on by default since
session 21's H100 measurement) cross-attention's q (the 32k-token video) and k (the text) go the same way, instead
of the backend's amax pass and quantising pass over the normed query (at Wan 14B on an H100 those
took ~0.75 ms of every block's cross-attention).

The kernel is a plain ``@triton.jit`` function called from Python: ``torch.compile`` captures a
user Triton kernel into its graph (no graph break), so the compiled blocks keep ``fullgraph=True``.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch

from omniloop_kit.kernels import LazyKernel

#: values of ``options.qk_norm_rope``
MODES = ("reference", "fused")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def unavailable_reason(device: str | torch.device | None) -> str | None:
    """Why the fused kernel cannot run for ``device`` (None when it can)."""
    if device is None or torch.device(device).type != "cuda":
        return f"it needs a CUDA device (deploy device is {str(device)!r})"
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    if not triton_available():
        return "the 'triton' package is not installed"
    return None


def prepare() -> None:
    """Define the Triton kernel now, outside any ``torch.compile`` trace (:mod:`omniloop_kit.kernels`).
    Called at install."""
    KERNEL.get()


def _define() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def qk_norm_rope_kernel(
        x_ptr, out_ptr, w_ptr, cos_ptr, sin_ptr, scale_ptr,
        x_row_stride, seq_len, eps,
        C: tl.constexpr, HALF_D: tl.constexpr, BLOCK: tl.constexpr, SCALED: tl.constexpr, ROPE: tl.constexpr,
    ):
        row = tl.program_id(0)  # one token of one video: rows are (batch, position)
        pos = row % seq_len
        p = tl.arange(0, BLOCK)  # channel pair index over all heads
        mask = p < C // 2
        x_row = x_ptr + row * x_row_stride
        xe = tl.load(x_row + 2 * p, mask=mask, other=0.0).to(tl.float32)
        xo = tl.load(x_row + 2 * p + 1, mask=mask, other=0.0).to(tl.float32)
        ms = (tl.sum(xe * xe, axis=0) + tl.sum(xo * xo, axis=0)) / C
        r = 1.0 / tl.sqrt(ms + eps)
        we = tl.load(w_ptr + 2 * p, mask=mask, other=0.0).to(tl.float32)
        wo = tl.load(w_ptr + 2 * p + 1, mask=mask, other=0.0).to(tl.float32)
        ne = xe * r * we
        no = xo * r * wo
        if ROPE:
            j = p % HALF_D  # the pair's index inside its head: its rotation angle
            f_row = pos * (2 * HALF_D)
            c = tl.load(cos_ptr + f_row + 2 * j, mask=mask, other=1.0).to(tl.float32)  # cos[..., 0::2]
            s = tl.load(sin_ptr + f_row + 2 * j + 1, mask=mask, other=0.0).to(tl.float32)  # sin[..., 1::2]
            oe = ne * c - no * s
            oo = ne * s + no * c
        else:  # the norm alone (cross-attention's q and k)
            oe = ne
            oo = no
        if SCALED:  # FP8 output: x * scale, rounded once (round-to-nearest, saturating on sm90)
            sc = tl.load(scale_ptr).to(tl.float32)
            oe = tl.minimum(tl.maximum(oe * sc, -448.0), 448.0)
            oo = tl.minimum(tl.maximum(oo * sc, -448.0), 448.0)
        out_row = out_ptr + row * C
        tl.store(out_row + 2 * p, oe.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_row + 2 * p + 1, oo.to(out_ptr.dtype.element_ty), mask=mask)

    return qk_norm_rope_kernel


#: the kernel, defined on first use
KERNEL = LazyKernel(_define)


def supported(x: torch.Tensor, norm: Any, freqs_cos: torch.Tensor | None, heads: int) -> bool:
    """Whether :func:`qk_norm_rope` handles this call (else the caller takes the reference path);
    ``freqs_cos`` None: the norm alone (no rotation)."""
    if not (x.is_cuda and x.dim() == 3 and x.stride(-1) == 1 and x.stride(0) == x.shape[1] * x.stride(1)):
        return False
    if not isinstance(norm, torch.nn.RMSNorm) or norm.weight is None:
        return False
    if tuple(norm.normalized_shape) != (x.shape[-1],) or x.shape[-1] % heads:
        return False
    head_dim = x.shape[-1] // heads
    if freqs_cos is None:
        return head_dim % 2 == 0
    return (freqs_cos.dim() == 4 and freqs_cos.shape[0] == 1 and freqs_cos.shape[1] == x.shape[1]
            and freqs_cos.shape[2] == 1 and freqs_cos.shape[3] == head_dim and head_dim % 2 == 0)


def _cos_sin(freqs_cos: torch.Tensor | None, freqs_sin: torch.Tensor | None, L: int, head_dim: int,
             x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The kernel's ``[L, head_dim]`` cos/sin tables and its ROPE flag (no tables: placeholders, unread)."""
    if freqs_cos is None or freqs_sin is None:
        return x, x, False
    return freqs_cos.reshape(L, head_dim).contiguous(), freqs_sin.reshape(L, head_dim).contiguous(), True


def qk_norm_rope(x: torch.Tensor, norm: torch.nn.RMSNorm, freqs_cos: torch.Tensor | None,
                 freqs_sin: torch.Tensor | None, heads: int, *, out_scale: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``rotary(norm(x))`` for ``x`` ``[B, L, heads*D]`` → ``[B, L, heads, D]`` (check :func:`supported`);
    ``freqs_cos``/``freqs_sin`` None: ``norm(x)`` (cross-attention's q and k).

    With ``out_scale`` (a one-element float32 CUDA tensor) the kernel writes ``rotary(norm(x)) *
    out_scale`` in ``out_dtype`` (e.g. ``torch.float8_e4m3fn``) instead."""
    B, L, C = x.shape
    head_dim = C // heads
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    cos, sin, rope = _cos_sin(freqs_cos, freqs_sin, L, head_dim, x)
    out = torch.empty((B, L, C), device=x.device, dtype=x.dtype if out_scale is None else out_dtype)
    block = 1 << max(0, (C // 2 - 1).bit_length())
    warps = 4 if block <= 1024 else 8
    kernel = KERNEL.get()
    scale = norm.weight if out_scale is None else out_scale  # unread when not SCALED
    kernel[(B * L,)](x, out, norm.weight, cos, sin, scale, x.stride(1), L, float(eps),
                     C=C, HALF_D=head_dim // 2, BLOCK=block, SCALED=out_scale is not None, ROPE=rope,
                     num_warps=warps)
    return out.unflatten(2, (heads, head_dim))


def fp8_descale(norm: torch.nn.RMSNorm, channels: int) -> torch.Tensor:
    """A static per-tensor FP8 descale for ``rotary(norm(x))`` or ``norm(x)`` (float32 ``[1, 1, 1, 1]``).

    After the RMS norm over ``channels`` no element exceeds ``sqrt(channels) * max|w|`` (a
    single channel can hold at most the whole mean square), and a rotation keeps each pair's
    norm, so that bound maps to 448 and nothing saturates — with no amax pass over the
    activations. e4m3 is floating point: typical values (~``|w|``) land near
    ``448 / sqrt(channels)`` (~11 for 1,536 channels), well inside its normal range; only
    values ~700x below typical become subnormal. ``bench/attention_fp8_quality.py`` compares
    this scale with amax-derived ones on captured activations."""
    bound = norm.weight.detach().abs().amax().float() * math.sqrt(channels)
    return (bound.clamp_min(1e-12) / 448.0).reshape(1, 1, 1, 1)


@torch.library.custom_op("omniloop_wan::qk_norm_rope_e4m3", mutates_args=())
def _qk_norm_rope_e4m3(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       scale: torch.Tensor, heads: int, eps: float, rope: bool) -> torch.Tensor:
    # An opaque op for torch.compile: inductor's own compile of the user kernel's FP8-store
    # variant failed in Triton's LLVM lowering on the H200 (torch 2.11, 2026-11-30), while the
    # same kernel launched eagerly compiles and runs; as a custom op it is always launched eagerly.
    B, L, C = x.shape
    out = torch.empty((B, L, C), device=x.device, dtype=torch.float8_e4m3fn)
    block = 1 << max(0, (C // 2 - 1).bit_length())
    kernel = KERNEL.get()
    kernel[(B * L,)](x, out, weight, cos, sin, scale, x.stride(1), L, eps,
                     C=C, HALF_D=C // heads // 2, BLOCK=block, SCALED=True, ROPE=rope,
                     num_warps=4 if block <= 1024 else 8)
    return out


@_qk_norm_rope_e4m3.register_fake
def _qk_norm_rope_e4m3_fake(x, weight, cos, sin, scale, heads, eps, rope):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn)


def qk_norm_rope_fp8(x: torch.Tensor, norm: torch.nn.RMSNorm, freqs_cos: torch.Tensor | None,
                     freqs_sin: torch.Tensor | None, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`qk_norm_rope` written straight to e4m3: ``(x8 [B, L, heads, D], descale)`` with
    ``rotary(norm(x)) ≈ x8 * descale`` (scale from :func:`fp8_descale`). One pass, no amax.
    ``freqs_cos``/``freqs_sin`` None: ``norm(x) ≈ x8 * descale`` (cross-attention's q and k)."""
    _, L, C = x.shape
    head_dim = C // heads
    descale = fp8_descale(norm, C)
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    cos, sin, rope = _cos_sin(freqs_cos, freqs_sin, L, head_dim, x)
    x8 = torch.ops.omniloop_wan.qk_norm_rope_e4m3(x, norm.weight, cos, sin, (1.0 / descale).contiguous(), heads,
                                                  float(eps), rope)
    return x8.unflatten(2, (heads, head_dim)), descale


def reference(x: torch.Tensor, norm: torch.nn.Module, freqs_cos: torch.Tensor | None,
              freqs_sin: torch.Tensor | None, heads: int) -> torch.Tensor:
    """The eager math (diffusers' ``WanAttnProcessor``), for tests; no freqs: the norm alone."""
    from .attention import apply_rotary_emb

    if freqs_cos is None or freqs_sin is None:
        return norm(x).unflatten(2, (heads, -1))
    return apply_rotary_emb(norm(x).unflatten(2, (heads, -1)), freqs_cos, freqs_sin)


__all__ = ["MODES", "fp8_descale", "prepare", "qk_norm_rope", "qk_norm_rope_fp8", "reference", "supported", "triton_available", "unavailable_reason"]
