"""The Wan transformer run block-causally over chunks of latent frames, with a chunk KV cache.

A *chunk* is ``chunk_frames`` latent frames (``tokens = chunk_frames * (H/p_h) * (W/p_w)``
tokens). Chunk ``i`` attends to itself (bidirectionally) and to the *clean* keys/values of the
earlier chunks still in the window; it never sees later chunks. The weights are the ordinary
diffusers ``WanTransformer3DModel`` weights (a causal checkpoint — CausVid, Self-Forcing — has
the same layout); only the self-attention's key/value set changes.

Two ways to run the same math:

* :func:`chunk_forward` — one chunk, its self-attention reading the cached clean K/V of earlier
  chunks (``context``) and, when ``record`` is given, handing back this chunk's own per-layer K/V
  (after ``norm_k`` and RoPE) so that the caller writes them to a slab once the chunk is final;
* :func:`masked_forward` — the whole sequence at once, no cache, one timestep per token and a
  boolean attention mask (omniloop-kit's :func:`~omniloop_kit.causal.block_causal_mask`). This is the reference the cached rollout
  is tested against (tests/wan_causal/test_rollout.py).

Every other operation (patch embedding, time/text conditioning, modulation, cross-attention,
FFN, output norm, unpatchify) is diffusers' ``WanTransformer3DModel.forward`` /
``WanTransformerBlock.forward`` with the same tensor ops in the same order: with no context and
no mask, :func:`chunk_forward` is ``torch.equal`` to diffusers' forward (tested). RoPE positions
are absolute latent-frame indices, so a chunk's keys are the same wherever it is computed.
Wan2.1 I2V (CLIP image context) is not supported here (``added_kv_proj`` is refused).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from omniloop_kit.causal import block_causal_mask, chunk_visibility

from ..attention import apply_rotary_emb
from ..transformer import embed, head

#: ``record(layer, k, v)`` — receives one layer's self-attention keys/values ``[B, S, H, D]``
Recorder = Callable[[int, torch.Tensor, torch.Tensor], None]
#: ``context(layer)`` — the cached keys/values ``[B, L, H, D]`` of earlier chunks (L may be 0)
Context = Callable[[int], tuple[torch.Tensor, torch.Tensor] | None]


def check_model(model: Any) -> None:
    """Refuse transformers this module cannot run causally (one clear error, before compute)."""
    for block in model.blocks:
        if getattr(block.attn2, "add_k_proj", None) is not None:
            raise ValueError("causal rollout: Wan2.1 I2V transformers (CLIP image context) are not supported")
    if int(model.config.patch_size[0]) != 1:
        raise ValueError(f"causal rollout: needs a temporal patch size of 1, got {tuple(model.config.patch_size)}")


def rope(model: Any, frame0: int, frames: int, pph: int, ppw: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (cos, sin) ``[1, frames*pph*ppw, 1, head_dim]`` for latent frames ``frame0 ..
    frame0+frames-1`` — diffusers' ``WanRotaryPosEmbed.forward`` with a frame offset."""
    if frame0 + frames > model.rope.freqs_cos.shape[0]:
        raise ValueError(
            f"causal rollout: latent frame {frame0 + frames - 1} is past the model's RoPE table "
            f"({model.rope.freqs_cos.shape[0]} positions, the transformer's rope_max_seq_len)"
        )
    return _rope_tables(model, torch.arange(frame0, frame0 + frames), pph, ppw)


def rope_at(model: Any, frames: Sequence[int], pph: int, ppw: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (cos, sin) like :func:`rope` for an arbitrary list of latent-frame positions (a
    frame index may repeat: training puts a clean and a noisy copy of a chunk at the same
    positions, see ``omniloop_wan_demo_training.train_causal``)."""
    r = model.rope
    pos = torch.as_tensor(list(frames), dtype=torch.long)
    if pos.numel() == 0 or int(pos.min()) < 0 or int(pos.max()) >= r.freqs_cos.shape[0]:
        raise ValueError(f"causal rollout: frame positions must lie in [0, {r.freqs_cos.shape[0]}), "
                         "the transformer's rope_max_seq_len")
    return _rope_tables(model, pos, pph, ppw)


def _rope_tables(model: Any, pos: torch.Tensor, pph: int, ppw: int) -> tuple[torch.Tensor, torch.Tensor]:
    r = model.rope
    n = pos.numel()
    out = []
    for table in (r.freqs_cos, r.freqs_sin):
        t, h, w = table.split([r.t_dim, r.h_dim, r.w_dim], dim=1)
        ft = t[pos.to(t.device)].view(n, 1, 1, -1).expand(n, pph, ppw, -1)
        fh = h[:pph].view(1, pph, 1, -1).expand(n, pph, ppw, -1)
        fw = w[:ppw].view(1, 1, ppw, -1).expand(n, pph, ppw, -1)
        out.append(torch.cat([ft, fh, fw], dim=-1).reshape(1, n * pph * ppw, 1, -1))
    return out[0], out[1]


def self_attention(
    attn: Any,
    x: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    *,
    layer: int,
    context: Context | None = None,
    record: Recorder | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``attn1`` of a Wan block over ``x`` ``[B, S, C]``, its keys extended with ``context(layer)``."""
    if attn.fused_projections:
        q, k, v = attn.to_qkv(x).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
    q = attn.norm_q(q)
    k = attn.norm_k(k)
    q = q.unflatten(2, (attn.heads, -1))
    k = k.unflatten(2, (attn.heads, -1))
    v = v.unflatten(2, (attn.heads, -1))
    q = apply_rotary_emb(q, *rotary)
    k = apply_rotary_emb(k, *rotary)
    if record is not None:
        record(layer, k, v)
    ctx = context(layer) if context is not None else None
    if ctx is not None and ctx[0].shape[1]:
        k = torch.cat([ctx[0].to(k.dtype), k], dim=1)
        v = torch.cat([ctx[1].to(v.dtype), v], dim=1)
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    out = out.permute(0, 2, 1, 3).flatten(2, 3).type_as(q)
    out = attn.to_out[0](out)
    return attn.to_out[1](out)


def block_forward(
    block: Any, hidden: torch.Tensor, text: torch.Tensor, temb: torch.Tensor,
    attend: Callable[[Any, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``WanTransformerBlock.forward`` with its self-attention ``attend(block.attn1, x)`` (:func:`self_attention`
    bound to the block's layer, RoPE tables, K/V context, recorder and mask)."""
    if temb.ndim == 4:  # one modulation per token
        mods = (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        shift, scale, gate, c_shift, c_scale, c_gate = (m.squeeze(2) for m in mods)
    else:
        shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table + temb.float()).chunk(6, dim=1)
    norm = (block.norm1(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    out = attend(block.attn1, norm)
    hidden = (hidden.float() + out * gate).type_as(hidden)
    norm = block.norm2(hidden.float()).type_as(hidden)
    hidden = hidden + block.attn2(norm, text, None, None)
    norm = (block.norm3(hidden.float()) * (1 + c_scale) + c_shift).type_as(hidden)
    ff = block.ffn(norm)
    return (hidden.float() + ff.float() * c_gate).type_as(hidden)


def _forward(
    model: Any,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    text: torch.Tensor,
    frame0: int,
    *,
    context: Context | None,
    record: Recorder | None,
    mask: torch.Tensor | None,
    positions: Sequence[int] | None = None,
) -> torch.Tensor:
    frames = latents.shape[2]
    hidden, temb, proj, text, grid = embed(model, latents, timestep, text)
    if positions is None:
        rotary = rope(model, frame0, frames, grid[1], grid[2])
    else:
        if len(positions) != frames:
            raise ValueError(f"positions: one per latent frame ({frames}), got {len(positions)}")
        rotary = rope_at(model, positions, grid[1], grid[2])
    rotary = (rotary[0].to(latents.device), rotary[1].to(latents.device))
    for i, block in enumerate(model.blocks):
        attend = partial(self_attention, rotary=rotary, layer=i, context=context, record=record, mask=mask)
        hidden = block_forward(block, hidden, text, proj, attend)
    return head(model, hidden, temb, grid)


def chunk_forward(
    model: Any,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    text: torch.Tensor,
    frame0: int,
    *,
    context: Context | None = None,
    record: Recorder | None = None,
) -> torch.Tensor:
    """The flow prediction for one chunk ``latents`` ``[B, C, f, H, W]`` whose first latent
    frame is ``frame0`` (its RoPE position), at ``timestep`` ``[B]``, attending to
    ``context(layer)``'s cached K/V too. ``record(layer, k, v)`` receives this chunk's K/V."""
    return _forward(model, latents, timestep, text, frame0, context=context, record=record, mask=None)


def masked_forward(
    model: Any, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, mask: torch.Tensor,
    *, positions: Sequence[int] | None = None,
) -> torch.Tensor:
    """The whole sequence ``[B, C, F, H, W]`` at once with per-token ``timestep`` ``[B, S]`` and
    a boolean self-attention ``mask`` ``[S, S]`` (True = may attend): the uncached reference.
    ``positions`` (one RoPE latent-frame index per frame; default ``0..F-1``) lets a sequence
    hold two copies of the same frames (teacher-forcing training)."""
    return _forward(model, latents, timestep, text, 0, context=None, record=None, mask=mask, positions=positions)


__all__ = [
    "block_causal_mask",
    "block_forward",
    "check_model",
    "chunk_forward",
    "chunk_visibility",
    "masked_forward",
    "rope",
    "rope_at",
    "self_attention",
]
