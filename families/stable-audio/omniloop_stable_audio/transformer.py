"""The outer forward of diffusers' ``StableAudioDiTModel``, owned by omniloop.

:func:`dit_forward` does what ``StableAudioDiTModel.forward`` does — cross-attention projection
of the text/seconds states, global (seconds) projection plus the timestep embedding as one
prepended token, the 1x1 pre/post convolutions, input/output projections — with the same tensor
operations in the same order, so that with nothing bound its output is ``torch.equal`` to
diffusers'. The difference: the DiT blocks run through :func:`omniloop.interceptors.run_blocks`
(as :class:`BlockStep` wrappers with one positional signature), so block interceptors (cache-dit,
first-block cache), block taps, cancellation within a step and regional compilation
(:mod:`omniloop_stable_audio.compile`) see them. The hidden state a block interceptor sees is
``[B, 1 + T, D]``: the global token, then the latent frames.

The blocks themselves (self-attention with partial rotary embeddings, GQA cross-attention, SwiGLU
feed-forward) are diffusers' modules and weights; their attention runs through diffusers'
processor, or :class:`omniloop_stable_audio.attention.StableAudioAttention` with the deploy's
attention backend.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from omniloop.interceptors import BlockContext, run_blocks
from omniloop_kit.compile import wrapped_blocks


class BlockStep(nn.Module):
    """One DiT block as ``step(hidden, cross, rotary)`` (a wrapper: same weights)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor, cross: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.block(hidden_states=hidden, attention_mask=None, encoder_hidden_states=cross,
                          encoder_attention_mask=None, rotary_embedding=rotary)


_ROTARY: weakref.WeakKeyDictionary[nn.Module, dict[Any, tuple[torch.Tensor, torch.Tensor]]] = weakref.WeakKeyDictionary()


def block_steps(model: nn.Module) -> list[BlockStep]:
    """The model's blocks as :class:`BlockStep` wrappers (built once per model, omniloop-kit)."""
    return wrapped_blocks(model, BlockStep)


def rotary_embedding(model: Any, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' pipeline rotary table (``get_1d_rotary_pos_embed(head_dim // 2, length,
    use_real=True, repeat_interleave_real=False)``) for ``length`` tokens, kept per model and device."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    cache = _ROTARY.setdefault(model, {})
    key = (length, str(device))
    got = cache.get(key)
    if got is None:
        cos, sin = get_1d_rotary_pos_embed(int(model.config.attention_head_dim) // 2, length, use_real=True,
                                           repeat_interleave_real=False)
        got = cache[key] = (cos.to(device), sin.to(device))
    return got


def dit_forward(
    model: Any,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    global_hidden_states: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    block_ctx: BlockContext | None = None,
    blocks: Sequence[Any] | None = None,
) -> torch.Tensor:
    """Predict for latents ``hidden_states`` ``[B, C, T]`` at ``timestep`` (``[1]`` or ``[B]``).

    ``encoder_hidden_states``: the projected text states with the start/end-second states
    ``[B, L + 2, cond]``; ``global_hidden_states``: start and end states side by side
    ``[B, 1, 2 * cond]``; ``rotary``: :func:`rotary_embedding` for ``T + 1`` tokens. ``blocks``
    replaces the eager :func:`block_steps` (the same steps compiled). Returns ``[B, C, T]``."""
    cross = model.cross_attention_proj(encoder_hidden_states)
    glob = model.global_proj(global_hidden_states)
    time = model.timestep_proj(model.time_proj(timestep.to(model.dtype)))
    glob = glob + time.unsqueeze(1)
    hidden = model.preprocess_conv(hidden_states) + hidden_states
    hidden = hidden.transpose(1, 2)
    hidden = model.proj_in(hidden)
    hidden = torch.cat([glob, hidden], dim=-2)

    def call(step: Any, h: torch.Tensor) -> torch.Tensor:
        return step(h, cross, rotary)  # type: ignore[no-any-return]

    hidden = run_blocks(block_steps(model) if blocks is None else blocks, hidden, block_ctx, call)
    hidden = model.proj_out(hidden)
    hidden = hidden.transpose(1, 2)[:, :, 1:]
    return model.postprocess_conv(hidden) + hidden  # type: ignore[no-any-return]


__all__ = ["BlockStep", "block_steps", "dit_forward", "rotary_embedding"]
