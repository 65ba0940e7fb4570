"""Attention backends for omniloop (see README.md)."""

from .backends import BACKENDS, flash_attn_available, sdpa_kernel_available

__all__ = ["BACKENDS", "flash_attn_available", "sdpa_kernel_available"]
