"""omniloop's Wan block forward: the norm in front of each FP8 GEMM fused with its quantisation.

With ``linear_precision: fp8`` (omniloop-quant) every linear of a Wan block is an e4m3 GEMM that
first quantises its input per row. In diffusers' block forward that input is a LayerNorm +
modulation (and, before the cross-attention and the feed-forward, a residual add) that inductor fuses
with the quantisation into row reductions taking 3.45 ms of every 14B block on an H100 where one pass
over the rows needs half of that. Deploy ``options.norm_quant: fused`` puts :class:`WanBlock` in place of
each diffusers ``WanTransformerBlock`` (the same child modules under the same names: same state-dict
keys, LoRA targets and FP8 swaps) and, at each of the block's three sites, computes the residual add,
the norm, the modulation and the per-row e4m3 quantisation in one kernel —
:func:`omniloop_quant.norm_kernels.residual_norm_quantize_rows` — and hands the e4m3 rows to the FP8
GEMMs directly (Q/K/V of the self-attention, Q of the cross-attention, the feed-forward's up
projection; ``forward_quantized`` of omniloop-quant's ``FP8Linear`` / ``FP8FeedForward``), through
:class:`~omniloop_wan.attention.WanBackendAttnProcessor`'s ``quantized`` input. Given rows and
``omniloop_wan.attention.FUSE_OUT_QUANT`` (on by default; measured on an H100 in session 21), the processor also
quantises each attention output with omniloop-quant's row kernel (``kernels.quantize_rows``) for its
output GEMM: inductor cannot fuse that pass into the attention kernel, and its own looped row
reduction took ~0.3 ms a call at 14B on an H100.

Where that does not apply — the block's linears not FP8, diffusers' attention processors, a per-token
modulation (Wan2.2 TI2V), no affine cross-attention norm, a row the kernel does not take (see
``norm_kernels.supported``) — the block computes diffusers' operations in diffusers' order
(``torch.equal`` to diffusers' block: tests/wan/test_norm_quant.py). Numerics of the fused path: the
kernel's mean and variance are float32 sums (torch's LayerNorm uses Welford's update), so the e4m3 rows
equal the unfused path's up to float32 rounding before the rounding to bf16 — the same class of
difference as inductor's own fusions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from omniloop_kit import blocks as kit_blocks

#: values of ``options.norm_quant``
MODES = ("reference", "fused")

_CHILDREN = ("norm1", "attn1", "attn2", "norm2", "ffn", "norm3")


class QuantizedRows(NamedTuple):
    """An attention input already quantised per row: ``q [B*L, N]`` e4m3, ``scale [B*L, 1]`` float32, the
    ``(B, L)`` it came from and the dtype the GEMMs return."""

    q: torch.Tensor
    scale: torch.Tensor
    lead: tuple[int, int]
    dtype: torch.dtype


def _fp8_types() -> tuple[type, type] | None:
    try:
        from omniloop_quant.fp8 import FP8FeedForward, FP8Linear
    except ImportError:  # omniloop-quant not installed: no FP8 linears to feed
        return None
    return FP8Linear, FP8FeedForward


class WanBlock(nn.Module):
    """diffusers' ``WanTransformerBlock`` forward over the block's own modules, with the fused fronts of
    the FP8 GEMMs when they apply (see the module docstring)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        for name in _CHILDREN:
            setattr(self, name, getattr(block, name))
        self.scale_shift_table = block.scale_shift_table

    def _modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if temb.ndim == 4:  # batch, seq_len, 6, inner_dim (Wan2.2 TI2V: one timestep per token)
            parts = (self.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
            return tuple(p.squeeze(2) for p in parts)
        return (self.scale_shift_table + temb.float()).chunk(6, dim=1)

    def fusable(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> bool:
        """Whether the fused fronts apply to this forward (decided when a compiled block is traced)."""
        from .attention import WanBackendAttnProcessor

        if _fp8_types() is None:
            return False
        from omniloop_quant import norm_kernels

        if temb.ndim != 3 or not norm_kernels.supported(hidden_states):
            return False
        a1, a2 = self.attn1, self.attn2
        return (isinstance(a1.processor, WanBackendAttnProcessor) and isinstance(a2.processor, WanBackendAttnProcessor)
                and not self.unquantized_fronts() and isinstance(self.norm2, nn.LayerNorm)
                and self.norm2.weight is not None and self.norm2.bias is not None)

    def unquantized_fronts(self) -> list[str]:
        """The GEMMs the fused fronts feed (self-attention Q/K/V or its fused ``to_qkv``, the cross-attention's Q,
        both output projections, the feed-forward) that are not omniloop-quant's FP8 modules — kept in the model
        dtype by ``linear_precision_options.keep``, or left by FP8 as too small. With any, this block computes
        diffusers' unfused order."""
        a1, a2 = self.attn1, self.attn2
        fronts = ({"attn1.to_qkv": a1.to_qkv} if getattr(a1, "fused_projections", False)
                  else {"attn1.to_q": a1.to_q, "attn1.to_k": a1.to_k, "attn1.to_v": a1.to_v})
        fronts.update({"attn2.to_q": a2.to_q, "attn1.to_out.0": a1.to_out[0], "attn2.to_out.0": a2.to_out[0]})
        types = _fp8_types()
        if types is None:
            return [*fronts, "ffn"]
        fp8_linear, fp8_ffn = types
        missing = [name for name, module in fronts.items() if not isinstance(module, fp8_linear)]
        return missing if isinstance(self.ffn, fp8_ffn) else [*missing, "ffn"]

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                rotary_emb: Any) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = self._modulation(temb)
        if self.fusable(hidden_states, temb):
            return self._fused(hidden_states, encoder_hidden_states, rotary_emb, shift_msa, scale_msa, gate_msa,
                               c_shift_msa, c_scale_msa, c_gate_msa)
        # 1. Self-attention
        norm_hidden_states = (self.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states)
        attn_output = self.attn1(norm_hidden_states, None, None, rotary_emb)
        hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)
        # 2. Cross-attention
        norm_hidden_states = self.norm2(hidden_states.float()).type_as(hidden_states)
        attn_output = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
        hidden_states = hidden_states + attn_output
        # 3. Feed-forward
        norm_hidden_states = (self.norm3(hidden_states.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(hidden_states)
        ff_output = self.ffn(norm_hidden_states)
        return (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)

    def _fused(self, h: torch.Tensor, context: torch.Tensor, rotary_emb: Any, shift_msa: torch.Tensor,
               scale_msa: torch.Tensor, gate_msa: torch.Tensor, c_shift_msa: torch.Tensor, c_scale_msa: torch.Tensor,
               c_gate_msa: torch.Tensor) -> torch.Tensor:
        from omniloop_quant import norm_kernels as nk

        b, length, _ = h.shape
        _, q, s = nk.residual_norm_quantize_rows(h, eps=self.norm1.eps, scale=scale_msa, shift=shift_msa)
        attn = self.attn1.processor(self.attn1, None, None, None, rotary_emb, quantized=QuantizedRows(q, s, (b, length), h.dtype))
        h, q, s = nk.residual_norm_quantize_rows(h, eps=self.norm2.eps, delta=attn, gate=gate_msa,
                                                 weight=self.norm2.weight, bias=self.norm2.bias)
        attn = self.attn2.processor(self.attn2, None, context, None, None, quantized=QuantizedRows(q, s, (b, length), h.dtype))
        h, q, s = nk.residual_norm_quantize_rows(h, eps=self.norm3.eps, delta=attn, scale=c_scale_msa, shift=c_shift_msa)
        ff = self.ffn.forward_quantized(q, s, h.dtype).reshape(b, length, -1)
        return (h.float() + ff.float() * c_gate_msa).type_as(h)


def unfused_blocks(model: nn.Module) -> dict[str, int]:
    """``{GEMM path in a block: blocks}`` over ``model``'s installed :class:`WanBlock` s whose fused fronts
    cannot apply because that GEMM is not FP8 (:meth:`WanBlock.unquantized_fronts`); empty when all can."""
    out: dict[str, int] = {}
    for block in getattr(model, "blocks", ()):
        if isinstance(block, WanBlock):
            for name in block.unquantized_fronts():
                out[name] = out.get(name, 0) + 1
    return out


def install(model: nn.Module) -> int:
    """Put a :class:`WanBlock` in place of each of ``model.blocks`` (in place, sharing their modules:
    :mod:`omniloop_kit.blocks`); returns how many. Installed again, it changes nothing."""
    return kit_blocks.replace(model, {"blocks": WanBlock})


def restore(model: nn.Module) -> int:
    """Put diffusers' blocks back (no-op when :func:`install` was not called); returns how many."""
    return kit_blocks.restore(model)


def installed(model: nn.Module) -> bool:
    return kit_blocks.replaced(model)


__all__ = ["MODES", "QuantizedRows", "WanBlock", "install", "installed", "restore", "unfused_blocks"]
