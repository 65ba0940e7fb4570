"""The deploy's attention backend inside FLUX.1's double- and single-stream blocks.

:class:`FluxBackendAttnProcessor` does what diffusers' ``FluxAttnProcessor`` does — the Q/K/V
projections (diffusers' own ``_get_qkv_projections``: separate or fused), the RMS q/k norms, the
context tokens placed before the image tokens, diffusers' ``apply_rotary_emb``, the split and
output projections — with the same tensor operations in the same order, but computes attention
with the deployment's backend (``AttentionBackendSpec.fn(q, k, v)`` on ``[B, heads, L, D]``,
through omniloop-kit's :class:`~omniloop_kit.attention.BackendProcessor`) instead of diffusers'
dispatcher. With the core ``sdpa`` backend the block outputs are ``torch.equal`` to diffusers'
(tests/flux/test_attention.py): diffusers' native backend is the same
``scaled_dot_product_attention`` call on the same ``[B, H, L, D]`` views.

Installed at load (:meth:`omniloop_flux.family.FluxFamily.prepare`) on every block's ``attn`` when
the deploy's ``attention_backend`` is another than the core ``sdpa`` (``sdpa-cudnn``,
``flash-attn-4``, ``cudnn-fp8``, or whatever ``auto`` picks); with ``sdpa`` diffusers' processors
stay untouched. A backend that needs the token grid (``sparse-tile``) is refused for FLUX by the
runtime (the family passes none).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, _get_qkv_projections

from omniloop_kit import attention as kit
from omniloop_kit.attention import installed


class FluxBackendAttnProcessor(kit.BackendProcessor):
    """diffusers' ``FluxAttnProcessor`` computing attention with ``fn(q, k, v)`` (``[B, H, L, D]``)."""

    def __init__(self, fn: Callable[..., torch.Tensor], backend: str = "custom") -> None:
        super().__init__(fn, backend)

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: Any = None) -> Any:
        query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query = query.unflatten(-1, (-1, attn.head_dim))
        key = key.unflatten(-1, (-1, attn.head_dim))
        value = value.unflatten(-1, (-1, attn.head_dim))
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        if attn.added_kv_proj_dim is not None:
            encoder_query = encoder_query.unflatten(-1, (-1, attn.head_dim))
            encoder_key = encoder_key.unflatten(-1, (-1, attn.head_dim))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
            encoder_query = attn.norm_added_q(encoder_query)
            encoder_key = attn.norm_added_k(encoder_key)
            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        hidden_states = self.attend(query, key, value, attention_mask)  # [B, L, H, D] in and out
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1)
            hidden_states = attn.to_out[0](hidden_states.contiguous())
            hidden_states = attn.to_out[1](hidden_states)
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
            return hidden_states, encoder_hidden_states
        return hidden_states


def attention_modules(model: torch.nn.Module) -> list[Any]:
    """Every block's ``attn``: the double-stream blocks', then the single-stream blocks'."""
    return [b.attn for b in (*model.transformer_blocks, *model.single_transformer_blocks)]


def install(model: torch.nn.Module, backend: Any) -> int:
    """Put a :class:`FluxBackendAttnProcessor` of ``backend`` (an ``AttentionBackendSpec``) on every
    block's attention; returns how many."""
    name = getattr(backend, "name", "custom")
    return kit.install(model, attention_modules(model), lambda: FluxBackendAttnProcessor(backend.fn, name), name)


def diffusers_attention(model: torch.nn.Module) -> Any:
    """A context in which ``model`` runs diffusers' own ``FluxAttnProcessor`` (reference runs)."""
    return kit.restored(attention_modules(model), FluxAttnProcessor)


__all__ = ["FluxBackendAttnProcessor", "attention_modules", "diffusers_attention", "install", "installed"]
