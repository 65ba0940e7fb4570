"""Attention backends for omniloop (see README.md)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public names by defining module, imported on first use (PEP 562): plugin discovery (omniloop --help) imports no torch (issue 42)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "backends": ("BACKENDS", "flash_attn_available", "sdpa_kernel_available"),
    "fp8": ("cudnn_fp8_available",),
    "sparse": ("SparseTileAttention", "flex_available"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from .backends import BACKENDS, flash_attn_available, sdpa_kernel_available
    from .fp8 import cudnn_fp8_available
    from .sparse import SparseTileAttention, flex_available


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}" if module else __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})

__all__ = ["BACKENDS", "SparseTileAttention", "cudnn_fp8_available", "flash_attn_available", "flex_available",
           "sdpa_kernel_available"]
