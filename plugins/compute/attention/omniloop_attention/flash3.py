"""``flash-attn-3`` and ``fa3-fp8``: FlashAttention-3's Hopper forward kernels (module ``flash_attn_3``).

What runs: ``torch.ops.flash_attn_3.fwd``, the warp-specialised wgmma/TMA forward kernel of
flash-attention's ``hopper/`` tree (Shah et al., 2024), registered by ``flash_attn_3._C``.

- ``flash-attn-3``: bf16/fp16 q/k/v, float32 softmax, output in the input dtype — the same function
  as SDPA up to floating-point reassociation, so **exact-class**.
- ``fa3-fp8``: q, k and v scaled per tensor to e4m3 (:func:`omniloop_attention.fp8.quantize`, as
  ``cudnn-fp8``), handed to the kernel with their descales. The kernel takes the softmax in float32,
  rounds the probabilities to e4m3 (offset so that the row maximum maps to 256, inside e4m3's
  range), multiplies by v in FP8 and writes the output in **bf16** (``cudnn-fp8`` on Hopper writes
  e4m3 and is dequantised after: one rounding fewer here). **Distribution-altering**: refused for
  ``exact: true`` requests. Like ``cudnn-fp8`` it takes q and k already quantised by the Wan
  family's fused QK-norm + rotary kernel (:meth:`FA3FP8Attention.attend_quantized`).

Head dimensions: the kernel rounds the head dimension up to the nearest one it was built for (64,
96, 128, 192, 256; a multiple of 8 — 16 for e4m3 — and ≤ 256), so wan-demo's 32 runs on the 64 kernel.

Layout: the kernel takes ``[B, L, H, D]`` with a unit last stride; our backends take ``[B, H, L,
D]``. The Wan processor's q/k/v are ``[B, H, L, D]`` views of ``[B, L, H, D]`` tensors, so the
transpose back is free.

The call is a ``torch.library`` custom op (``omniloop_attention::flash_attn3_fwd``, fake impl
registered) so that ``torch.compile(fullgraph=True)`` keeps it in the graph. Forward only.

Install: FlashAttention-3 is not on PyPI. Either flash-attention's own ``pip install hopper/`` (all
head dimensions, hours of nvcc), or ``plugins/compute/attention/scripts/build_flash_attn_3.sh``
(the forward kernels for chosen head dims and dtypes, ~80 s each on two cores; the package it
writes is the same module ``flash_attn_3``). Available (else a clear reason at load): CUDA, a
Hopper GPU (sm90; FA3 has no kernels for other architectures), and ``flash_attn_3._C`` importable.
A mask is an error (the kernel takes none).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
from typing import Any

import torch

from .flash4 import cuda_half_accepts
from .fp8 import fp8_dtype, quantize

#: head dims the kernel takes (it rounds up to a built one; a multiple of 8)
MAX_HEAD_DIM = 256
DTYPES = (torch.bfloat16, torch.float16)

#: ``attention_backend: auto`` rank: below flash-attn-4's 10 (the two were not timed in one run; FA4
#: installs from PyPI). Measured on an H100 (2026-12-05, ``bench/results/wan_gpu-1.3b-fa3-h100-*``):
#: the Wan 1.3B step 1.141x ``sdpa-cudnn``'s (1.381x vs 1.217x diffusers eager, same run); the kernel
#: 1.22x / 1.19x cuDNN on Wan 1.3B / 14B self-attention (``attention_fa3-h100-2026-12-05.json``). On an
#: H200 (2026-12-06, ``wan_gpu-1.3b-fa3-h200-2026-12-06.json``): 1.338x vs ``sdpa-cudnn``'s 1.195x (1.12x).
#: FLUX.1-dev's compiled step (the fast exact-class options): 1.019x ``sdpa-cudnn``'s in one run on an H200
#: (``flux_gpu-fa3-h200-2026-12-06.json``) and 1.014x the core ``sdpa``'s on one H100 (each beside its own
#: diffusers anchor, ``flux_gpu-fa3-vs-sdpa-h100-s31-2026-12-07.json``). SD3.5-medium's CFG step at head dim 64:
#: 1.068x the core ``sdpa``'s in one run on an H100 (``sd3_gpu-sd35m-1024-fa3-vs-sdpa-h100-s31-2026-12-07.json``).
AUTO_RANK = 8
#: the families whose whole step was measured faster with it
AUTO_FAMILIES = ("wan", "flux", "sd3")


def flash_attn3_accepts(deploy: Any, family: str) -> str | None:
    """``auto`` may pick flash-attn-3 for a Wan, FLUX.1 or SD3 deploy on a CUDA device in bf16 or fp16."""
    return cuda_half_accepts(deploy, family, AUTO_FAMILIES)


@functools.lru_cache(maxsize=1)
def _import_error() -> str | None:
    try:
        spec = importlib.util.find_spec("flash_attn_3")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return ("FlashAttention-3 (module 'flash_attn_3') is not installed: build it with "
                "plugins/compute/attention/scripts/build_flash_attn_3.sh or flash-attention's hopper/ setup")
    try:
        importlib.import_module("flash_attn_3._C")
    except Exception as exc:  # built for another torch / CUDA, or a partial install
        return f"flash_attn_3 is installed but its library does not load: {type(exc).__name__}: {exc}"
    if not hasattr(torch.ops.flash_attn_3, "fwd"):
        return "flash_attn_3._C loaded but registered no torch.ops.flash_attn_3.fwd"
    return None


def flash_attn3_available() -> str | None:
    """None when FlashAttention-3 can run here, else the reason it cannot."""
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"FlashAttention-3's kernels are Hopper (sm90) only; this GPU is sm{major}{minor}"
    return _import_error()


def fa3_fp8_available() -> str | None:
    """None when the FP8 path of FlashAttention-3 can run here (also needs torch's e4m3 dtype)."""
    if fp8_dtype() is None:
        return f"this torch ({torch.__version__}) has no float8_e4m3fn dtype"
    return flash_attn3_available()


@torch.library.custom_op("omniloop_attention::flash_attn3_fwd", mutates_args=())
def flash_attn3_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor | None,
                    k_descale: torch.Tensor | None, v_descale: torch.Tensor | None, softmax_scale: float,
                    causal: bool) -> torch.Tensor:
    """FA3 forward on ``[B, L, H, D]`` q/k/v (unit last stride) → ``[B, Lq, H, Dv]``; e4m3 inputs
    take ``(B, H_k)`` float32 descales and give a bf16 output, 16-bit inputs their own dtype."""
    out = torch.ops.flash_attn_3.fwd(q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                     softmax_scale=softmax_scale, is_causal=causal)
    return out[0]


@flash_attn3_fwd.register_fake
def _flash_attn3_fwd_fake(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal):  # type: ignore[no-untyped-def]
    B, Lq, H, _ = q.shape
    dtype = torch.bfloat16 if q.dtype == fp8_dtype() else q.dtype
    return q.new_empty((B, Lq, H, v.shape[-1]), dtype=dtype)


def _check_kw(name: str, kw: dict[str, Any]) -> None:
    if kw.get("attn_mask") is not None:
        raise ValueError(f"{name} backend takes no attention mask")
    extra = sorted(k_ for k_, v_ in kw.items() if k_ not in ("attn_mask", "is_causal", "scale") and v_ is not None)
    if extra:
        raise ValueError(f"{name} backend does not take {', '.join(extra)}")


def _check_dims(name: str, q: torch.Tensor, v: torch.Tensor, multiple: int = 8) -> None:
    """The kernel's head-dim rule: a multiple of 8 (16-bit) or 16 (e4m3), at most 256."""
    D, Dv = q.shape[-1], v.shape[-1]
    if not (0 < D <= MAX_HEAD_DIM and D % multiple == 0) or Dv % multiple or Dv > MAX_HEAD_DIM:
        raise ValueError(f"{name} backend needs head dims that are multiples of {multiple} up to {MAX_HEAD_DIM}; "
                         f"got q {D}, v {Dv}")


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, D]`` → ``[B, L, H, D]`` with a unit last stride (a free transpose for Wan's views)."""
    xt = x.transpose(1, 2)
    return xt if xt.stride(-1) == 1 else xt.contiguous()


def _scale(q: torch.Tensor, kw: dict[str, Any]) -> float:
    s = kw.get("scale")
    return float(s) if s is not None else 1.0 / math.sqrt(q.shape[-1])


def flash_attn3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    """The ``flash-attn-3`` backend callable: bf16/fp16 ``[B, H, L, D]`` in and out."""
    _check_kw("flash-attn-3", kw)
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"flash-attn-3 backend needs bf16 or fp16 q/k/v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _check_dims("flash-attn-3", q, v)
    out = torch.ops.omniloop_attention.flash_attn3_fwd(_bshd(q), _bshd(k), _bshd(v), None, None, None, _scale(q, kw),
                                                       bool(kw.get("is_causal", False)))
    return out.transpose(1, 2)


def _descale(d: torch.Tensor, B: int, H: int) -> torch.Tensor:
    """A per-tensor descale (any shape holding one value) as the kernel's ``(B, H_k)`` float32."""
    return d.reshape(1, 1).float().expand(B, H).contiguous()


class FA3FP8Attention:
    """The ``fa3-fp8`` backend's callable: ``fn(q, k, v)`` with bf16/fp16 ``[B, H, L, D]``."""

    #: the Wan processor may pass q and k already quantised (see attend_quantized)
    accepts_quantized_qk = True

    def _run(self, q8: torch.Tensor, dq: torch.Tensor, k8: torch.Tensor, dk: torch.Tensor, v: torch.Tensor,
             out_dtype: torch.dtype, scale: float, causal: bool) -> torch.Tensor:
        _check_dims("fa3-fp8", q8, v, multiple=16)
        v8, dv = quantize(v)
        B, Hk = k8.shape[0], k8.shape[1]
        out = torch.ops.omniloop_attention.flash_attn3_fwd(
            _bshd(q8), _bshd(k8), _bshd(v8), _descale(dq, B, Hk), _descale(dk, B, Hk), _descale(dv, B, Hk), scale, causal)
        return out.to(out_dtype).transpose(1, 2)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        _check_kw("fa3-fp8", kw)
        if q.dtype not in DTYPES:
            raise ValueError(f"fa3-fp8 backend needs bf16 or fp16 q/k/v (quantised here), got {q.dtype}")
        q8, dq = quantize(q)
        k8, dk = quantize(k)
        return self._run(q8, dq, k8, dk, v, q.dtype, _scale(q, kw), bool(kw.get("is_causal", False)))

    def attend_quantized(self, q8: torch.Tensor, descale_q: torch.Tensor, k8: torch.Tensor, descale_k: torch.Tensor,
                         v: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """q and k already e4m3 (``x ≈ x8 * descale``, scalar descales), v in ``out_dtype``; ``[B, H, L, D]``."""
        return self._run(q8, descale_q, k8, descale_k, v, out_dtype, 1.0 / math.sqrt(q8.shape[-1]), False)

    def __repr__(self) -> str:
        return "FA3FP8Attention()"


fa3_fp8 = FA3FP8Attention()

__all__ = ["AUTO_RANK", "FA3FP8Attention", "fa3_fp8", "fa3_fp8_available", "flash_attn3", "flash_attn3_accepts",
           "flash_attn3_available", "flash_attn3_fwd"]
