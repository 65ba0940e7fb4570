"""Stable Audio 3 (diffusers' ``StableAudio3Pipeline``): text encoding, the DiT's outer forward and
the denoise loop, op for op as diffusers does them (bit-exact on CPU float32,
tests/stable_audio/test_parity_sa3.py).

* :func:`encode` — diffusers' ``encode_prompt`` (T5Gemma, the tokenizer's length capped at 256),
  ``encode_duration`` and ``prepare_cross_attention`` (the duration embedding appended as one more
  context token, its mask entry 1); with CFG the negative prompt is encoded too (``""`` when none
  is given — Stable Audio 3 has no zero negative). Rows ``[uncond, cond]``.
* :func:`dit_forward` — ``StableAudio3DiTModel.forward`` (padded text positions replaced by the
  learned padding embedding, the context / global / timestep projections, the zero-initialised
  residual convolutions, patching, the memory tokens prepended) with the blocks through
  :func:`omniloop.interceptors.run_blocks` as :class:`BlockStep` (cache-dit, fbcache, block taps,
  regional compilation). A block interceptor sees ``[B, memory + T, D]``.
* :class:`Denoise` — one ``FlowMatchEulerDiscreteScheduler`` step per ``step()`` over the
  log-SNR sigma schedule (``logsnr_sigma_schedule(steps, -6.2, 2.0)``); the distilled checkpoint's
  ``stochastic_sampling`` re-noise draws from the request's own generator (diffusers' list of
  generators: one per waveform), so a request batched with others draws what it draws alone.
  Requests batch when their clips have the same latent length (the same ``audio.seconds`` frames).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from omniloop.artifacts import Embeddings
from omniloop.context import StageContext
from omniloop.interceptors import BlockContext, run_blocks
from omniloop.loop import LoopState, RequestState
from omniloop_kit.compile import wrapped_blocks
from omniloop_kit.stages import module_device

from . import denoise as sa1
from .resolve import AudioResolved

#: diffusers' ``StableAudio3Pipeline.__call__`` defaults for the noise schedule
LOGSNR_MIN, LOGSNR_MAX = -6.2, 2.0
#: diffusers caps the T5Gemma prompt at 256 tokens whatever the tokenizer says
MAX_TOKENS = 256


# -- text ------------------------------------------------------------------------------------
def _prompt(components: dict[str, Any], text: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tok, te = components["tokenizer"], components["text_encoder"]
    inp = tok([text], padding="max_length", max_length=min(tok.model_max_length, MAX_TOKENS), truncation=True,
              return_tensors="pt")
    ids, mask = inp.input_ids.to(device), inp.attention_mask.to(device)
    te.eval()
    states = te(ids.to(module_device(te)), attention_mask=mask.to(module_device(te)))[0]
    return states.to(device), mask


def _with_duration(states: torch.Tensor, mask: torch.Tensor, glob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``prepare_cross_attention``: the duration embedding as a last context token."""
    context = torch.cat([states, glob.unsqueeze(1).to(states.dtype)], dim=1)
    return context, torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)


def encode(components: dict[str, Any], p: AudioResolved, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The context rows ``[rows, L + 1, D]``, their masks ``[rows, L + 1]`` and the global rows
    ``[rows, D]`` of one waveform (``[uncond, cond]`` with CFG)."""
    de = components["duration_embedder"]
    glob = de(torch.tensor([float(p.end)], dtype=torch.float32, device=device))
    context, mask = _with_duration(*_prompt(components, p.prompt, device), glob)
    if p.cfg:
        neg, neg_mask = _with_duration(*_prompt(components, p.negative_prompt or "", device), glob)
        return torch.cat([neg, context]), torch.cat([neg_mask, mask]), torch.cat([glob, glob])
    return context, mask, glob


# -- the DiT ---------------------------------------------------------------------------------
class BlockStep(nn.Module):
    """One Stable Audio 3 DiT block as ``step(hidden, context, modulation, rope)`` (same weights)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, modulation: torch.Tensor,
                rope: torch.Tensor) -> torch.Tensor:
        return self.block(hidden, context=context, global_modulation=modulation, rope=rope)  # type: ignore[no-any-return]


def block_steps(model: nn.Module) -> list[BlockStep]:
    return wrapped_blocks(model, BlockStep)  # type: ignore[no-any-return]


_ROPE: weakref.WeakKeyDictionary[nn.Module, dict[Any, torch.Tensor]] = weakref.WeakKeyDictionary()


def rope_table(model: Any, length: int, device: torch.device) -> torch.Tensor:
    """``model.rotary_pos_emb(length, device)``, kept per model, length and device."""
    cache = _ROPE.setdefault(model, {})
    key = (length, str(device))
    if key not in cache:
        cache[key] = model.rotary_pos_emb(length, device)
    return cache[key]


def dit_forward(model: Any, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                global_hidden_states: torch.Tensor, encoder_attention_mask: torch.Tensor | None,
                block_ctx: BlockContext | None = None, blocks: Any = None) -> torch.Tensor:
    """``StableAudio3DiTModel.forward`` (no inpainting input) with the blocks through ``run_blocks``:
    latents ``[B, C, T]``, ``timestep`` ``[B]`` → velocity ``[B, C, T]``."""
    cfg = model.config
    if encoder_attention_mask is not None:  # padded text positions → the learned padding embedding
        keep = encoder_attention_mask.bool().unsqueeze(-1)
        pad = model.prompt_padding_embedding.to(encoder_hidden_states.dtype).view(1, 1, -1)
        encoder_hidden_states = torch.where(keep, encoder_hidden_states, pad)
    context = model.to_cond_embed(encoder_hidden_states)
    time = model.to_timestep_embed(model.timestep_features(timestep.float()[:, None]).to(hidden_states.dtype))
    modulation = model.global_cond_embedder(model.to_global_embed(global_hidden_states) + time)
    hidden = model.preprocess_conv(hidden_states) + hidden_states
    x = hidden.transpose(1, 2)
    patch, memory = int(cfg.patch_size), int(cfg.num_memory_tokens)
    if patch > 1:
        b, t, c = x.shape
        x = x.reshape(b, t // patch, c * patch)
    x = model.proj_in(x)
    if memory > 0:
        x = torch.cat([model.memory_tokens.unsqueeze(0).expand(x.shape[0], -1, -1), x], dim=1)
    rope = rope_table(model, x.shape[1], x.device)

    def call(step: Any, h: torch.Tensor) -> torch.Tensor:
        return step(h, context, modulation, rope)  # type: ignore[no-any-return]

    x = run_blocks(block_steps(model) if blocks is None else blocks, x, block_ctx, call)
    if memory > 0:
        x = x[:, memory:]
    x = model.proj_out(x)
    if patch > 1:
        b, tp, cp = x.shape
        x = x.reshape(b, tp * patch, cp // patch)
    out = x.transpose(1, 2)
    return model.postprocess_conv(out) + out  # type: ignore[no-any-return]


# -- the denoise loop ------------------------------------------------------------------------
def sigmas(steps: int) -> list[float]:
    """diffusers' ``logsnr_sigma_schedule(steps, -6.2, 2.0)`` (full generation: sigma_max 1)."""
    from diffusers.pipelines.stable_audio_3.pipeline_stable_audio_3 import logsnr_sigma_schedule

    return logsnr_sigma_schedule(steps, LOGSNR_MIN, LOGSNR_MAX)


class Denoise(sa1.Denoise):
    """Stable Audio 3's loop: one flow-match (Euler or stochastic ping-pong) step per ``step()``;
    batched across requests of equal latent length (the base class's ``step_batch`` layout:
    every request's uncond row, then every cond row)."""

    ROWS = (*sa1.Denoise.ROWS, "encoder_attention_mask")
    #: the flow-match scheduler's noise is one randn from the request's generator: nothing to prefetch
    PREFETCH_NOISE = False

    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        from diffusers.utils.torch_utils import randn_tensor

        p = sa1._params(state)
        template = ctx.components["scheduler"]
        scheduler = type(template).from_config(template.config)
        scheduler.set_timesteps(sigmas=sigmas(p.steps), device=ctx.device)
        context = state.read("conditioning", Embeddings).tensor
        shape = (1, p.latent_channels, p.latent_length)
        loop = LoopState(total=p.steps, branches=(sa1.CFG_FORWARD,) if p.cfg else ("cond",))
        loop.tensors["latents"] = randn_tensor(shape, generator=sa1._generator(state), device=ctx.device,
                                               dtype=context.dtype)
        loop.extra["scheduler"] = scheduler
        loop.extra["t_values"] = scheduler.timesteps.tolist()
        return loop

    def inputs(self, state: RequestState, loop: LoopState) -> dict[str, torch.Tensor]:
        p = sa1._params(state)
        t = loop.extra["scheduler"].timesteps[loop.step]
        lat = loop.tensors["latents"]
        cond = state.read("conditioning", Embeddings)
        return {"hidden_states": torch.cat([lat, lat]) if p.cfg else lat, "timestep": t,
                "encoder_hidden_states": cond.tensor, "global_hidden_states": cond.extra["global"],
                "encoder_attention_mask": cond.extra["mask"]}

    def forward(self, ctx: StageContext, batch: dict[str, torch.Tensor], block_ctx: BlockContext | None) -> torch.Tensor:
        from .compile import blocks_for

        tf = ctx.components["transformer"]
        x = batch["hidden_states"]
        return dit_forward(tf, x, batch["timestep"].expand(x.shape[0]), batch["encoder_hidden_states"],
                           batch["global_hidden_states"], batch["encoder_attention_mask"], block_ctx,
                           blocks=blocks_for(tf, ctx))

    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None:
        key = super().batch_key(ctx, state, loop)
        return None if key is None else ("stable-audio-3", key)


__all__ = ["BlockStep", "Denoise", "block_steps", "dit_forward", "encode", "rope_table", "sigmas"]
