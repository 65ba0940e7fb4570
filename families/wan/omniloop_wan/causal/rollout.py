"""Causal chunk rollout: denoise a video chunk by chunk, each chunk attending to the clean K/V
of the earlier ones, and hand each finished chunk (latents, and frames when a VAE is given) out
as soon as it is done.

Per chunk ``i`` (``chunk_frames`` latent frames, RoPE frames ``i*chunk_frames ..``):

1. noise from a generator seeded by ``(seed, i)`` — a chunk's noise does not depend on how the
   video was split into requests, so a session continued twice equals one long request;
2. ``steps`` flow-Euler steps (sigmas ``linspace(1, 0, steps + 1)`` with the flow ``shift``,
   timestep ``1000 * sigma``), each one :func:`.model.chunk_forward` over the chunk with the
   cached slabs as context;
3. one more forward of the clean chunk at ``context_timestep`` (0: clean) that records its K/V,
   written once as the chunk's slab (:class:`.kv.ChunkKV`); the window slides;

With classifier-free guidance (a stream opened with ``cfg=True``; guidance-distilled causal
checkpoints run without, the default ``guidance_scale`` 1) every chunk runs a conditional and an
unconditional branch, each with **its own slabs**: the unconditional branch's context is the
clean chunks' K/V computed with the negative prompt's text states. Both branches go through one
batch-2 forward when the two text states have the same shape (else two forwards); the step uses
``v = v_uncond + g * (v_cond - v_uncond)`` (diffusers' ``WanPipeline`` combination) and the
clean chunk both branches record is the guided one.

Image conditioning of the first chunk (engine level, :meth:`CausalWan.open_stream`'s
``first_latents``): the first ``p`` latent frames of chunk 0 are given clean latents (an image
encoded by the causal VAE is one latent frame, :func:`encode_first_frame`); they stay fixed
through the chunk's steps with their tokens at ``context_timestep`` (Wan2.2 TI2V's
``expand_timesteps`` scheme: ``x = mask * x + (1 - mask) * condition``, per-token timesteps). When
``p == chunk_frames`` chunk 0 *is* the image: no sampler step runs, its context forward writes its
slab and the decoder reconstructs the image as frame 0. The runtime's ``rollout: causal`` pipeline
does not expose it (text-to-video only).
4. the chunk's latents are VAE-decoded incrementally (:class:`.vae.StreamingDecoder`).

:meth:`CausalWan.reference` runs the same schedule without a cache: every step one
:func:`.model.masked_forward` over all clean chunks so far plus the noisy one, with the
block-causal (windowed) mask — the test oracle.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
from attrs import define, field

from omniloop_kvcache import CacheManager

from .kv import ChunkKV, chunk_layout, slabs_needed
from .model import block_causal_mask, check_model, chunk_forward, masked_forward
from .vae import StreamingDecoder


def _pos_int(name: str) -> Any:
    def check(_i: Any, _a: Any, v: Any) -> None:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"rollout_options.{name}: must be a positive integer, got {v!r}")
    return check


def _finite(name: str, lo: float, hi: float) -> Any:
    def check(_i: Any, _a: Any, v: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            raise ValueError(f"rollout_options.{name}: must be a finite number in [{lo}, {hi}], got {v!r}")
    return check


def _window(_i: Any, _a: Any, v: Any) -> None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        raise ValueError(f"rollout_options.window: must be null or a positive integer (chunks, itself included), got {v!r}")


def _sink(_i: Any, _a: Any, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"rollout_options.sink: must be a non-negative integer (chunks), got {v!r}")


@define(frozen=True)
class CausalOptions:
    """The deploy's ``rollout: causal`` settings (``options.rollout_options`` / ``omniloop.json``)."""

    chunk_frames: int = field(default=3, validator=_pos_int("chunk_frames"))
    steps: int = field(default=4, validator=_pos_int("steps"))
    shift: float = field(default=5.0, validator=_finite("shift", 0.01, 100.0))
    window: int | None = field(default=None, validator=_window)  # chunks attended, itself included
    sink: int = field(default=0, validator=_sink)  # first chunks always kept when windowed
    context_timestep: float = field(default=0.0, validator=_finite("context_timestep", 0.0, 1000.0))
    #: the CFG scale when a request gives none (1: no CFG, what guidance-distilled checkpoints want)
    guidance_scale: float = field(default=1.0, validator=_finite("guidance_scale", 0.0, 100.0))
    max_sessions: int = field(default=4, validator=_pos_int("max_sessions"))
    session_ttl_s: float = field(default=600.0, validator=_finite("session_ttl_s", 0.001, 86400.0 * 7))
    kv_slabs: int = field(default=64, validator=_pos_int("kv_slabs"))  # the slab pool's size

    def sigmas(self) -> list[float]:
        base = torch.linspace(1.0, 0.0, self.steps + 1, dtype=torch.float64)
        s = self.shift * base / (1 + (self.shift - 1) * base)
        return [float(x) for x in s]


@define
class ChunkOut:
    """One finished chunk: its index, latents ``[1, z, f, h, w]`` and, with a VAE, its frames
    ``[1, 3, T, H, W]`` in [-1, 1] (``None`` without a decoder)."""

    index: int
    latents: torch.Tensor
    video: torch.Tensor | None = None


class Stream:
    """One video in progress: its slabs (and, with CFG, the unconditional branch's slabs), its
    VAE feature cache and where it has got to."""

    def __init__(self, kv: ChunkKV, decoder: StreamingDecoder | None, seed: int,
                 kv_uncond: ChunkKV | None = None, first_latents: torch.Tensor | None = None) -> None:
        self.kv = kv
        self.kv_uncond = kv_uncond
        self.first_latents = first_latents  # clean latents fixed at the start of chunk 0 (image conditioning)
        self.decoder = decoder
        self.seed = seed
        self.next_chunk = 0

    @property
    def cfg(self) -> bool:
        """Was the stream opened with classifier-free guidance (two sets of slabs)?"""
        return self.kv_uncond is not None

    def free(self) -> None:
        self.kv.free()
        if self.kv_uncond is not None:
            self.kv_uncond.free()
        self.decoder = None


def encode_first_frame(vae: Any, image: torch.Tensor) -> torch.Tensor:
    """The normalised latents ``[1, z, 1, h, w]`` (as the transformer sees them) of one image
    ``[1, 3, H, W]`` in [-1, 1]: the causal VAE encodes a first frame on its own (posterior mode,
    then ``(z - latents_mean) / latents_std`` as the Wan pipelines do)."""
    if image.ndim != 4 or image.shape[0] != 1 or image.shape[1] != 3:
        raise ValueError(f"image: expected [1, 3, H, W] in [-1, 1], got {list(image.shape)}")
    if not torch.isfinite(image).all():
        raise ValueError("image: has non-finite values")
    p = next(vae.parameters())
    with torch.no_grad():
        z = vae.encode(image[:, :, None].to(p.device, p.dtype)).latent_dist.mode()
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    return (z - mean) / std


def _pair_context(a: ChunkKV, b: ChunkKV) -> Any:
    """A context for a batch-2 forward: row 0 reads ``a``'s slabs, row 1 ``b``'s."""
    def context(layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        ca, cb = a.context(layer), b.context(layer)
        if ca is None or cb is None:
            return None
        return torch.cat([ca[0], cb[0]], dim=0), torch.cat([ca[1], cb[1]], dim=0)
    return context


def _pair_record(a: ChunkKV, b: ChunkKV) -> Any:
    def record(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        a.record(layer, k[:1], v[:1])
        b.record(layer, k[1:], v[1:])
    return record


def chunk_noise(seed: int, index: int, shape: Sequence[int]) -> torch.Tensor:
    """The noise of chunk ``index`` (float32, CPU generator: the same on every device)."""
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + index) % (2**63))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32)


class CausalWan:
    """Chunk rollout of one Wan transformer (+ optional VAE) at one latent size.

    ``height`` / ``width`` are the *video* size; the slab pool (one :class:`CacheManager`,
    ``options.kv_slabs`` chunks of ``tokens_per_chunk`` tokens) is sized for it.
    """

    def __init__(self, transformer: Any, vae: Any = None, *, options: CausalOptions | None = None,
                 height: int, width: int, manager: CacheManager | None = None) -> None:
        check_model(transformer)
        self.model = transformer
        self.vae = vae
        self.options = options or CausalOptions()
        sf = 8 if vae is None else int(getattr(vae.config, "scale_factor_spatial", 8))
        _, ph, pw = transformer.config.patch_size
        if height % (sf * ph) or width % (sf * pw) or height < 1 or width < 1:
            raise ValueError(f"causal rollout: height and width must be positive multiples of {sf * ph}, got {height}x{width}")
        self.height, self.width = height, width
        self.latent_hw = (height // sf, width // sf)
        self.channels = int(transformer.config.out_channels)
        self.tokens_per_chunk = self.options.chunk_frames * (self.latent_hw[0] // ph) * (self.latent_hw[1] // pw)
        self.manager = manager or CacheManager(
            chunk_layout(transformer), block_size=self.tokens_per_chunk, num_blocks=self.options.kv_slabs, name="chunk-kv"
        )
        if self.manager.block_size != self.tokens_per_chunk:
            raise ValueError(f"causal rollout: the slab pool holds {self.manager.block_size} tokens per block, "
                             f"a chunk has {self.tokens_per_chunk}")

    # -- streams ----------------------------------------------------------------------------------
    def open_stream(self, seed: int, reserve_chunks: int = 0, *, cfg: bool = False,
                    first_latents: torch.Tensor | None = None) -> Stream:
        """A new stream; ``cfg`` gives it a second set of slabs for the unconditional branch;
        ``first_latents`` ``[1, z, p, h, w]`` (``1 <= p <= chunk_frames``, normalised, e.g.
        :func:`encode_first_frame`) conditions the first chunk on them (raises ``CacheFull`` when
        the pool cannot reserve its slabs)."""
        o = self.options
        if first_latents is not None:
            want = (1, self.channels, *self.latent_hw)
            got = tuple(first_latents.shape)
            if first_latents.ndim != 5 or (got[0], got[1], got[3], got[4]) != want or not 1 <= got[2] <= o.chunk_frames:
                raise ValueError(f"first_latents: expected [1, {self.channels}, 1..{o.chunk_frames}, "
                                 f"{self.latent_hw[0]}, {self.latent_hw[1]}], got {list(got)}")
            if not torch.isfinite(first_latents).all():
                raise ValueError("first_latents: has non-finite values")
        kv = ChunkKV(self.manager, window=o.window, sink=o.sink, reserve_chunks=reserve_chunks)
        kv_u = None
        if cfg:
            try:
                kv_u = ChunkKV(self.manager, window=o.window, sink=o.sink, reserve_chunks=reserve_chunks)
            except BaseException:
                kv.free()
                raise
        return Stream(kv, StreamingDecoder(self.vae) if self.vae is not None else None, seed, kv_u,
                      None if first_latents is None else first_latents.detach().clone())

    def slabs_for(self, chunks: int, cfg: bool = False) -> int:
        return slabs_needed(chunks, self.options.window, self.options.sink) * (2 if cfg else 1)

    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        return (1, self.channels, self.options.chunk_frames, *self.latent_hw)

    def _dev(self) -> tuple[torch.device, torch.dtype]:
        p = next(self.model.parameters())
        return p.device, p.dtype

    def check_guidance(self, stream: Stream, uncond: torch.Tensor | None, guidance: float | None) -> float:
        """The guidance scale this chunk runs with; refuses what the stream cannot do (before compute)."""
        g = self.options.guidance_scale if guidance is None else guidance
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or not 0.0 <= g <= 100.0:
            raise ValueError(f"guidance_scale: must be a finite number in [0, 100], got {g!r}")
        if stream.cfg and uncond is None:
            raise ValueError("causal rollout: this stream runs classifier-free guidance; give the unconditional text states (uncond)")
        if not stream.cfg and g != 1.0:
            raise ValueError(f"causal rollout: guidance_scale {g:g} needs a stream opened with cfg=True "
                             "(its unconditional branch has its own slabs from the first chunk on)")
        return float(g)

    @torch.no_grad()
    def denoise_chunk(self, stream: Stream, text: torch.Tensor, steps: int | None = None,
                      shift: float | None = None, *, uncond: torch.Tensor | None = None,
                      guidance: float | None = None) -> torch.Tensor:
        """Denoise the stream's next chunk with ``text`` states ``[1, L, D]`` (``steps``, ``shift``,
        ``guidance``: the options' unless given; ``uncond``: the negative prompt's states, needed
        by a CFG stream); commit its slab(s)."""
        o = self.options
        if steps is not None or shift is not None:
            o = attrs.evolve(o, steps=o.steps if steps is None else steps, shift=o.shift if shift is None else shift)
        g = self.check_guidance(stream, uncond, guidance)
        dev, dt = self._dev()
        i = stream.next_chunk
        frame0 = i * o.chunk_frames
        x = chunk_noise(stream.seed, i, self.chunk_shape()).to(dev, dt)
        text = text.to(dev, dt)
        sig = o.sigmas()
        t_ctx = torch.full((1,), o.context_timestep, device=dev, dtype=dt)
        fixed = stream.first_latents.to(dev, dt) if i == 0 and stream.first_latents is not None else None
        p = 0 if fixed is None else fixed.shape[2]
        if fixed is not None:
            x[:, :, :p] = fixed
            if p == o.chunk_frames:
                sig = []  # the whole chunk is given: nothing to denoise

        def step_t(s: float, batch: int) -> torch.Tensor:
            if fixed is None:
                return torch.full((batch,), s * 1000.0, device=dev, dtype=dt)
            per = self.tokens_per_chunk // o.chunk_frames
            t = torch.full((batch, self.tokens_per_chunk), s * 1000.0, device=dev, dtype=dt)
            t[:, : p * per] = o.context_timestep
            return t

        def refix(x: torch.Tensor) -> torch.Tensor:
            if fixed is not None:
                x[:, :, :p] = fixed
            return x

        if not stream.cfg:
            for s, s_next in itertools.pairwise(sig):
                v = chunk_forward(self.model, x, step_t(s, 1), text, frame0, context=stream.kv.context)
                x = refix((x.float() + (s_next - s) * v.float()).to(dt))
            chunk_forward(self.model, x, t_ctx, text, frame0, context=stream.kv.context, record=stream.kv.record)
            stream.kv.commit()
        else:
            assert uncond is not None and stream.kv_uncond is not None
            kc, ku = stream.kv, stream.kv_uncond
            uncond = uncond.to(dev, dt)
            batched = uncond.shape == text.shape
            both = torch.cat([text, uncond], dim=0) if batched else None
            for s, s_next in itertools.pairwise(sig):
                if batched:
                    v_c, v_u = chunk_forward(self.model, torch.cat([x, x], dim=0), step_t(s, 2), both, frame0,
                                             context=_pair_context(kc, ku)).float().chunk(2, dim=0)
                else:
                    t = step_t(s, 1)
                    v_c = chunk_forward(self.model, x, t, text, frame0, context=kc.context).float()
                    v_u = chunk_forward(self.model, x, t, uncond, frame0, context=ku.context).float()
                v = v_u + g * (v_c - v_u)
                x = refix((x.float() + (s_next - s) * v).to(dt))
            if batched:
                chunk_forward(self.model, torch.cat([x, x], dim=0), t_ctx.expand(2), both, frame0,
                              context=_pair_context(kc, ku), record=_pair_record(kc, ku))
            else:
                chunk_forward(self.model, x, t_ctx, text, frame0, context=kc.context, record=kc.record)
                chunk_forward(self.model, x, t_ctx, uncond, frame0, context=ku.context, record=ku.record)
            kc.commit()
            ku.commit()
        stream.next_chunk += 1
        return x

    def run(self, stream: Stream, text: torch.Tensor, chunks: int, *, decode: bool = True,
            steps: int | None = None, shift: float | None = None, uncond: torch.Tensor | None = None,
            guidance: float | None = None) -> Iterator[ChunkOut]:
        """Generate ``chunks`` more chunks of ``stream``, yielding each as soon as it is final."""
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks: must be a positive integer, got {chunks!r}")
        self.check_guidance(stream, uncond, guidance)
        return self._run(stream, text, chunks, decode, steps, shift, uncond, guidance)

    def _run(self, stream: Stream, text: torch.Tensor, chunks: int, decode: bool, steps: int | None,
             shift: float | None, uncond: torch.Tensor | None, guidance: float | None) -> Iterator[ChunkOut]:
        for _ in range(chunks):
            lat = self.denoise_chunk(stream, text, steps, shift, uncond=uncond, guidance=guidance)
            video = stream.decoder.decode(lat) if decode and stream.decoder is not None else None
            yield ChunkOut(stream.next_chunk - 1, lat, video)

    def run_schedule(self, stream: Stream, schedule: Sequence[tuple[torch.Tensor, int]], *,
                     decode: bool = True, uncond: torch.Tensor | None = None,
                     guidance: float | None = None) -> Iterator[ChunkOut]:
        """One request over several prompts: ``schedule`` is ``[(text, chunks), ...]`` in order."""
        for text, chunks in schedule:
            yield from self.run(stream, text, chunks, decode=decode, uncond=uncond, guidance=guidance)

    # -- the uncached oracle ----------------------------------------------------------------------
    @torch.no_grad()
    def reference(self, text: torch.Tensor, chunks: int, seed: int, *, uncond: torch.Tensor | None = None,
                  guidance: float | None = None, first_latents: torch.Tensor | None = None) -> torch.Tensor:
        """The same rollout of ``chunks`` chunks with ``text`` and no cache: every step is one
        :func:`.model.masked_forward` over the clean chunks so far (at ``context_timestep``) plus
        the noisy one (at the step's timestep), with the block-causal (windowed) mask. With
        ``uncond`` (CFG) a second masked forward over the same sequence with the unconditional
        text gives ``v_uncond`` (its clean chunks' keys are the unconditional branch's), combined
        as ``v_uncond + g (v_cond - v_uncond)``. Returns the latents ``[1, z, chunks*f, h, w]``."""
        g = self.options.guidance_scale if guidance is None else float(guidance)
        o = self.options
        dev, dt = self._dev()
        f = o.chunk_frames
        n = self.tokens_per_chunk
        text = text.to(dev, dt)
        clean: list[torch.Tensor] = []
        sig = o.sigmas()
        for i in range(chunks):
            x = chunk_noise(seed, i, self.chunk_shape()).to(dev, dt)
            p = first_latents.shape[2] if i == 0 and first_latents is not None else 0
            if p:
                x[:, :, :p] = first_latents.to(dev, dt)
            mask = block_causal_mask([n] * (i + 1), o.window, o.sink).to(dev)
            for s, s_next in (itertools.pairwise(sig) if p < f else ()):
                seq = torch.cat([*clean, x], dim=2)
                ts = torch.cat([torch.full((n * i,), o.context_timestep), torch.full((n,), s * 1000.0)])
                ts[: p * (n // f)] = o.context_timestep  # the given frames' tokens are clean
                v = masked_forward(self.model, seq, ts.to(dev, dt)[None], text, mask)[:, :, i * f :].float()
                if uncond is not None:
                    v_u = masked_forward(self.model, seq, ts.to(dev, dt)[None], uncond.to(dev, dt), mask)[:, :, i * f :].float()
                    v = v_u + g * (v - v_u)
                x = (x.float() + (s_next - s) * v).to(dt)
                if p:
                    x[:, :, :p] = first_latents.to(dev, dt)
            clean.append(x)
        return torch.cat(clean, dim=2)


__all__ = ["CausalOptions", "CausalWan", "ChunkOut", "Stream", "chunk_noise", "encode_first_frame"]
