"""The backends: thin, explicit wrappers. Each says why it cannot run instead of falling back."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from omniloop.family import AttentionBackendSpec

from .flash3 import AUTO_RANK as FA3_AUTO_RANK
from .flash3 import fa3_fp8, fa3_fp8_available, flash_attn3, flash_attn3_accepts, flash_attn3_available
from .flash4 import AUTO_RANK, flash_attn4, flash_attn4_accepts, flash_attn4_available
from .fp8 import CudnnFP8Options, cudnn_fp8, cudnn_fp8_available
from .fp8 import configure as configure_fp8
from .sparse import SparseTileOptions, configure, flex_available, sparse_tile

_KERNELS = {
    "sdpa-cudnn": (SDPBackend.CUDNN_ATTENTION, "cuDNN attention"),
    "sdpa-flash": (SDPBackend.FLASH_ATTENTION, "FlashAttention-2 (torch)"),
    "sdpa-efficient": (SDPBackend.EFFICIENT_ATTENTION, "memory-efficient attention"),
    "sdpa-math": (SDPBackend.MATH, "reference math attention"),
}


def sdpa_kernel_available(name: str) -> str | None:
    """None when the named SDPA kernel can run here, else the reason it cannot."""
    backend, _ = _KERNELS[name]
    if backend is SDPBackend.MATH:
        return None
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    major, minor = torch.cuda.get_device_capability()
    if backend is SDPBackend.CUDNN_ATTENTION:
        if not torch.backends.cudnn.is_available():
            return "cuDNN is not available in this torch build"
        if major < 8:
            return f"cuDNN attention needs compute capability 8.0+, this GPU is {major}.{minor}"
    if backend is SDPBackend.FLASH_ATTENTION and major < 8:
        return f"flash attention needs compute capability 8.0+, this GPU is {major}.{minor}"
    return None


def _sdpa_with(backend: SDPBackend) -> Callable[..., torch.Tensor]:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, **kw)

    return attend


def flash_attn_available() -> str | None:
    """FlashAttention-2's ``flash_attn_func`` (package ``flash-attn``). ``flash-attn-4`` installs only
    the namespace ``flash_attn.cute``: that is not this backend (it is ``flash-attn-4``)."""
    try:
        found = importlib.util.find_spec("flash_attn.flash_attn_interface") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return "the flash-attn package is not installed (pip install 'omniloop-attention[flash-attn]')"
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    return None


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    """flash-attn takes ``[B, L, H, D]``; our layout is ``[B, H, L, D]`` (transposed views, no copy)."""
    from flash_attn import flash_attn_func

    if kw.get("attn_mask") is not None:
        raise ValueError("flash-attn backend does not take an attention mask")
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=bool(kw.get("is_causal", False)))
    return out.transpose(1, 2)


def _specs() -> list[AttentionBackendSpec]:
    specs = [
        AttentionBackendSpec(
            name=name, fn=_sdpa_with(backend), available=functools.partial(sdpa_kernel_available, name),
            description=f"torch SDPA forced to {desc}",
        )
        for name, (backend, desc) in _KERNELS.items()
    ]
    specs.append(AttentionBackendSpec(
        name="flash-attn", fn=flash_attn, available=flash_attn_available,
        description="the flash-attn package's flash_attn_func",
    ))
    specs.append(AttentionBackendSpec(
        name="flash-attn-4", fn=flash_attn4, available=flash_attn4_available,
        description="flash-attn-4's CuTe-DSL forward kernel (flash_attn.cute; Hopper; exact-class; "
                    "attention_backend: auto picks it for Wan and SD3 on Hopper in bf16/fp16 when installed)",
        auto_rank=AUTO_RANK, auto_accepts=flash_attn4_accepts,
    ))
    specs.append(AttentionBackendSpec(
        name="flash-attn-3", fn=flash_attn3, available=flash_attn3_available,
        description="FlashAttention-3's Hopper forward kernel (module flash_attn_3; exact-class; "
                    "build: plugins/compute/attention/scripts/build_flash_attn_3.sh; attention_backend: auto "
                    "picks it for Wan on Hopper in bf16/fp16 when built and flash-attn-4 is not installed)",
        auto_rank=FA3_AUTO_RANK, auto_accepts=flash_attn3_accepts,
    ))
    specs.append(AttentionBackendSpec(
        name="fa3-fp8", fn=fa3_fp8, available=fa3_fp8_available, distribution_altering=True,
        description="FlashAttention-3's FP8 (e4m3) forward, per-tensor scales, bf16 output (Hopper; alters outputs)",
    ))
    specs.append(AttentionBackendSpec(
        name="cudnn-fp8", fn=cudnn_fp8, available=cudnn_fp8_available, distribution_altering=True,
        description="cuDNN FP8 (e4m3) attention, per-tensor scales, FP8 output dequantised (Hopper; alters outputs; "
                    "attention_options: plan = heuristic | fastest)",
        options_schema=CudnnFP8Options, configure=configure_fp8,
    ))
    specs.append(AttentionBackendSpec(
        name="sparse-tile", fn=sparse_tile, available=flex_available, distribution_altering=True,
        description="sliding-tile sparse attention over the (T, H, W) token grid (flex_attention; "
                    "attention_options: density, tile, global_frames; alters outputs)",
        options_schema=SparseTileOptions, configure=configure,
    ))
    return specs


BACKENDS: list[AttentionBackendSpec] = _specs()
