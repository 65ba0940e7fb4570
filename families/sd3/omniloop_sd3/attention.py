"""The deploy's attention backend (and optionally fused Q/K/V projections) inside SD3's blocks.

:class:`SD3AttnProcessor` is omniloop-kit's joint attention
(:class:`~omniloop_kit.attention.JointAttnProcessor`) declared as diffusers' ``JointAttnProcessor2_0``:
the joint ``[image ; context]`` sequence, SD3.5's RMS q/k norms on ``[B, H, L, D]``, the split and
output projections on views; and the image-only ``attn2`` of SD3.5-medium's dual-attention layers.
With the core ``sdpa`` backend and ``qkv: separate`` the outputs are ``torch.equal`` to diffusers'
(tests/sd3/test_attention.py).

``options.qkv: fused``: one GEMM over the concatenated ``[W_q; W_k; W_v]`` (image tokens, and
context tokens with ``add_{q,k,v}_proj``), registered once at load as non-persistent buffers of each
``Attention`` module beside the originals (:func:`omniloop_kit.attention.fuse_projections`); a
different GEMM shape may round differently, so not guaranteed bit-exact (equal on CPU float32 in
the tests).

Installed at load on every joint block's ``attn`` / ``attn2`` when the deploy names an attention
backend other than the core ``sdpa`` or asks for ``qkv: fused``; otherwise diffusers' processors
stay untouched. Modules shared by several runtimes carry the processors of the last install.
"""

from __future__ import annotations

from typing import Any

import torch

from omniloop_kit import attention as kit


class SD3AttnProcessor(kit.JointAttnProcessor):
    """diffusers' ``JointAttnProcessor2_0`` with attention from the deploy's backend and optional fused QKV."""

    context_first = False
    heads_first = True


def attention_modules(model: torch.nn.Module) -> list[Any]:
    """Every joint block's ``attn`` and, in SD3.5-medium's dual-attention layers, ``attn2``."""
    return [m for b in model.transformer_blocks for m in (b.attn, b.attn2) if m is not None]


def install(model: torch.nn.Module, backend: Any = None, *, fused_qkv: bool = False) -> int:
    """Put an :class:`SD3AttnProcessor` on every joint block's ``attn`` (and ``attn2``); returns how many."""
    return kit.install_joint(model, attention_modules(model), SD3AttnProcessor, backend, fused_qkv=fused_qkv)


def uninstall(model: torch.nn.Module) -> None:
    """diffusers' own processors back."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    kit.uninstall(model, attention_modules(model), JointAttnProcessor2_0)


__all__ = ["SD3AttnProcessor", "attention_modules", "install", "uninstall"]
