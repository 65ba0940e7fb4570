"""Attention backends for omniloop (see README.md)."""

from .backends import BACKENDS, flash_attn_available, sdpa_kernel_available
from .fp8 import cudnn_fp8_available
from .sparse import SparseTileAttention, flex_available

__all__ = ["BACKENDS", "SparseTileAttention", "cudnn_fp8_available", "flash_attn_available", "flex_available",
           "sdpa_kernel_available"]
