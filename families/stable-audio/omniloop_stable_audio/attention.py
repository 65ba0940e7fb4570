"""The deploy's attention backend inside the Stable Audio DiT's blocks.

:class:`StableAudioAttention` does what diffusers' ``StableAudioAttnProcessor2_0`` does — Q/K/V
projections, key/value heads repeated for grouped-query cross-attention, the partial rotary
embedding on the first half of each head (in float32) for self-attention, the output projection —
with the same tensor operations in the same order, but computes attention with the deployment's
backend (``AttentionBackendSpec.fn(q, k, v)``, ``[B, heads, L, D]``). Installed at load on every
block's ``attn1`` / ``attn2`` when the deploy names a backend other than the core ``sdpa``;
otherwise diffusers' processors stay untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    from diffusers.models.embeddings import apply_rotary_emb

    rot = rotary[0].shape[-1]
    turned = apply_rotary_emb(x[..., :rot], rotary, use_real=True, use_real_unbind_dim=-2)
    return torch.cat((turned, x[..., rot:]), dim=-1)


class StableAudioAttention:
    """diffusers' ``StableAudioAttnProcessor2_0`` with attention from ``fn(q, k, v)`` (no mask)."""

    def __init__(self, fn: Callable[..., torch.Tensor], backend: str = "custom") -> None:
        self.fn = fn
        self.backend = backend

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: Any = None) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("StableAudioAttention: attention masks are not supported (the pipeline passes none)")
        batch = hidden_states.shape[0]
        query = attn.to_q(hidden_states)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        key, value = attn.to_k(context), attn.to_v(context)
        head_dim = query.shape[-1] // attn.heads
        kv_heads = key.shape[-1] // head_dim
        query = query.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        value = value.view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        if kv_heads != attn.heads:
            n = attn.heads // kv_heads
            key = torch.repeat_interleave(key, n, dim=1, output_size=key.shape[1] * n)
            value = torch.repeat_interleave(value, n, dim=1, output_size=value.shape[1] * n)
        if rotary_emb is not None:
            qd, kd = query.dtype, key.dtype
            query = _rotate(query.to(torch.float32), rotary_emb).to(qd)
            if not attn.is_cross_attention:
                key = _rotate(key.to(torch.float32), rotary_emb).to(kd)
        out = self.fn(query, key, value)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)  # type: ignore[no-any-return]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)


def install(model: torch.nn.Module, backend: Any = None) -> int:
    """Put a :class:`StableAudioAttention` on every block's ``attn1`` and ``attn2``; returns how many."""
    proc = StableAudioAttention(getattr(backend, "fn", None) or _sdpa, backend=getattr(backend, "name", "sdpa"))
    n = 0
    for block in model.transformer_blocks:
        for attn in (block.attn1, block.attn2):
            attn.set_processor(proc)
            n += 1
    return n


def uninstall(model: torch.nn.Module) -> None:
    """diffusers' own processors back."""
    from diffusers.models.attention_processor import StableAudioAttnProcessor2_0

    for block in model.transformer_blocks:
        for attn in (block.attn1, block.attn2):
            attn.set_processor(StableAudioAttnProcessor2_0())


__all__ = ["StableAudioAttention", "install", "uninstall"]
