"""The outer forward of diffusers' ``FluxTransformer2DModel``, owned by omniloop.

:func:`flux_forward` does what ``FluxTransformer2DModel.forward`` does — input projection, time /
guidance / pooled-text embedding, context projection, rotary embedding of the text and image
position ids, output norm and projection — with the same tensor operations in the same order, so
with nothing bound its output is ``torch.equal`` to diffusers'. The difference: the 19 double-stream
and 38 single-stream blocks run as *one* stack through :func:`omniloop.interceptors.run_blocks`,
so block interceptors (cache-dit, first-block cache), block taps and parity see every block.

``run_blocks`` carries one tensor: the image tokens. The text tokens, which every Flux block also
updates (``(encoder_hidden_states, hidden_states) = block(...)``), ride along beside it in the call
closure. A skipping interceptor therefore reuses image-stream residuals and leaves the text stream
as the last block that ran left it — which matches cache-dit's own Flux integration exactly when no
trailing blocks run after a cache hit (``Bn = 0``, its default): the text stream is dropped after
the last block. Taps and interceptors see the image stream only.

Two per-request constants can be passed in instead of being recomputed at every step (the family
does, computing them once per request with :func:`request_constants`): the projected text states
(``context_embedder`` of the T5 states) and the rotary embedding of the position ids. Same ops,
same values: the output is unchanged.

A third per-request constant replaces the time embedding altogether: ``modulation``, one row of
the request's modulation table (:func:`omniloop_flux.blocks.modulation_table`, deploy
``options.modulation: per-request``) — every block's AdaLN shift/scale/gate vectors and the output
norm's for this step; the blocks must then be omniloop's (:mod:`omniloop_flux.blocks`).

The blocks are diffusers' modules and weights, run by diffusers' block forwards or, when a deploy
option needs it, by omniloop's owned ones over the same modules (:mod:`omniloop_flux.blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omniloop.interceptors import BlockContext, run_blocks

from .blocks import split_modulation


def all_blocks(model: Any) -> list[Any]:
    """The double-stream blocks, then the single-stream blocks: the stack ``run_blocks`` runs."""
    return [*model.transformer_blocks, *model.single_transformer_blocks]


def request_constants(
    model: Any, encoder_hidden_states: torch.Tensor, img_ids: torch.Tensor, txt_ids: torch.Tensor
) -> tuple[torch.Tensor, Any]:
    """(projected text states, rotary embedding): what :func:`flux_forward` computes from its
    text states and position ids, which do not change between the steps of a request."""
    return model.context_embedder(encoder_hidden_states), model.pos_embed(torch.cat((txt_ids, img_ids), dim=0))


def time_embedding(model: Any, timestep: torch.Tensor, guidance: torch.Tensor | None, pooled: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """``temb`` ``[B, D]``: the transformer's time (+ guidance) + pooled-text embedding, as diffusers'
    forward computes it from ``timestep`` (and ``guidance``) in [0, 1]."""
    timestep = timestep.to(dtype) * 1000
    if guidance is not None:
        return model.time_text_embed(timestep, guidance.to(dtype) * 1000, pooled)
    return model.time_text_embed(timestep, pooled)


def flux_forward(
    model: Any,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    pooled_projections: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None = None,
    img_ids: torch.Tensor | None = None,
    txt_ids: torch.Tensor | None = None,
    guidance: torch.Tensor | None = None,
    block_ctx: BlockContext | None = None,
    blocks: Sequence[Any] | None = None,
    context: torch.Tensor | None = None,
    image_rotary_emb: Any = None,
    modulation: torch.Tensor | None = None,
) -> torch.Tensor:
    """Predict the flow for packed latents ``hidden_states`` ``[B, N, 4C]``.

    ``timestep`` is ``[B]`` in [0, 1] (the scheduler's timestep / 1000, as the pipeline passes it);
    ``guidance`` ``[B]`` for guidance-distilled checkpoints (``guidance_embeds``), else None;
    ``encoder_hidden_states`` the T5 states ``[B, L, D]``, ``pooled_projections`` CLIP's pooled
    output ``[B, D']``; ``img_ids`` ``[N, 3]`` and ``txt_ids`` ``[L, 3]`` the position ids.
    ``blocks`` replaces :func:`all_blocks` (the same blocks compiled). ``context`` and
    ``image_rotary_emb`` (from :func:`request_constants`) replace ``encoder_hidden_states`` and the
    ids. ``modulation`` ``[B, total]`` (a row of :func:`omniloop_flux.blocks.modulation_table`)
    replaces the time embedding: ``timestep``, ``guidance`` and ``pooled_projections`` are then
    not read. Returns ``[B, N, 4C]``.
    """
    hidden_states = model.x_embedder(hidden_states)
    temb = time_embedding(model, timestep, guidance, pooled_projections, hidden_states.dtype) if modulation is None else None
    if context is None:
        assert encoder_hidden_states is not None, "flux_forward needs encoder_hidden_states or context"
        context = model.context_embedder(encoder_hidden_states)
    if image_rotary_emb is None:
        assert img_ids is not None and txt_ids is not None, "flux_forward needs the ids or image_rotary_emb"
        image_rotary_emb = model.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
    encoder = [context]
    kwargs: dict[str, Any] = {}
    stack = all_blocks(model) if blocks is None else list(blocks)
    extra: dict[int, dict[str, torch.Tensor]] = {}
    if modulation is not None:
        *per_block, out_mod = split_modulation(model, modulation)
        extra = {id(block): {"modulation": m} for block, m in zip(stack, per_block, strict=True)}

    def call(block: Any, hidden: torch.Tensor) -> torch.Tensor:
        more = extra.get(id(block), {})
        if modulation is not None and not more:
            raise RuntimeError("flux_forward: a block outside the stack its modulation rows were split for")
        enc, out = block(
            hidden_states=hidden, encoder_hidden_states=encoder[0], temb=temb,
            image_rotary_emb=image_rotary_emb, joint_attention_kwargs=kwargs, **more,
        )
        encoder[0] = enc
        return out

    hidden_states = run_blocks(stack, hidden_states, block_ctx, call)
    if modulation is None:
        hidden_states = model.norm_out(hidden_states, temb)
    else:  # diffusers' AdaLayerNormContinuous with its linear's output given
        scale, shift = torch.chunk(out_mod, 2, dim=1)
        hidden_states = model.norm_out.norm(hidden_states) * (1 + scale)[:, None, :] + shift[:, None, :]
    return model.proj_out(hidden_states)
