"""The deploy's attention backend (and optionally fused Q/K/V projections) inside SD3's blocks.

:class:`SD3AttnProcessor` does what diffusers' ``JointAttnProcessor2_0`` does — image-token and
context Q/K/V projections, the RMS q/k norms of SD3.5, the joint ``[image ; context]`` attention,
the split and output projections; and the image-only ``attn2`` of SD3.5-medium's dual-attention
layers — with the same tensor operations in the same order, but computes attention with the
deployment's backend (``AttentionBackendSpec.fn(q, k, v)``, ``[B, heads, L, D]``). With the core
``sdpa`` backend and ``qkv: separate`` the outputs are ``torch.equal`` to diffusers'
(tests/sd3/test_attention.py).

Family options:

* ``qkv``: ``separate`` (default; diffusers' three projections) or ``fused`` — one GEMM over the
  concatenated ``[W_q; W_k; W_v]`` (image tokens, and context tokens with ``add_{q,k,v}_proj``).
  The concatenated weights are registered once at load as non-persistent buffers of each
  ``Attention`` module, beside the originals (which stay for everyone else); a different GEMM
  shape may round differently, so not guaranteed bit-exact (equal on CPU float32 in the tests).

Installed at load on every joint block's ``attn`` / ``attn2`` when the deploy names an attention
backend other than the core ``sdpa`` or asks for ``qkv: fused``; otherwise diffusers' processors
stay untouched. Modules shared by several runtimes carry the processors of the last install.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

#: non-persistent buffers holding the concatenated projections, registered on each Attention module
#: (module state, so ``torch.compile`` lifts them per module like the weights themselves)
FUSED_BUFFERS = {"sample": ("omniloop_qkv_weight", "omniloop_qkv_bias"),
                 "context": ("omniloop_add_qkv_weight", "omniloop_add_qkv_bias")}
_PROJECTIONS = {"sample": ("to_q", "to_k", "to_v"), "context": ("add_q_proj", "add_k_proj", "add_v_proj")}


def fuse_projections(attn: Any) -> None:
    """Register ``[W_q; W_k; W_v]`` (and biases) beside the separate projections (once)."""
    for key, names in _PROJECTIONS.items():
        wname, bname = FUSED_BUFFERS[key]
        mods = [getattr(attn, n, None) for n in names]
        if any(m is None for m in mods) or hasattr(attn, wname):
            continue
        attn.register_buffer(wname, torch.cat([m.weight for m in mods], dim=0).detach(), persistent=False)
        bias = torch.cat([m.bias for m in mods], dim=0).detach() if all(m.bias is not None for m in mods) else None
        attn.register_buffer(bname, bias, persistent=False)


def unfuse_projections(attn: Any) -> None:
    for wname, bname in FUSED_BUFFERS.values():
        for name in (wname, bname):
            if name in attn._buffers:
                del attn._buffers[name]


def _heads(x: torch.Tensor, batch: int, heads: int, head_dim: int) -> torch.Tensor:
    return x.view(batch, -1, heads, head_dim).transpose(1, 2)


class SD3AttnProcessor:
    """diffusers' ``JointAttnProcessor2_0`` with attention from ``fn(q, k, v)`` and optional fused QKV."""

    def __init__(self, fn: Callable[..., torch.Tensor], backend: str = "custom", fused_qkv: bool = False) -> None:
        self.fn = fn
        self.backend = backend
        self.fused_qkv = fused_qkv

    def _qkv(self, attn: Any, x: torch.Tensor, key: str, names: tuple[str, str, str]) -> tuple[torch.Tensor, ...]:
        if self.fused_qkv:
            wname, bname = FUSED_BUFFERS[key]
            return tuple(F.linear(x, getattr(attn, wname), getattr(attn, bname)).chunk(3, dim=-1))
        return tuple(getattr(attn, n)(x) for n in names)

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        residual = hidden_states
        batch = hidden_states.shape[0]
        query, key, value = self._qkv(attn, hidden_states, "sample", ("to_q", "to_k", "to_v"))
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (_heads(t, batch, attn.heads, head_dim) for t in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:
            cq, ck, cv = self._qkv(attn, encoder_hidden_states, "context", ("add_q_proj", "add_k_proj", "add_v_proj"))
            cq, ck, cv = (_heads(t, batch, attn.heads, head_dim) for t in (cq, ck, cv))
            if attn.norm_added_q is not None:
                cq = attn.norm_added_q(cq)
            if attn.norm_added_k is not None:
                ck = attn.norm_added_k(ck)
            query = torch.cat([query, cq], dim=2)
            key = torch.cat([key, ck], dim=2)
            value = torch.cat([value, cv], dim=2)
        out = self.fn(query, key, value)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        if encoder_hidden_states is not None:
            out, context = out[:, : residual.shape[1]], out[:, residual.shape[1]:]
            if not attn.context_pre_only:
                context = attn.to_add_out(context)
        out = attn.to_out[0](out)
        out = attn.to_out[1](out)
        if encoder_hidden_states is not None:
            return out, context
        return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)


def install(model: torch.nn.Module, backend: Any = None, *, fused_qkv: bool = False) -> int:
    """Put an :class:`SD3AttnProcessor` on every joint block's ``attn`` (and ``attn2``); returns how many."""
    fn = getattr(backend, "fn", None) or _sdpa
    name = getattr(backend, "name", "sdpa")
    proc = SD3AttnProcessor(fn, backend=name, fused_qkv=fused_qkv)
    n = 0
    for block in model.transformer_blocks:
        for attr in ("attn", "attn2"):
            attn = getattr(block, attr, None)
            if attn is not None:
                if fused_qkv:
                    fuse_projections(attn)
                attn.set_processor(proc)
                n += 1
    return n


def uninstall(model: torch.nn.Module) -> None:
    """diffusers' own processors back."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    for block in model.transformer_blocks:
        for attr in ("attn", "attn2"):
            attn = getattr(block, attr, None)
            if attn is not None:
                attn.set_processor(JointAttnProcessor2_0())
                unfuse_projections(attn)


__all__ = ["SD3AttnProcessor", "install", "uninstall"]
