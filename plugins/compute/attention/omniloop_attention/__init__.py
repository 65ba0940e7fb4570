"""Attention backends for omniloop (see README.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniloop.lazy import lazy_exports

#: public names by defining module, imported on first use (PEP 562): plugin discovery (omniloop --help) imports no torch (issue 42)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "backends": ("BACKENDS", "flash_attn_available", "sdpa_kernel_available"),
    "fp8": ("cudnn_fp8_available",),
    "sparse": ("SparseTileAttention", "flex_available"),
}

if TYPE_CHECKING:
    from .backends import BACKENDS, flash_attn_available, sdpa_kernel_available
    from .fp8 import cudnn_fp8_available
    from .sparse import SparseTileAttention, flex_available


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = ["BACKENDS", "SparseTileAttention", "cudnn_fp8_available", "flash_attn_available", "flex_available",
           "sdpa_kernel_available"]
