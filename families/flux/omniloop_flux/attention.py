"""The deploy's attention backend inside FLUX.1's double- and single-stream blocks.

:class:`FluxBackendAttnProcessor` is omniloop-kit's joint attention
(:class:`~omniloop_kit.attention.JointAttnProcessor`) declared as diffusers' ``FluxAttnProcessor``:
the context tokens before the image tokens, q/k norms and the rotary embedding on ``[B, L, H, D]``,
the split parts made contiguous before their projections; separate or diffusers' fused projections.
With the core ``sdpa`` backend the block outputs are ``torch.equal`` to diffusers'
(tests/flux/test_attention.py).

Installed at load (:meth:`omniloop_flux.family.FluxFamily.prepare`) on every block's ``attn`` when
the deploy's ``attention_backend`` is another than the core ``sdpa`` (``sdpa-cudnn``,
``flash-attn-4``, ``cudnn-fp8``, or whatever ``auto`` picks) or when ``options.qk_norm_rope: fused``
asks for omniloop-kit's norm + rotary kernel (then with the core ``sdpa`` too); otherwise diffusers'
processors stay untouched. A backend that needs the token grid (``sparse-tile``) is refused for FLUX by the
runtime (the family passes none).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

from omniloop_kit import attention as kit
from omniloop_kit.attention import installed


class FluxBackendAttnProcessor(kit.JointAttnProcessor):
    """diffusers' ``FluxAttnProcessor`` computing attention with the deploy's backend."""

    context_first = True
    heads_first = False
    contiguous_split = True


def attention_modules(model: torch.nn.Module) -> list[Any]:
    """Every block's ``attn``: the double-stream blocks', then the single-stream blocks'."""
    return [b.attn for b in (*model.transformer_blocks, *model.single_transformer_blocks)]


def install(model: torch.nn.Module, backend: Any, *, fused_norm_rope: bool = False) -> int:
    """Put a :class:`FluxBackendAttnProcessor` of ``backend`` (an ``AttentionBackendSpec``; None: the
    core ``sdpa``) on every block's attention, with ``fused_norm_rope`` the q/k norms, the joint
    sequence's concatenation and the rotary embedding in omniloop-kit's kernel
    (``options.qk_norm_rope: fused``, :mod:`omniloop_kit.qk_norm_rope`); returns how many."""
    return kit.install_joint(model, attention_modules(model), FluxBackendAttnProcessor, backend,
                             fused_norm_rope=fused_norm_rope)


def diffusers_attention(model: torch.nn.Module) -> Any:
    """A context in which ``model`` runs diffusers' own ``FluxAttnProcessor`` (reference runs)."""
    return kit.restored(attention_modules(model), FluxAttnProcessor)


__all__ = ["FluxBackendAttnProcessor", "attention_modules", "diffusers_attention", "install", "installed"]
