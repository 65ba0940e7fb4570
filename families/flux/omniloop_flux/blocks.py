"""omniloop-owned forwards of FLUX.1's double- and single-stream blocks.

:class:`DoubleBlock` and :class:`SingleBlock` stand in for diffusers' ``FluxTransformerBlock`` and
``FluxSingleTransformerBlock`` in the transformer's ``transformer_blocks`` / ``single_transformer_blocks``
lists. They hold the *same* child modules under the same names (same parameters, same state-dict keys:
weight updates, LoRA adapters, FP8 linears and offload hooks find them where they were) and take the
same arguments; with nothing asked of them they compute diffusers' operations in diffusers' order, so
their outputs are ``torch.equal`` to diffusers' (tests/flux/test_blocks.py). :func:`install` puts them
in, :func:`restore` puts diffusers' blocks back. The family installs them only when a deploy asks for
what diffusers' forwards cannot do:

* ``options.modulation: per-request`` — a block takes its AdaLN modulation (``norm.linear(silu(temb))``,
  the shift / scale / gate vectors) ready-made, as ``modulation``: a row of the request's
  :func:`modulation_table`. The table holds every step's modulations of every block (and of the output
  norm), computed once per request as one GEMM per norm linear over all the request's timesteps —
  instead of one matrix-vector product per linear per step, which reads all 3.2 B modulation weights
  (6.4 GB in bf16) from memory at every step of FLUX.1-dev. The table's GEMMs have ``steps`` rows where
  the per-step products have one, so the modulations may differ from diffusers' in the last bit
  (float reassociation); the rest of the forward is unchanged.
* ``options.ffn_gelu: fused`` — a single block's MLP (``proj_mlp``, tanh GELU) as one cuBLASLt matmul
  with the GELU in its epilogue, and ``proj_out`` of ``[attention ; mlp]`` as two matmuls over the two
  column blocks of its weight (``W[:, :dim]`` for the attention output, ``W[:, dim:]`` for the MLP), so
  the ``tokens x (dim + 4 dim)`` concatenation is never written and the GELU pass over the widest tensor
  of the block disappears. Within bf16 rounding of diffusers (the GELU is applied to the float32
  accumulator; the two partial products are rounded before their sum), not bit-equal. On CUDA only
  (refused elsewhere at load, :func:`omniloop_kit.ffn.ffn_option`); with ``proj_mlp`` / ``proj_out``
  replaced by another module (FP8 linears, a LoRA layer) the block computes diffusers' form.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from omniloop_kit import blocks as kit_blocks

#: values of ``options.modulation``
MODULATION_MODES = ("per-step", "per-request")

def _chunks(emb: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    return emb.chunk(n, dim=1)


def _modulated(norm: nn.Module, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift`` as diffusers' ``AdaLayerNormZero`` / ``-Single`` compute it."""
    return norm(x) * (1 + scale[:, None]) + shift[:, None]


class DoubleBlock(nn.Module):
    """diffusers' ``FluxTransformerBlock`` forward over the block's own modules; ``modulation``:
    ``[B, 12 dim]`` (the image stream's six vectors, then the text stream's) instead of computing them
    from ``temb``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        for name in ("norm1", "norm1_context", "attn", "norm2", "ff", "norm2_context", "ff_context"):
            setattr(self, name, getattr(block, name))

    def modulation_linears(self) -> list[nn.Module]:
        return [self.norm1.linear, self.norm1_context.linear]

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor | None,
                image_rotary_emb: Any = None, joint_attention_kwargs: dict[str, Any] | None = None,
                modulation: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if modulation is None:
            emb = self.norm1.linear(self.norm1.silu(temb))
            c_emb = self.norm1_context.linear(self.norm1_context.silu(temb))
        else:
            emb, c_emb = modulation.chunk(2, dim=1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _chunks(emb, 6)
        norm_hidden_states = _modulated(self.norm1.norm, hidden_states, shift_msa, scale_msa)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = _chunks(c_emb, 6)
        norm_encoder_hidden_states = _modulated(self.norm1_context.norm, encoder_hidden_states, c_shift_msa, c_scale_msa)

        attention_outputs = self.attn(hidden_states=norm_hidden_states, encoder_hidden_states=norm_encoder_hidden_states,
                                      image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
        attn_output, context_attn_output = attention_outputs[0], attention_outputs[1]

        hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
        norm_hidden_states = self.norm2(hidden_states)
        norm_hidden_states = norm_hidden_states * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        hidden_states = hidden_states + gate_mlp.unsqueeze(1) * self.ff(norm_hidden_states)
        if len(attention_outputs) == 3:  # an IP-adapter processor's third output, as diffusers adds it
            hidden_states = hidden_states + attention_outputs[2]

        encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
        norm_encoder_hidden_states = self.norm2_context(encoder_hidden_states)
        norm_encoder_hidden_states = norm_encoder_hidden_states * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * self.ff_context(norm_encoder_hidden_states)
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        return encoder_hidden_states, hidden_states


class SingleBlock(nn.Module):
    """diffusers' ``FluxSingleTransformerBlock`` forward over the block's own modules; ``modulation``:
    ``[B, 3 dim]``; ``fused_mlp``: the MLP and output projection as described in the module docstring."""

    def __init__(self, block: nn.Module, *, fused_mlp: bool = False) -> None:
        super().__init__()
        for name in ("norm", "proj_mlp", "act_mlp", "proj_out", "attn"):
            setattr(self, name, getattr(block, name))
        self.mlp_hidden_dim = block.mlp_hidden_dim
        self.fused_mlp = fused_mlp

    def modulation_linears(self) -> list[nn.Module]:
        return [self.norm.linear]

    def _fusable(self, x: torch.Tensor) -> bool:
        plain = type(self.proj_mlp) is nn.Linear and type(self.proj_out) is nn.Linear  # not FP8 / LoRA layers
        return self.fused_mlp and plain and x.is_cuda and self.proj_mlp.bias is not None

    def _mlp_and_out(self, x: torch.Tensor, attn_output: torch.Tensor) -> torch.Tensor:
        """``proj_out([attn_output ; gelu(proj_mlp(x))])`` without the concatenation (see the module docstring)."""
        dim = attn_output.shape[-1]
        flat = x.reshape(-1, x.shape[-1])
        if flat.is_cuda:  # cuBLASLt: bias and tanh GELU in the epilogue, on the float32 accumulator
            mlp = torch._addmm_activation(self.proj_mlp.bias, flat, self.proj_mlp.weight.t(), use_gelu=True)
        else:  # the same form in two ops (what the CPU tests check the split projection with)
            mlp = F.gelu(F.linear(flat, self.proj_mlp.weight, self.proj_mlp.bias), approximate="tanh")
        weight = self.proj_out.weight  # [dim, dim + mlp_hidden_dim]: column blocks, no copy
        out = torch.addmm(self.proj_out.bias, mlp, weight[:, dim:].t())
        out = torch.addmm(out, attn_output.reshape(-1, dim), weight[:, :dim].t())
        return out.view(*attn_output.shape)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor | None,
                image_rotary_emb: Any = None, joint_attention_kwargs: dict[str, Any] | None = None,
                modulation: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        residual = hidden_states
        emb = self.norm.linear(self.norm.silu(temb)) if modulation is None else modulation
        shift_msa, scale_msa, gate = _chunks(emb, 3)
        norm_hidden_states = _modulated(self.norm.norm, hidden_states, shift_msa, scale_msa)
        if self._fusable(norm_hidden_states):
            attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                                    **(joint_attention_kwargs or {}))
            out = self._mlp_and_out(norm_hidden_states, attn_output)
        else:
            mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))
            attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                                    **(joint_attention_kwargs or {}))
            out = self.proj_out(torch.cat([attn_output, mlp_hidden_states], dim=2))
        hidden_states = residual + gate.unsqueeze(1) * out
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def install(model: nn.Module, *, fused_mlp: bool = False) -> int:
    """Put :class:`DoubleBlock` / :class:`SingleBlock` in place of ``model``'s diffusers blocks (in
    place, sharing their modules: :mod:`omniloop_kit.blocks`); returns how many. Installed again, it only
    updates ``fused_mlp``."""
    if kit_blocks.replaced(model):
        for block in model.single_transformer_blocks:
            block.fused_mlp = fused_mlp
        return len(model.transformer_blocks) + len(model.single_transformer_blocks)
    for block in model.transformer_blocks:
        if getattr(block.norm1, "emb", None) is not None:  # a class-embedding AdaLN: not FLUX.1's
            raise ValueError("omniloop_flux.blocks: a double block's norm1 embeds its own timestep")
    return kit_blocks.replace(model, {"transformer_blocks": DoubleBlock,
                                      "single_transformer_blocks": lambda b: SingleBlock(b, fused_mlp=fused_mlp)})


def restore(model: nn.Module) -> int:
    """Put diffusers' blocks back (no-op when :func:`install` was not called); returns how many."""
    return kit_blocks.restore(model)


def installed(model: nn.Module) -> bool:
    return kit_blocks.replaced(model)


def modulation_linears(model: nn.Module) -> list[nn.Module]:
    """Every modulation linear in table order: each double block's two, each single block's one, the
    output norm's (needs :func:`install`)."""
    out: list[nn.Module] = []
    for block in (*model.transformer_blocks, *model.single_transformer_blocks):
        out += block.modulation_linears()
    return [*out, model.norm_out.linear]


def modulation_widths(model: nn.Module) -> list[int]:
    """The table's column blocks: one per block (both of a double block's linears together), then the
    output norm's."""
    widths = [2 * b.norm1.linear.out_features for b in model.transformer_blocks]
    widths += [b.norm.linear.out_features for b in model.single_transformer_blocks]
    return [*widths, model.norm_out.linear.out_features]


def modulation_table(model: nn.Module, temb: torch.Tensor) -> torch.Tensor:
    """``[S, sum(widths)]``: for each of ``S`` rows of ``temb`` (the time/guidance/pooled-text
    embedding of each step), every block's modulation and the output norm's, in table order — what
    the blocks would compute from ``temb`` step by step, as one GEMM per linear over the ``S`` rows."""
    act = F.silu(temb)
    parts = [linear(act) for linear in modulation_linears(model)[:-1]]
    parts.append(model.norm_out.linear(model.norm_out.silu(temb).to(temb.dtype)))
    return torch.cat(parts, dim=1)


def split_modulation(model: nn.Module, row: torch.Tensor) -> list[torch.Tensor]:
    """A table row ``[B, total]`` as one view per block, then the output norm's ``[B, 2 dim]``."""
    return list(row.split(modulation_widths(model), dim=1))


__all__ = ["MODULATION_MODES", "DoubleBlock", "SingleBlock", "install", "installed", "modulation_linears",
           "modulation_table", "modulation_widths", "restore", "split_modulation"]
