"""The deploy's attention backend inside diffusers' Wan blocks.

:class:`WanBackendAttnProcessor` does what diffusers' ``WanAttnProcessor`` does — Q/K/V
projections (fused or not), QK RMS-norm, rotary embedding, the I2V image key/values of Wan2.1
I2V cross-attention — with the same tensor operations in the same order, but computes attention
with the deployment's backend (``AttentionBackendSpec.fn(q, k, v)``, ``[B, heads, L, D]``)
instead of diffusers' dispatcher (FP8 backends such as ``cudnn-fp8`` with ``qk_norm_rope: fused``
receive q and k already in e4m3 from the fused kernel — a backend callable declaring
``accepts_quantized_qk = True`` provides ``attend_quantized(q8, descale_q, k8, descale_k, v, dtype)``; backends declaring
``accepts_grid``, such as ``sparse-tile``, get the self-attention token grid as ``grid=(T, H, W)``,
set per forward by :func:`set_token_grid`). Installing, the token grid and putting diffusers'
processors back are omniloop-kit's (:mod:`omniloop_kit.attention`). With the core ``sdpa`` backend the block outputs are
``torch.equal`` to diffusers' (tests/wan/test_attention.py): diffusers' native backend is the same
``scaled_dot_product_attention`` call on the same ``[B, H, L, D]`` views.

Processors are installed at load on every ``WanAttention`` module (self- and cross-attention) of
each loaded transformer. A runtime loads its own modules, so runtimes do not interfere; modules
shared by several runtimes (``WanFamily.from_components``) carry the backend of the last one
installed — use one backend per set of shared components. :func:`diffusers_attention`
temporarily puts diffusers' own processors back (reference runs, benchmarks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omniloop_kit import attention as kit
from omniloop_kit.attention import installed, set_token_grid

from . import fused as fused_kernels
from .blocks import QuantizedRows

#: the text encoder's context length, which diffusers' processor hard-codes for I2V too
TEXT_CONTEXT = 512

#: with ``qk_norm_rope: fused`` and a backend that takes quantised q/k (``cudnn-fp8``), the fused
#: Triton kernel writes q and k in e4m3 directly; False: the backend quantises them itself (a
#: separate pass; benchmarks flip this to measure the difference)
FUSE_FP8_QUANT = True
#: the same for cross-attention's q and k (the norm alone, no rotation): one pass instead of the
#: backend's amax + quantise passes over the 32k-token query (at Wan 14B on an H100 those took ~0.75 ms
#: of each block). With :data:`FUSE_OUT_QUANT`, measured on an H100 (``bench/wan_gpu.py`` word
#: ``-xq-oq``): 14B FP8 forward 3.6327 -> 3.5821 s (1.813x -> 1.838x diffusers eager), 1.3B step
#: 0.6976 -> 0.6810 s (1.786x -> 1.830x); wan-demo clips (48): no colour/direction verdict lost vs bf16, 1
#: shape verdict lost (bench/results/*-xq-oq-*). False: the backend quantises them (benchmarks' rows
#: without the word)
FUSE_FP8_CROSS_QUANT = True
#: with ``options.norm_quant: fused``: each attention output quantised per row by omniloop-quant's row
#: kernel for its FP8 output GEMM (:func:`_project_out`) instead of the GEMM's own pass (inductor's
#: looped reduction, ~0.29 ms a call at 14B on an H100). Measured with the flag above (word ``-oq``)
FUSE_OUT_QUANT = True


def apply_rotary_emb(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    # diffusers' WanAttnProcessor.apply_rotary_emb, op for op
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def _project_rows(attn: Any, rows: QuantizedRows, context: torch.Tensor | None,
                  fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q/K/V with the query (self-attention: all three) from e4m3 rows, through the FP8 GEMMs' ``forward_quantized``."""
    def gemm(linear: Any) -> torch.Tensor:
        return linear.forward_quantized(rows.q, rows.scale, rows.dtype).reshape(*rows.lead, -1)

    if context is None:  # self-attention
        if fused:
            q, k, v = gemm(attn.to_qkv).chunk(3, dim=-1)
            return q, k, v
        return gemm(attn.to_q), gemm(attn.to_k), gemm(attn.to_v)
    if fused:
        key, value = attn.to_kv(context).chunk(2, dim=-1)
        return gemm(attn.to_q), key, value
    return gemm(attn.to_q), attn.to_k(context), attn.to_v(context)


def _project_out(attn: Any, hidden_states: torch.Tensor, rows_given: bool) -> torch.Tensor:
    """``to_out`` (the output GEMM, then dropout). ``rows_given`` (``options.norm_quant: fused``, whose
    block checked that ``to_out[0]`` is an FP8 linear): the attention output -- an opaque kernel's,
    which inductor cannot fuse its row quantisation into -- is quantised per row by omniloop-quant's
    row kernel and handed to the GEMM's ``forward_quantized`` (the same values as the GEMM's own pass)."""
    if rows_given and FUSE_OUT_QUANT:
        from omniloop_quant import kernels

        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        if kernels.supported(flat):
            q, scale = kernels.quantize_rows(flat)
            out = attn.to_out[0].forward_quantized(q, scale, hidden_states.dtype)
            return attn.to_out[1](out.reshape(*hidden_states.shape[:-1], -1))
    return attn.to_out[1](attn.to_out[0](hidden_states))


class WanBackendAttnProcessor(kit.BackendProcessor):
    """diffusers' ``WanAttnProcessor`` computing attention with ``fn(q, k, v)`` (``[B, H, L, D]``)."""

    def __init__(self, fn: Callable[..., torch.Tensor], backend: str = "custom", qk_norm_rope: str = "reference") -> None:
        super().__init__(fn, backend)
        #: "fused": self-attention QK norm + rotary in one Triton kernel (omniloop_wan.fused)
        self.qk_norm_rope = qk_norm_rope
        #: the backend declares it takes q and k already in e4m3 (``attend_quantized``; ``cudnn-fp8``)
        self.takes_quantized_qk = bool(getattr(fn, "accepts_quantized_qk", False))
        if qk_norm_rope == "fused" and fused_kernels.triton_available():
            fused_kernels.prepare()

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        quantized: QuantizedRows | None = None,
    ) -> torch.Tensor:
        """``quantized``: the block's normed input already as e4m3 rows (``hidden_states`` is then None; the
        query's -- and in self-attention the key's and value's -- FP8 GEMMs take the rows directly:
        :mod:`omniloop_wan.blocks`, ``options.norm_quant: fused``)."""
        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:
            assert encoder_hidden_states is not None
            image_context_length = encoder_hidden_states.shape[1] - TEXT_CONTEXT
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]

        fused = getattr(attn, "fused_projections", False)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if quantized is not None:
            query, key, value = _project_rows(attn, quantized, encoder_hidden_states, fused)
        elif fused and not attn.is_cross_attention:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        elif fused:
            query = attn.to_q(hidden_states)
            key, value = attn.to_kv(context).chunk(2, dim=-1)
        else:
            query = attn.to_q(hidden_states)
            key = attn.to_k(context)
            value = attn.to_v(context)

        # FP8 backend: the fused kernel writes q and k in e4m3 (static scale), no extra pass -- in
        # self-attention with the rotation, in cross-attention (no rotary_emb) the norm alone
        fp8_qk = (self.takes_quantized_qk and FUSE_FP8_QUANT and encoder_hidden_states_img is None
                  and (rotary_emb is not None or FUSE_FP8_CROSS_QUANT))
        rope = rotary_emb if rotary_emb is not None else (None, None)
        fused_ok = (self.qk_norm_rope == "fused" and (rotary_emb is not None or fp8_qk)
                    and fused_kernels.supported(query, attn.norm_q, rope[0], attn.heads)
                    and fused_kernels.supported(key, attn.norm_k, rope[0], attn.heads))
        if fused_ok and fp8_qk:
            q8, dq = fused_kernels.qk_norm_rope_fp8(query, attn.norm_q, *rope, attn.heads)
            k8, dk = fused_kernels.qk_norm_rope_fp8(key, attn.norm_k, *rope, attn.heads)
            value = value.unflatten(2, (attn.heads, -1))
            out = self.fn.attend_quantized(q8.permute(0, 2, 1, 3), dq, k8.permute(0, 2, 1, 3), dk, value.permute(0, 2, 1, 3),
                            value.dtype)
            hidden_states = out.permute(0, 2, 1, 3).flatten(2, 3).type_as(value)
            return _project_out(attn, hidden_states, quantized is not None)
        if fused_ok:
            query = fused_kernels.qk_norm_rope(query, attn.norm_q, *rotary_emb, attn.heads)
            key = fused_kernels.qk_norm_rope(key, attn.norm_k, *rotary_emb, attn.heads)
            value = value.unflatten(2, (attn.heads, -1))
        else:
            query = attn.norm_q(query)
            key = attn.norm_k(key)

            query = query.unflatten(2, (attn.heads, -1))
            key = key.unflatten(2, (attn.heads, -1))
            value = value.unflatten(2, (attn.heads, -1))

            if rotary_emb is not None:
                query = apply_rotary_emb(query, *rotary_emb)
                key = apply_rotary_emb(key, *rotary_emb)

        hidden_states_img = None
        if encoder_hidden_states_img is not None:  # I2V: attend to the CLIP image states too
            if fused:
                key_img, value_img = attn.to_added_kv(encoder_hidden_states_img).chunk(2, dim=-1)
            else:
                key_img = attn.add_k_proj(encoder_hidden_states_img)
                value_img = attn.add_v_proj(encoder_hidden_states_img)
            key_img = attn.norm_added_k(key_img)
            key_img = key_img.unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))
            hidden_states_img = self.attend(query, key_img, value_img)
            hidden_states_img = hidden_states_img.flatten(2, 3)
            hidden_states_img = hidden_states_img.type_as(query)

        grid = self.grid if self.wants_grid and encoder_hidden_states is None else None
        hidden_states = self.attend(query, key, value, attention_mask, grid)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.type_as(query)

        if hidden_states_img is not None:
            hidden_states = hidden_states + hidden_states_img

        return _project_out(attn, hidden_states, quantized is not None)

    def __repr__(self) -> str:
        return f"WanBackendAttnProcessor(backend={self.backend!r}, qk_norm_rope={self.qk_norm_rope!r})"


def _attention_modules(model: torch.nn.Module) -> list[Any]:
    from diffusers.models.transformers.transformer_wan import WanAttention

    return [m for m in model.modules() if isinstance(m, WanAttention)]


def install(model: torch.nn.Module, backend: Any, qk_norm_rope: str = "reference") -> int:
    """Put a :class:`WanBackendAttnProcessor` for ``backend`` (an ``AttentionBackendSpec``) on every
    ``WanAttention`` of ``model``; returns how many modules got one. ``qk_norm_rope="fused"``: the
    self-attention QK norm and rotary embedding run as one Triton kernel (:mod:`omniloop_wan.fused`)."""
    name = str(getattr(backend, "name", "custom"))
    return kit.install(model, _attention_modules(model), lambda: WanBackendAttnProcessor(backend.fn, name, qk_norm_rope),
                       name)


def fuse_projections(model: torch.nn.Module) -> int:
    """``options.qkv: fused``: diffusers' ``WanAttention.fuse_projections`` on every attention of
    ``model`` (``to_qkv`` for self-attention, ``to_kv`` for cross-attention, ``to_added_kv`` for I2V's
    image keys; the separate linears are kept). Returns how many modules were fused."""
    mods = _attention_modules(model)
    with torch.no_grad():
        for m in mods:
            m.fuse_projections()
    return len(mods)


def diffusers_attention(*models: torch.nn.Module) -> Any:
    """Run ``models`` with diffusers' own ``WanAttnProcessor`` inside the block, then restore."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    return kit.restored([m for model in models for m in _attention_modules(model)], WanAttnProcessor)


__all__ = ["WanBackendAttnProcessor", "apply_rotary_emb", "diffusers_attention", "fuse_projections", "install", "installed",
           "set_token_grid"]
