"""The ``Cosmos3OmniTransformer`` forward split by pathway, over a packed layout
(:mod:`omniloop_kit.packed`).

The understanding (und) pathway is causal over the text prefix and never sees a generation
token, so its keys and values at every layer depend on the prompt alone: :func:`understand` runs
it once per request and branch and returns each layer's ``(k, v)`` as the generation pathway
reads them (``k`` through the und-key norm for gen where the checkpoint has one, rotated). The
generation (gen) pathway — vision, sound and action tokens with full attention over und + gen
keys — is :func:`generate`, once per step and branch, with those K/V concatenated in front of its
own: the same tensors, in the same shapes, as diffusers' ``Cosmos3AttnProcessor`` computes, so the
results are equal bit for bit. The last layer's und attention output and MLP are never computed
(diffusers computes them every step and reads nothing from them).

Also here: the 3-D mRoPE position ids of the packed sequence (text, video latents, 1-D streams),
and the token embedding of one step's modality latents (shared by both CFG branches: the gen
tokens' inputs do not depend on the prompt; their rotary positions do).
"""

from __future__ import annotations

import math
from typing import Any

import torch

Rotary = tuple[torch.Tensor, torch.Tensor]


# -- 3-D mRoPE position ids -------------------------------------------------------------------
def text_positions(n: int, offset: float, as_float: bool) -> tuple[torch.Tensor, float]:
    """``[3, n]`` ids counting up from ``offset`` on all three axes, and the next offset."""
    ids = torch.arange(n, dtype=torch.float32) + offset if as_float else torch.arange(n, dtype=torch.long) + int(offset)
    return ids.unsqueeze(0).expand(3, -1).contiguous(), offset + n


def grid_positions(t: int, h: int, w: int, offset: float, *, reset_spatial: bool, fps: float | None,
                   base_fps: float, compression: int, base_compression: int | None = None,
                   start_frame: int = 0) -> torch.Tensor:
    """``[3, t*h*w]`` ids of a ``(t, h, w)`` token grid: time from ``offset`` (fps-modulated when
    ``fps`` is given and ``t > 1``), rows and columns from 0 (or from ``offset``)."""
    modulated = fps is not None and t > 1
    if modulated:
        tps, base_tps = fps / compression, base_fps / (base_compression or compression)
        frames = torch.arange(t, dtype=torch.float32)
        ti = ((frames + start_frame) / tps * base_tps + offset).view(-1, 1).expand(-1, h * w).flatten()
    else:
        ti = torch.arange(t, dtype=torch.long).view(-1, 1).expand(-1, h * w).flatten() + int(offset) + start_frame
    hi = torch.arange(h, dtype=torch.long).view(1, -1, 1).expand(t, -1, w).flatten()
    wi = torch.arange(w, dtype=torch.long).view(1, 1, -1).expand(t, h, -1).flatten()
    if not reset_spatial:
        hi, wi = hi + int(offset), wi + int(offset)
    if modulated:
        return torch.stack([ti, hi.to(torch.float32), wi.to(torch.float32)], dim=0)
    return torch.stack([ti, hi, wi], dim=0)


def rotary(tf: Any, position_ids: torch.Tensor, device: torch.device, dtype: torch.dtype) -> Rotary:
    """cos and sin ``[N, head_dim]`` of the whole packed sequence (the model's own rotary module)."""
    pos = position_ids.to(device)
    cos, sin = tf.rotary_emb(position_ids=pos.unsqueeze(0) if pos.ndim == 1 else pos.unsqueeze(1),
                             device=device, dtype=dtype)
    return cos.squeeze(0), sin.squeeze(0)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _attend(attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    proc = attn.processor
    one = q.ndim == 3  # one sequence [S, H, D]; else a batch of equally long ones [B, S, H, D]
    if one:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    out = dispatch_attention_fn(q, k, v, is_causal=causal, enable_gqa=True, backend=proc._attention_backend,
                                parallel_config=proc._parallel_config)
    return (out.squeeze(0) if one else out).flatten(-2, -1)


# -- the understanding pathway (once per request and branch) ------------------------------------
def understand(tf: Any, input_ids: torch.Tensor, rot: Rotary) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's und keys (as the gen pathway reads them) and values ``[L, kv_heads, head_dim]``."""
    und = tf.embed_tokens(input_ids)
    cos, sin = rot[0].unsqueeze(1), rot[1].unsqueeze(1)
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    last = len(tf.layers) - 1
    for i, layer in enumerate(tf.layers):
        a = layer.self_attn
        x = layer.input_layernorm(und)
        k = a.norm_k(a.to_k(x).view(-1, a.num_key_value_heads, a.head_dim))
        v = a.to_v(x).view(-1, a.num_key_value_heads, a.head_dim)
        k_gen = a.k_norm_und_for_gen(k) if a.k_norm_und_for_gen is not None else k
        kv.append((_rotate(k_gen, cos, sin), v))
        if i == last:  # nothing reads the und pathway's output
            break
        q = _rotate(a.norm_q(a.to_q(x).view(-1, a.num_attention_heads, a.head_dim)), cos, sin)
        res = und + a.to_out(_attend(a, q, _rotate(k, cos, sin), v, causal=True))
        und = res + layer.mlp(layer.post_attention_layernorm(res))
    return kv


# -- the generation pathway (every step and branch) ---------------------------------------------
def gen_layer(layer: Any, gen: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_und: torch.Tensor,
              v_und: torch.Tensor) -> torch.Tensor:
    """One decoder layer's generation pathway (``cos``/``sin`` ``[G, 1, head_dim]``)."""
    a = layer.self_attn
    lead = gen.shape[:-2]
    x = layer.input_layernorm_moe_gen(gen)
    q = _rotate(a.norm_added_q(a.add_q_proj(x).view(*lead, -1, a.num_attention_heads, a.head_dim)), cos, sin)
    k = _rotate(a.norm_added_k(a.add_k_proj(x).view(*lead, -1, a.num_key_value_heads, a.head_dim)), cos, sin)
    v = a.add_v_proj(x).view(*lead, -1, a.num_key_value_heads, a.head_dim)
    res = gen + a.to_add_out(_attend(a, q, torch.cat([k_und, k], dim=-3), torch.cat([v_und, v], dim=-3),
                                     causal=False))
    return res + layer.mlp_moe_gen(layer.post_attention_layernorm_moe_gen(res))


def generate(tf: Any, gen: torch.Tensor, rot: Rotary, kv: Any, layer_fn: Any = None) -> torch.Tensor:
    """The gen tokens ``[G, hidden]`` (or a batch ``[B, G, hidden]`` of requests with equal
    layouts) through every layer (``kv(i)``: layer ``i``'s und K/V, ``[L, kv_heads, head_dim]`` or
    ``[B, L, ...]``) and the final norm; ``layer_fn``: :func:`gen_layer` or a compiled version of it."""
    cos, sin = rot[0].unsqueeze(1), rot[1].unsqueeze(1)
    run = layer_fn or gen_layer
    for i, layer in enumerate(tf.layers):
        k_und, v_und = kv(i)
        gen = run(layer, gen, cos, sin, k_und, v_und)
    return tf.norm_moe_gen(gen)


# -- one step's modality tokens ---------------------------------------------------------------
def _timestep_embeds(tf: Any, timesteps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    emb_dtype = next(tf.time_embedder.parameters()).dtype
    return tf.time_embedder(tf.time_proj(timesteps * tf.config.timestep_scale).to(emb_dtype)).to(dtype)


def embed_vision(tf: Any, latents: torch.Tensor, grid: tuple[int, int, int], noisy: torch.Tensor,
                 timestep: float) -> torch.Tensor:
    """The vision latents ``[1, C, T, H, W]`` patchified, projected, with the timestep embedding
    added on the noisy frames' tokens: ``[T*h*w, hidden]``."""
    tokens, _ = tf._patchify_and_pack_latents([latents])
    tokens = tf.proj_in(tokens)
    n_noisy = len(noisy) * grid[1] * grid[2]
    ts = torch.full((n_noisy,), timestep, device=latents.device)
    return tf._apply_timestep_embeds_to_noisy_tokens(packed_tokens=tokens,
                                                     packed_timestep_embeds=_timestep_embeds(tf, ts, tokens.dtype),
                                                     noisy_frame_indexes=[noisy], token_shapes=[grid])


def embed_sound(tf: Any, latents: torch.Tensor, timestep: float) -> torch.Tensor:
    """The sound latents ``[C, T]`` projected, plus the modality and timestep embeddings: ``[T, hidden]``
    (every sound frame is noisy)."""
    n = latents.shape[1]
    tokens = tf._pack_sound_latents([latents], [(n, 1, 1)]).to(tf.dtype)
    tokens = tf.audio_proj_in(tokens) + tf.audio_modality_embed
    ts = torch.full((n,), timestep, device=latents.device)
    every = torch.arange(n, device=latents.device, dtype=torch.long)
    return tf._apply_timestep_embeds_to_noisy_tokens(packed_tokens=tokens,
                                                     packed_timestep_embeds=_timestep_embeds(tf, ts, tokens.dtype),
                                                     noisy_frame_indexes=[every], token_shapes=[(n, 1, 1)])


def read_sound(tf: Any, out: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The sound velocity ``[C, T]`` from the gen output at the sound tokens ``idx``."""
    n = len(idx)
    every = torch.arange(n, device=out.device, dtype=torch.long)
    return tf._unpack_sound_latents(tf.audio_proj_out(out[idx]), [(n, 1, 1)], [every])[0]


def embed_action(tf: Any, latents: torch.Tensor, domain: torch.Tensor, noisy: torch.Tensor,
                 timestep: float) -> torch.Tensor:
    """The action latents ``[T, D]`` through the domain's input projection, plus the modality
    embedding and, on the noisy frames, the timestep embedding: ``[T, hidden]``."""
    n = latents.shape[0]
    tokens, ids = tf._pack_action_latents([latents], [(n, 1, 1)], [domain])
    tokens = tf.action_proj_in(tokens.to(tf.dtype), ids.to(device=tokens.device)) + tf.action_modality_embed
    if len(noisy) == 0:
        return tokens
    ts = torch.full((len(noisy),), timestep, device=latents.device)
    return tf._apply_timestep_embeds_to_noisy_tokens(packed_tokens=tokens,
                                                     packed_timestep_embeds=_timestep_embeds(tf, ts, tokens.dtype),
                                                     noisy_frame_indexes=[noisy], token_shapes=[(n, 1, 1)])


def read_action(tf: Any, out: torch.Tensor, idx: torch.Tensor, domain: torch.Tensor, noisy: torch.Tensor,
                n: int) -> torch.Tensor:
    """The action velocity ``[T, D]`` from the gen output at the noisy action tokens ``idx``."""
    ids = domain.reshape(1).expand(len(noisy)).to(device=out.device)
    return tf._unpack_action_latents(tf.action_proj_out(out[idx], ids), [(n, 1, 1)], [noisy])[0]


def read_vision(tf: Any, out: torch.Tensor, idx: torch.Tensor, grid: tuple[int, int, int], noisy: torch.Tensor,
                shape: tuple[int, ...]) -> torch.Tensor:
    """The velocity ``[1, C, T, H, W]`` from the gen output at the noisy tokens ``idx`` (zeros on clean frames)."""
    preds = tf.proj_out(out[idx])
    return tf._unpatchify_and_unpack_latents(preds, token_shapes_vision=[grid], noisy_frame_indexes_vision=[noisy],
                                             original_latent_shapes=[tuple(shape[2:])])[0]


def patch_grid(tf: Any, latent_shape: tuple[int, ...]) -> tuple[int, int, int]:
    p = tf.config.latent_patch_size
    return latent_shape[2], math.ceil(latent_shape[3] / p), math.ceil(latent_shape[4] / p)


__all__ = [
    "embed_action",
    "embed_sound",
    "embed_vision",
    "generate",
    "grid_positions",
    "patch_grid",
    "read_action",
    "read_sound",
    "read_vision",
    "rotary",
    "text_positions",
    "understand",
]
