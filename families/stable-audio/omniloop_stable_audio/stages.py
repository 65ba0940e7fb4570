"""The nodes of the ``t2a`` pipeline: ``validate`` → ``text_encode`` → ``denoise`` → ``vae_decode`` → ``output``.

Each stage does what diffusers' ``StableAudioPipeline`` does at that point with the same tensor
operations, so the results match diffusers bit for bit on CPU in float32
(tests/stable_audio/test_parity.py). ``text_encode`` writes the conditioning rows of the request's
forward — ``[uncond, cond]`` with CFG (uncond first, as diffusers concatenates them), ``[cond]``
without — as one ``Embeddings``: ``tensor`` the cross-attention input (projected T5 states, then
the start- and end-second states) ``[rows, L + 2, cond]``, ``extra["global"]`` the DiT's global
input (start and end states side by side) ``[rows, 1, 2 * cond]``. ``vae_decode`` is a one-step
loop node (:class:`VaeDecode`: batched decodes).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from omniloop.artifacts import Audio, Conditioning, Embeddings, Latents, Tensors
from omniloop.context import StageContext
from omniloop.loop import LoopState, RequestState, StepResult
from omniloop_kit.stages import module_device, params_of, return_latents

from .resolve import AudioResolved, resolve


class Validate:
    """The request's resolved parameters onto the ``params`` edge."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        resolved = getattr(ctx, "resolved", None)
        params = resolved if isinstance(resolved, AudioResolved) else resolve(self.model, state.request)
        if params.warnings:
            known = state.metrics.setdefault("warnings", [])
            known.extend(w for w in params.warnings if w not in known)
        state.write("params", Conditioning(values={"params": params}), ctx.node.name)


def t5_states(components: dict[str, Any], text: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """T5 states ``[1, max_length, D]`` of ``text`` and its attention mask (padded to the tokenizer's length)."""
    tok, te = components["tokenizer"], components["text_encoder"]
    inp = tok([text], padding="max_length", max_length=tok.model_max_length, truncation=True, return_tensors="pt")
    ids, mask = inp.input_ids.to(device), inp.attention_mask.to(device)
    states = te(ids.to(module_device(te)), attention_mask=mask.to(module_device(te)))[0]
    return states.to(device), mask


def encode(components: dict[str, Any], p: AudioResolved, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``encode_prompt`` + ``encode_duration`` + the zero negative: the cross-attention
    rows and global rows of one waveform (``[uncond, cond]`` with CFG)."""
    proj = components["projection_model"]
    negative = p.cfg and p.negative_prompt is not None
    states, mask = t5_states(components, p.prompt, device)
    if negative:
        neg, neg_mask = t5_states(components, p.negative_prompt or "", device)
        neg = torch.where(neg_mask.to(torch.bool).unsqueeze(2), neg, 0.0)
        states, mask = torch.cat([neg, states]), torch.cat([neg_mask, mask])
    states = proj(text_hidden_states=states).text_hidden_states
    states = states * mask.unsqueeze(-1).to(states.dtype)
    states = states * mask.unsqueeze(-1).to(states.dtype)  # diffusers applies the mask twice (a no-op the 2nd time)
    seconds = proj(start_seconds=torch.tensor([p.start]).to(device), end_seconds=torch.tensor([p.end]).to(device))
    start, end = seconds.seconds_start_hidden_states, seconds.seconds_end_hidden_states
    if negative:
        start, end = torch.cat([start, start], dim=0), torch.cat([end, end], dim=0)
    text = torch.cat([states, start, end], dim=1)
    glob = torch.cat([start, end], dim=2)
    if p.cfg and not negative:  # no negative prompt: the uncond row is all zeros, seconds included
        text = torch.cat([torch.zeros_like(text, device=text.device), text], dim=0)
        glob = torch.cat([glob, glob], dim=0)
    return text, glob


class TextEncode:
    """Prompt, negative prompt and the window's seconds → ``conditioning`` (rows uncond, cond)."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p: AudioResolved = params_of(state)
        with torch.no_grad():
            if p.sa3:
                from . import sa3

                text, mask, glob = sa3.encode(ctx.components, p, ctx.device)
                extra = {"global": glob, "mask": mask}
            else:
                text, glob = encode(ctx.components, p, ctx.device)
                extra = {"global": glob}
        state.write("conditioning", Embeddings(tensor=text, extra=extra), ctx.node.name)


class VaeDecode:
    """The denoised latents through the Oobleck decoder (the whole clip).

    A one-step loop node, so that the step scheduler can decode equally shaped requests as one
    batch — the samples of a ``diffusion.num_outputs`` group finish denoising together, and one
    batched decode is what diffusers does with ``num_waveforms_per_prompt`` (the decoder's
    convolutions round differently for other batch sizes on CPU). No interceptor opens on it
    (it declares no guidance branch)."""

    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        loop = LoopState(total=1, branches=())
        loop.tensors["latents"] = state.read("denoised", Latents).tensor
        return loop

    @staticmethod
    def decode(ctx: StageContext, latents: torch.Tensor) -> torch.Tensor:
        vae = ctx.components["vae"]
        with torch.no_grad():
            return vae.decode(latents.to(module_device(vae))).sample  # type: ignore[no-any-return]

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        loop.tensors["audio"] = self.decode(ctx, loop.tensors["latents"])
        return StepResult(done=True)

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        state.write("decoded", Tensors(values={"audio": loop.tensors.pop("audio")}), ctx.node.name)

    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None:
        if state.request.exact or ctx.taps_enabled or "audio" in loop.tensors:
            return None
        z = loop.tensors["latents"]
        return ("stable-audio-decode", tuple(z.shape), str(z.dtype), str(z.device))

    def step_batch(self, ctxs: Sequence[StageContext], states: Sequence[RequestState],
                   loops: Sequence[LoopState]) -> list[StepResult]:
        audio = self.decode(ctxs[0], torch.cat([lp.tensors["latents"] for lp in loops]))
        for lp, part in zip(loops, audio.split(1), strict=True):
            lp.tensors["audio"] = part
        return [StepResult(done=True) for _ in loops]


class Output:
    """``audio``: the request's window cut out of the decoded clip (diffusers'
    ``audio[:, :, int(start * rate):int(end * rate)]``) as float32 ``[channels, n]`` on the CPU;
    ``latents`` ``[1, C, T]`` with ``outputs.return_latents``."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        p: AudioResolved = params_of(state)
        audio = state.read("decoded", Tensors).values["audio"]
        audio = audio[:, :, p.sample_start:p.sample_end]
        if p.sa3:  # Stable Audio 3 clamps its cut clip
            audio = audio.clamp(-1.0, 1.0)
        samples = audio[0].float().cpu().contiguous()
        rate = int(ctx.components["vae"].config.sampling_rate)
        state.write("audio", Audio(samples=samples, sample_rate=rate), ctx.node.name)
        if ctx.taps_enabled:
            ctx.tap("audio", samples, None)
        return_latents(ctx, state, "audio")


__all__ = ["Output", "TextEncode", "VaeDecode", "Validate", "encode", "t5_states"]
