"""The outer forward of diffusers' ``SD3Transformer2DModel``, owned by omniloop.

:func:`sd3_forward` does what ``SD3Transformer2DModel.forward`` does — patch + position embedding,
timestep + pooled-text embedding, context projection, output norm and projection, unpatchify —
with the same tensor operations in the same order, so that with nothing bound its output is
``torch.equal`` to diffusers'. The difference: the joint (MMDiT) blocks run through
:func:`omniloop.interceptors.run_blocks`, so block interceptors (cache-dit, first-block cache),
block taps and the parity/trace observers see them.

A joint block updates two streams (text context and image tokens), while a block interceptor or
a block tap takes one hidden tensor. When one is bound (``block_ctx`` given), the stack runs on
the *joint sequence* ``[context ; image]`` (``[B, L_txt + L_img, D]``): :class:`JointStep` splits
it, runs the diffusers block on the two views and concatenates the results (the last block,
``context_pre_only``, leaves the context as it was); an interceptor that caches residuals sees
both streams, as cache-dit's own SD3 adapter does. When nothing is bound, ``run_blocks`` is a
plain loop and the pair ``(context, image)`` goes from block to block as it is (no concatenation
per block). Both forms move values without changing them: the result is bit-exact either way.
The blocks themselves (attention with q/k RMS norm, SD3.5-medium's dual attention,
feed-forwards) are diffusers' modules and weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from omniloop.interceptors import BlockContext, run_blocks
from omniloop_kit.compile import wrapped_blocks


class JointStep(nn.Module):
    """One joint block on the joint sequence ``[context ; image]`` (a wrapper: same weights)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: Any, temb: torch.Tensor, txt_len: int) -> Any:
        """``hidden``: the joint sequence ``[B, L_txt + L_img, D]`` or the pair ``(context, image)``;
        returns the same form."""
        pair = isinstance(hidden, tuple)
        context, image = hidden if pair else (hidden[:, :txt_len], hidden[:, txt_len:])
        new_context, new_image = self.block(hidden_states=image, encoder_hidden_states=context, temb=temb)
        if new_context is None:  # the last block (context_pre_only) updates only the image tokens
            new_context = context
        if pair:
            return new_context, new_image
        return torch.cat([new_context, new_image], dim=1)


def joint_steps(model: nn.Module) -> list[JointStep]:
    """The model's blocks as :class:`JointStep` wrappers (built once per model)."""
    return wrapped_blocks(model, JointStep)


def sd3_forward(
    model: Any,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    pooled_projections: torch.Tensor,
    block_ctx: BlockContext | None = None,
    blocks: Sequence[Any] | None = None,
) -> torch.Tensor:
    """Predict the flow for latents ``hidden_states`` ``[B, C, H, W]`` at ``timestep`` ``[B]``.

    ``encoder_hidden_states`` is the joint text context ``[B, L_txt, joint_attention_dim]`` (CLIP-L
    and CLIP-G states padded to the T5 width, then T5 states); ``pooled_projections`` the pooled
    CLIP embeddings ``[B, pooled_projection_dim]``. ``blocks`` replaces the eager
    :func:`joint_steps` (the same steps compiled). Returns ``[B, out_channels, H, W]``.
    """
    height, width = hidden_states.shape[-2:]
    hidden_states = model.pos_embed(hidden_states).contiguous()
    temb = model.time_text_embed(timestep, pooled_projections)
    encoder_hidden_states = model.context_embedder(encoder_hidden_states)
    txt_len = encoder_hidden_states.shape[1]

    def call(step: Any, hidden: Any) -> Any:
        return step(hidden, temb, txt_len)

    steps = joint_steps(model) if blocks is None else blocks
    if block_ctx is None:  # nothing bound: a plain loop carrying the pair (context, image)
        pair = (encoder_hidden_states, hidden_states)
        _, hidden_states = run_blocks(steps, pair, None, call)  # type: ignore[arg-type,misc]
    else:  # an interceptor or block taps: one joint tensor [context ; image]
        joint = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        hidden_states = run_blocks(steps, joint, block_ctx, call)[:, txt_len:]

    hidden_states = model.norm_out(hidden_states, temb)
    hidden_states = model.proj_out(hidden_states)

    p = model.config.patch_size
    h, w = height // p, width // p
    hidden_states = hidden_states.reshape(hidden_states.shape[0], h, w, p, p, model.out_channels)
    hidden_states = torch.einsum("nhwpqc->nchpwq", hidden_states)
    return hidden_states.reshape(hidden_states.shape[0], model.out_channels, h * p, w * p)


__all__ = ["JointStep", "joint_steps", "sd3_forward"]
