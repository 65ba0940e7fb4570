"""The outer forward of diffusers' ``WanTransformer3DModel``, owned by omniloop.

:func:`wan_forward` does what ``WanTransformer3DModel.forward`` does — patch embedding, rotary
embedding, time / text / image conditioning, output norm and projection, unpatchify — with the
same tensor operations in the same order, so that with nothing bound its output is
``torch.equal`` to diffusers'. The one difference: the block stack runs through
:func:`omniloop.interceptors.run_blocks`, so block interceptors (DBCache, first-block cache) and
block taps can see and skip blocks.

The blocks themselves (attention, feed-forward) are diffusers' own modules and weights.
Keep this module small: it is the only place that knows the model's outer structure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omniloop.interceptors import BlockContext, run_blocks

from .attention import set_token_grid


def embed(model: Any, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
          encoder_hidden_states_image: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The forward up to the blocks: ``(tokens [B, S, inner], temb, timestep_proj, context, grid)``
    — patch embedding, time / text / image conditioning (``grid``: the token grid ``(F, H, W)``;
    the CLIP image states, when given, come first in ``context``). Shared by :func:`wan_forward`,
    the sequence-parallel forward and the causal chunk forward."""
    _b, _c, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = model.config.patch_size
    grid = (num_frames // p_t, height // p_h, width // p_w)
    hidden_states = model.patch_embedding(hidden_states)
    hidden_states = hidden_states.flatten(2).transpose(1, 2).contiguous()
    if timestep.ndim == 2:  # one timestep per token (Wan2.2 TI2V)
        ts_seq_len = timestep.shape[1]
        timestep = timestep.flatten()
    else:
        ts_seq_len = None
    temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = model.condition_embedder(
        timestep, encoder_hidden_states, encoder_hidden_states_image, timestep_seq_len=ts_seq_len
    )
    # [B, seq_len, 6, inner] per token, else [B, 6, inner]
    timestep_proj = timestep_proj.unflatten(2 if ts_seq_len is not None else 1, (6, -1))
    if encoder_hidden_states_image is not None:
        encoder_hidden_states = torch.concat([encoder_hidden_states_image, encoder_hidden_states], dim=1)
    return hidden_states, temb, timestep_proj, encoder_hidden_states, grid


def head(model: Any, hidden_states: torch.Tensor, temb: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """The forward after the blocks: output norm, projection and unpatchify to ``[B, C, F, H, W]``."""
    if temb.ndim == 3:
        shift, scale = (model.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift = shift.squeeze(2)
        scale = scale.squeeze(2)
    else:
        shift, scale = (model.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    shift = shift.to(hidden_states.device)
    scale = scale.to(hidden_states.device)
    hidden_states = (model.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
    hidden_states = model.proj_out(hidden_states)
    hidden_states = hidden_states.reshape(hidden_states.shape[0], *grid, *model.config.patch_size, -1)
    hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def wan_forward(
    model: Any,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_image: torch.Tensor | None = None,
    block_ctx: BlockContext | None = None,
    blocks: Sequence[Any] | None = None,
) -> torch.Tensor:
    """Predict the flow for ``hidden_states`` ``[B, C, F, H, W]`` at ``timestep``.

    ``timestep`` is ``[B]`` (Wan2.1, Wan2.2 A14B) or ``[B, seq_len]`` (Wan2.2 TI2V, one timestep
    per latent token). ``encoder_hidden_states`` are the text-encoder states ``[B, L, text_dim]``;
    ``encoder_hidden_states_image`` the CLIP states of Wan2.1 I2V models, or None.
    ``blocks`` replaces ``model.blocks`` (the same blocks compiled, see :mod:`omniloop_wan.compile`).
    Returns the prediction ``[B, out_channels, F, H, W]``.
    """
    rotary_emb = model.rope(hidden_states)
    hidden, temb, proj, context, grid = embed(model, hidden_states, timestep, encoder_hidden_states,
                                              encoder_hidden_states_image)
    # backends that take the token grid are told it (eager, before the blocks)
    set_token_grid(model, grid, hidden_states.device)

    # the block stack, through omniloop (interceptors may skip or reuse blocks)
    def call(block: Any, hidden: torch.Tensor) -> torch.Tensor:
        return block(hidden, context, proj, rotary_emb)

    hidden = run_blocks(model.blocks if blocks is None else blocks, hidden, block_ctx, call)
    return head(model, hidden, temb, grid)
