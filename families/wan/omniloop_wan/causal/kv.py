"""Chunk-KV slabs of Wan's causal rollout: what one token stores for a Wan transformer
(:func:`chunk_layout`); the slabs themselves are omniloop-kit's :class:`~omniloop_kit.causal.ChunkKV`."""

from __future__ import annotations

from typing import Any

import torch

from omniloop_kit.causal import ChunkKV, slabs_needed
from omniloop_kvcache import KVLayout


def chunk_layout(model: Any, dtype: torch.dtype | None = None, device: Any = None) -> KVLayout:
    """What one token stores for ``model`` (a ``WanTransformer3DModel``): K and V per block."""
    cfg = model.config
    return KVLayout(
        layers=len(model.blocks), kv_heads=int(cfg.num_attention_heads), head_dim=int(cfg.attention_head_dim),
        dtype=dtype or model.dtype, device=torch.device(device) if device is not None else model.device,
    )


__all__ = ["ChunkKV", "chunk_layout", "slabs_needed"]
