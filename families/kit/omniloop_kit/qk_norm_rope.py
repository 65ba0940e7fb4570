"""Per-head q/k RMS norm + rotary embedding over a joint sequence, one Triton kernel per tensor.

Joint (MMDiT) attention — FLUX.1's double-stream blocks — normalises the image and the context
queries with their own per-head RMS norms (``norm_q`` / ``norm_added_q``, over ``head_dim``),
concatenates the two parts along the sequence and rotates interleaved channel pairs
``(2i, 2i+1)`` of every head by the token's angle (diffusers' ``apply_rotary_emb`` with
``use_real_unbind_dim=-1``); a single-stream block does the same with one part. Compiled, inductor
turns this into one reduction kernel per tensor, which on an H100 ran at about a third of memory
bandwidth at FLUX.1-dev 1024² (``triton_red_fused__fused_rms_norm_…``, 0.12 ms per single block for
~120 MB of traffic; ``bench/results/flux_gpu-fa3-gelu-mod-call1-h100-s19-2026-12-06.json``).
:func:`joint_norm_rope` reads each token's heads once from the projections' output (any token
stride: a chunk of a fused Q/K/V GEMM needs no copy), normalises, rotates and writes the joint
``[B, L, H, D]`` tensor the attention backend takes, the concatenation included. One program takes
whole heads of one token with contiguous loads (a channel's rotation partner comes from the same
cache lines): 2.0 TB/s on an H100 at FLUX.1-dev's shapes, 1.9–3.2x inductor's kernels, and the
compiled FLUX step 1.2 % faster (``bench/qk_norm_rope_gpu.py``, bench/README "Session 22"). A first
version that loaded channel pairs with stride-2 loads over a padded 32-head tile ran 14x off
bandwidth there: keep loads contiguous. A third put the query and the key in one launch by
reassigning the kernel's arguments under ``if tl.program_id(2) == 1``: the loads lost their
vectorisation and inductor's analysis of the kernel failed on the reassigned eps — one launch per
tensor, and no argument reassigned inside the kernel.

Numerics follow the eager ops: the mean square and the scaling in float32, the normed value rounded
to the input dtype (as ``torch.nn.RMSNorm`` returns it), the rotation in float32 on that value, one
rounding to the input dtype. What can differ from eager is the order of the mean's sum and the
fused multiply-adds Triton may form: half a bf16 ulp of the largest value on FLUX.1-dev's shapes
(the tests state the tolerances). Opt-in per family (FLUX.1's ``options.qk_norm_rope: fused``, CUDA with ``triton``);
:func:`supported` says when a call can take it, otherwise the caller keeps the reference ops.

The kernel is a plain ``@triton.jit`` function launched from Python: ``torch.compile`` captures a
user Triton kernel into its graph (no graph break), so compiled blocks keep ``fullgraph=True``.
Under ``TRITON_INTERPRET=1`` it also runs on CPU tensors (Triton's interpreter; the CPU tests).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

import torch

from omniloop.errors import DeployError

from .kernels import LazyKernel
from .options import choice_option

#: values of ``options.qk_norm_rope``
MODES = ("reference", "fused")

#: read once at import, so :func:`supported` stays plain attribute reads inside a compiled trace
TRITON = importlib.util.find_spec("triton") is not None
#: this process runs Triton's interpreter (it must be set before triton's first import anyway)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    return TRITON


def _interpreted() -> bool:
    return INTERPRETED


def unavailable_reason(device: str | torch.device | None) -> str | None:
    """Why the kernel cannot run for ``device`` (None when it can; a CPU device only under Triton's
    interpreter, ``TRITON_INTERPRET=1``)."""
    if not triton_available():
        return "the 'triton' package is not installed"
    if device is not None and torch.device(device).type == "cpu" and _interpreted():
        return None
    if device is None or torch.device(device).type != "cuda":
        return f"it needs a CUDA device (deploy device is {str(device)!r})"
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    return None


def qk_norm_rope_option(options: Any, device: Any) -> str:
    """``options.qk_norm_rope`` (:data:`MODES`), or one ``DeployError``: an unknown value, or ``fused``
    where the kernel cannot run."""
    mode = choice_option(options, "qk_norm_rope", MODES)
    if mode == "fused":
        why = unavailable_reason(device)
        if why:
            raise DeployError(f"options.qk_norm_rope: 'fused' cannot run: {why}; use qk_norm_rope 'reference'")
    return mode


def prepare() -> None:
    """Define the Triton kernel now, outside any ``torch.compile`` trace (:mod:`omniloop_kit.kernels`).
    Called when a family installs the option."""
    KERNEL.get()


def _define() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def joint_norm_rope_kernel(
        a_ptr, b_ptr, wa_ptr, wb_ptr, cos_ptr, sin_ptr, out_ptr,
        a_bstride, a_tstride, b_bstride, b_tstride, n_a, seq_len, eps_a, eps_b,
        H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
    ):
        row = tl.program_id(0)  # one token (batch-major) of the joint sequence: part a, then part b
        h0 = tl.program_id(1) * BLOCK_H  # this program's first head
        bi = (row // seq_len).to(tl.int64)
        pos = row % seq_len
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, D)[None, :]
        offs = h * D + d  # contiguous channels: whole heads, vectorised loads
        partner = h * D + (d ^ 1)  # the other channel of d's pair (the same cache lines)
        if pos < n_a:
            src = a_ptr + bi * a_bstride + pos.to(tl.int64) * a_tstride
            w_ptr = wa_ptr
            eps = eps_a
        else:
            src = b_ptr + bi * b_bstride + (pos - n_a).to(tl.int64) * b_tstride
            w_ptr = wb_ptr
            eps = eps_b
        x = tl.load(src + offs).to(tl.float32)
        if ROPE:
            xp = tl.load(src + partner).to(tl.float32)
        if NORM:
            r = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
            # rounded to the input dtype as the norm module returns it
            x = (x * r * tl.load(w_ptr + d).to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
            if ROPE:
                xp = (xp * r * tl.load(w_ptr + (d ^ 1)).to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
        if ROPE:
            # diffusers: x * cos + rotated(x) * sin, rotated(x)[2i] = -x[2i+1], rotated(x)[2i+1] = x[2i]
            f = pos.to(tl.int64) * D + d
            rotated = tl.where(d % 2 == 0, -xp, xp)
            x = x * tl.load(cos_ptr + f).to(tl.float32) + rotated * tl.load(sin_ptr + f).to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * (H * D) + offs, x.to(out_ptr.dtype.element_ty))

    return joint_norm_rope_kernel


#: the kernel, defined on first use
KERNEL = LazyKernel(_define)


def _part_ok(x: torch.Tensor, heads: int) -> bool:
    return x.dim() == 3 and x.stride(-1) == 1 and x.shape[-1] % heads == 0


def supported(parts: Sequence[torch.Tensor], norms: Sequence[Any], rotary: Any, heads: int) -> bool:
    """Whether :func:`joint_norm_rope` takes this call: one or two ``[B, L_i, heads*D]`` parts with
    channels contiguous (any token and batch stride), of one dtype and device (CUDA; CPU under
    Triton's interpreter), each with a ``torch.nn.RMSNorm(D)`` that has a weight on the parts' device
    in their dtype (or no norm at all for every part), ``D`` a power of two, and ``rotary`` None or diffusers' real ``(cos, sin)``
    pair of ``[sum L_i, D]``. Otherwise the caller runs the reference ops."""
    if not parts or len(parts) > 2 or len(norms) != len(parts):
        return False
    x0 = parts[0]
    if not (x0.is_cuda or (x0.device.type == "cpu" and INTERPRETED)) or not TRITON:
        return False
    if any(not _part_ok(x, heads) or x.dtype != x0.dtype or x.device != x0.device or x.shape[0] != x0.shape[0]
           or x.shape[-1] != x0.shape[-1] for x in parts):
        return False
    d = x0.shape[-1] // heads
    if d < 2 or d & (d - 1):
        return False
    if any(n is not None for n in norms) and not all(
            isinstance(n, torch.nn.RMSNorm) and n.weight is not None and tuple(n.normalized_shape) == (d,)
            and n.weight.device == x0.device and n.weight.dtype == x0.dtype for n in norms):
        return False  # (a weight elsewhere: offloaded, its module's hook moves it only when it runs)
    if rotary is None:
        return True
    if not (isinstance(rotary, (tuple, list)) and len(rotary) == 2):
        return False
    length = sum(x.shape[1] for x in parts)
    return all(isinstance(t, torch.Tensor) and t.shape == (length, d) and t.device == x0.device for t in rotary)


def _eps(norm: Any, dtype: torch.dtype) -> float:
    if norm is None:
        return 0.0
    return float(norm.eps) if norm.eps is not None else float(torch.finfo(dtype).eps)


def heads_per_program(heads: int, head_dim: int) -> int:
    """How many heads one program takes: the largest power of two dividing ``heads`` with at most
    512 elements (FLUX.1: 4 heads of 128, two warps, six programs per token: 2.0 TB/s on the H100,
    the best of ``bench/qk_norm_rope_gpu.py``'s launch settings there; 8 heads with four warps 1.7)."""
    n = 1
    while heads % (2 * n) == 0 and 2 * n * head_dim <= 512:
        n *= 2
    return n


def warps_for(block_h: int, head_dim: int) -> int:
    """The default warps of a program of ``block_h`` heads: one per 256 elements, 1 to 8."""
    return max(1, min(8, block_h * head_dim // 256))


def joint_norm_rope(parts: Sequence[torch.Tensor], norms: Sequence[Any], rotary: Any, heads: int, *,
                    block_h: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """``rotary(cat([norm_i(x_i) per head]))`` for parts ``x_i`` ``[B, L_i, heads*D]`` →
    ``[B, sum L_i, heads, D]`` contiguous (check :func:`supported`); ``norms`` all None: the
    concatenation and rotation alone; ``rotary`` None: no rotation (e.g. a value tensor's concatenation).
    ``block_h`` (heads per program, a power of two dividing ``heads``) and ``num_warps``: launch settings
    for benchmarks (default :func:`heads_per_program`, one warp per 256 elements)."""
    x0 = parts[0]
    xb = parts[-1]
    n_a = x0.shape[1] if len(parts) == 2 else 0
    na, nb = (norms[0], norms[-1])
    B, C = x0.shape[0], x0.shape[-1]
    d = C // heads
    length = sum(x.shape[1] for x in parts)
    out = torch.empty((B, length, heads, d), device=x0.device, dtype=x0.dtype)
    norm = na is not None
    rope = rotary is not None
    cos, sin = (rotary[0].contiguous(), rotary[1].contiguous()) if rope else (x0, x0)  # unread without ROPE
    wa = na.weight if norm else x0
    wb = nb.weight if norm else x0
    kernel = KERNEL.get()
    block_h = block_h or heads_per_program(heads, d)
    kernel[(B * length, heads // block_h)](x0, xb, wa, wb, cos, sin, out, x0.stride(0), x0.stride(1), xb.stride(0),
                                           xb.stride(1), n_a, length, _eps(na, x0.dtype), _eps(nb, x0.dtype),
                                           H=heads, D=d, BLOCK_H=block_h, NORM=norm, ROPE=rope,
                                           num_warps=num_warps or warps_for(block_h, d))
    return out


def reference(parts: Sequence[torch.Tensor], norms: Sequence[Any], rotary: Any, heads: int) -> torch.Tensor:
    """The eager ops (diffusers' FLUX processor): per-head norms, concatenation, ``apply_rotary_emb``."""
    from diffusers.models.embeddings import apply_rotary_emb

    xs = [x.unflatten(-1, (heads, -1)) for x in parts]
    xs = [x if n is None else n(x) for x, n in zip(xs, norms, strict=True)]
    x = torch.cat(xs, dim=1)
    return x if rotary is None else apply_rotary_emb(x, rotary, sequence_dim=1)


__all__ = ["MODES", "heads_per_program", "joint_norm_rope", "prepare", "qk_norm_rope_option", "reference", "supported",
           "triton_available", "unavailable_reason", "warps_for"]
