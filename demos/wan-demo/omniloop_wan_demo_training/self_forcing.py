"""The causal student's own rollout, Self-Forcing style (issue 41): what the DMD2 recipe
(:mod:`.dmd`) trains ``wan-demo-causal`` with.

At inference the runtime's ``rollout: causal`` (omniloop-kit's
:class:`~omniloop_kit.causal.CausalEngine`, Wan's :class:`~omniloop_wan.causal.CausalWan`) makes a
clip chunk by chunk: chunk ``i``'s noise is denoised by ``steps`` steps
(:meth:`~omniloop_kit.causal.CausalOptions.sigmas`, timestep ``1000 sigma``; ``sampler: euler``
``x <- x + (s' - s) v``, or ``sampler: fresh`` the x0 prediction re-noised with fresh noise),
each a :func:`~omniloop_wan.causal.chunk_forward` reading the clean keys/values of the chunks before
it; then one forward of the finished chunk at ``context_timestep`` records its keys/values.

:func:`causal_rollout` runs exactly that, for a training batch (the engine's slabs hold one stream;
:class:`BatchKV` holds a batch's in memory, same visibility: every earlier chunk, or the window's
last ``window - 1`` plus ``sink`` first ones), so the student is trained on the very clips it
streams — its own earlier chunks as context, never the data's (Self-Forcing; teacher forcing in
:mod:`.train_causal` trains on clean data context instead). Gradient (our choice, Self-Forcing's):

* per chunk one **exit step** ``k`` (of ``steps``): steps before ``k`` run without gradient; step
  ``k`` runs with gradient and its x0 prediction ``x + (0 - s_k) v`` is the chunk's output (at the
  last step that *is* the sampler's final Euler step to sigma 0, so an all-last rollout is the
  runtime's rollout); later steps are skipped;
* the context forward of the finished chunk runs without gradient on the detached output (the
  keys/values later chunks read carry no gradient), so the backward is one chunk forward per chunk;
* :class:`SelfForcingRollout` draws the exit steps uniformly per chunk from the training generator
  (``exit="random"``, every timestep of the sampler gets gradient) or takes the last
  (``exit="last"``, the runtime's rollout exactly);
* between a chunk's steps the rollout moves as the runtime's default sampler does
  (``renoise="euler"``: the x0 prediction re-noised with the predicted noise) or as DMD2's
  few-step sampler does (``renoise="fresh"``: re-noised with fresh noise), both the kit's
  :func:`~omniloop_kit.causal.causal_step`; by default it follows ``options.sampler``. A student
  trained with ``fresh`` is served with ``rollout_options.sampler: "fresh"``. The fresh noise comes
  from the training generator, or, given each stream's ``seeds``, from the runtime's own
  :func:`~omniloop_kit.causal.step_noise` (then the rollout is the runtime's, bit for bit).

The student runs without classifier-free guidance (``guidance_scale`` 1: the guided teacher is
distilled into it); its clip, all chunks concatenated, goes to the recipe's distribution-matching
loss against the bidirectional teacher. ``tests/demos/wan_demo/test_self_forcing.py`` checks the
rollout without gradient against ``Runtime.stream`` of the same transformer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from omniloop_kit.causal import SAMPLERS, CausalOptions, causal_step, chunk_noise, chunk_visibility, step_noise

EXITS = ("random", "last")
#: how the rollout moves between a chunk's steps (:func:`causal_rollout`): the runtime's samplers
RENOISE = SAMPLERS


class BatchKV:
    """The clean chunks' keys/values of a batch of streams (per layer ``[B, tokens, heads, dim]``),
    in memory; ``context`` / ``record`` / ``commit`` plug into ``chunk_forward`` as
    :class:`~omniloop_kit.causal.ChunkKV` does for one stream."""

    def __init__(self, window: int | None = None, sink: int = 0) -> None:
        self.window = window
        self.sink = sink
        self.chunks: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def visible(self) -> list[int]:
        """The committed chunks the next chunk attends to (:func:`chunk_visibility`'s row)."""
        n = len(self.chunks)
        row = chunk_visibility(n + 1, self.window, self.sink)[n, :n]
        return [j for j in range(n) if bool(row[j])]

    def context(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        idx = self.visible()
        if not idx:
            return None
        return (torch.cat([self.chunks[j][layer][0] for j in idx], dim=1),
                torch.cat([self.chunks[j][layer][1] for j in idx], dim=1))

    def record(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._pending[layer] = (k.detach(), v.detach())

    def commit(self) -> None:
        if not self._pending:
            raise RuntimeError("batch KV: commit without a recorded chunk")
        self.chunks.append(dict(self._pending))
        self._pending = {}


def causal_rollout(student: Any, noise: torch.Tensor, text: torch.Tensor, options: CausalOptions,
                   exits: Sequence[int] | None = None, *, autocast: bool = False, renoise: str | None = None,
                   generator: torch.Generator | None = None, seeds: Sequence[int] | None = None) -> torch.Tensor:
    """The clip ``[B, C, F, H, W]`` the causal ``student`` makes from ``noise`` (same shape; chunk
    ``i`` starts from ``noise[:, :, i*f:(i+1)*f]``) with ``text`` states ``[B, L, D]``, chunk by
    chunk as ``CausalEngine.denoise_chunk`` does (no CFG). ``exits[i]`` (default: the last step)
    is chunk ``i``'s exit step, the one step run with gradient when grad is enabled. ``autocast``:
    the forwards in bf16 autocast on CUDA (training speed; the latents stay in the model dtype).

    ``renoise``: how a step before the exit moves from ``s`` to ``s'`` (default: ``options.sampler``,
    the runtime's setting). ``"euler"``: ``x + (s' - s) v``, i.e. the x0 prediction ``x - s v``
    re-noised with the *predicted* noise ``x + (1 - s) v``; ``"fresh"`` (DMD2's few-step sampler):
    ``(1 - s') (x - s v) + s' n`` with fresh noise ``n`` (the same x0 prediction, a new noise):
    with ``seeds`` (one per stream of the batch) the runtime's
    :func:`~omniloop_kit.causal.step_noise` of that seed, chunk and step, else drawn from
    ``generator``."""
    from omniloop_wan.causal import chunk_forward as _chunk_forward

    def chunk_forward(*args: Any, **kw: Any) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast and noise.is_cuda):
            return _chunk_forward(*args, **kw)

    o = options
    f = o.chunk_frames
    b, _c, frames, _h, _w = noise.shape
    if frames % f:
        raise ValueError(f"causal rollout: {frames} latent frames are not whole chunks of {f}")
    n = frames // f
    exits = [o.steps - 1] * n if exits is None else [int(k) for k in exits]
    if len(exits) != n or any(not 0 <= k < o.steps for k in exits):
        raise ValueError(f"causal rollout: exits must be {n} step indices in [0, {o.steps}), got {exits}")
    renoise = o.sampler if renoise is None else renoise
    if renoise not in RENOISE:
        raise ValueError(f"causal rollout: renoise must be one of {', '.join(RENOISE)}, got {renoise!r}")
    if seeds is not None and len(seeds) != b:
        raise ValueError(f"causal rollout: seeds must be one per stream ({b}), got {len(seeds)}")
    p = next(student.parameters())
    dev, dt = p.device, p.dtype
    text = text.to(dev, dt)
    sig = o.sigmas()
    kv = BatchKV(o.window, o.sink)
    t_ctx = torch.full((b,), o.context_timestep, device=dev, dtype=dt)
    out = []
    for i in range(n):
        frame0 = i * f
        x = noise[:, :, frame0:frame0 + f].to(dev, dt)
        for k, (s, s_next) in enumerate(itertools.pairwise(sig)):
            t = torch.full((b,), s * 1000.0, device=dev, dtype=dt)
            if k < exits[i]:
                with torch.no_grad():
                    v = chunk_forward(student, x, t, text, frame0, context=kv.context)
                    fresh = None
                    if renoise == "fresh":
                        fresh = (_randn(x.shape, generator, dev) if seeds is None else
                                 torch.cat([step_noise(int(sd), i, k, (1, *x.shape[1:])) for sd in seeds]).to(dev))
                    x = causal_step(x, v, s, s_next, fresh).to(dt)
                continue
            v = chunk_forward(student, x, t, text, frame0, context=kv.context)
            x = (x.float() + (0.0 - s) * v.float()).to(dt)  # the x0 prediction (the last Euler step's own formula)
            break
        with torch.no_grad():
            chunk_forward(student, x.detach(), t_ctx, text, frame0, context=kv.context, record=kv.record)
        kv.commit()
        out.append(x)
    return torch.cat(out, dim=2)


def _randn(shape: Sequence[int], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Float32 standard noise on ``device``, drawn on the generator's device."""
    gdev = generator.device if generator is not None else device
    return torch.randn(tuple(shape), generator=generator, device=gdev, dtype=torch.float32).to(device)


def stream_noise(seeds: Sequence[int], chunks: int, chunk_shape: Sequence[int]) -> torch.Tensor:
    """``[len(seeds), C, chunks*f, H, W]``: the noise the runtime's rollout draws for each seed
    (:func:`~omniloop_kit.causal.chunk_noise`, chunk by chunk); ``chunk_shape`` is
    ``[1, C, f, H, W]``."""
    return torch.cat([torch.cat([chunk_noise(int(s), i, chunk_shape) for i in range(chunks)], dim=2)
                      for s in seeds], dim=0)


class SelfForcingRollout:
    """``rollout(student, noise, text, generator) -> x0``, the callable the DMD2 recipe's loop
    takes: :func:`causal_rollout` with exit steps drawn per chunk from ``generator``
    (``exit="random"``) or the last step (``exit="last"``). ``student`` is a Wan transformer or
    the recipe's LoRA role (:class:`~.dmd.AdapterRole`: its adapter on the shared base)."""

    def __init__(self, options: CausalOptions, *, exit: str = "random", autocast: bool = True,
                 renoise: str | None = None) -> None:
        renoise = options.sampler if renoise is None else renoise
        if exit not in EXITS:
            raise ValueError(f"exit: one of {', '.join(EXITS)}, got {exit!r}")
        if renoise not in RENOISE:
            raise ValueError(f"renoise: one of {', '.join(RENOISE)}, got {renoise!r}")
        self.options = options
        self.exit = exit
        self.renoise = renoise
        self.autocast = autocast
        self.last_exits: list[int] = []

    def exits(self, chunks: int, generator: torch.Generator | None) -> list[int]:
        steps = self.options.steps
        if self.exit == "last":
            return [steps - 1] * chunks
        dev = generator.device if generator is not None else "cpu"
        return [int(k) for k in torch.randint(0, steps, (chunks,), generator=generator, device=dev).tolist()]

    def __call__(self, student: Any, noise: torch.Tensor, text: Any,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """``text``: the states ``[B, L, D]`` or the recipe's :class:`~.dmd.Text` (its ``cond``: the
        student runs without CFG). Returns float32 latents, as the recipe's losses take them."""
        from .dmd import AdapterRole

        cond = text if isinstance(text, torch.Tensor) else text.cond
        model = student
        if isinstance(student, AdapterRole):  # LoRA roles: the student's adapter on the shared base
            student._activate()  # the graph keeps the student's LoRA weights whatever is active later
            model = student.base
        chunks = noise.shape[2] // self.options.chunk_frames
        self.last_exits = self.exits(chunks, generator)
        return causal_rollout(model, noise, cond, self.options, self.last_exits, autocast=self.autocast,
                              renoise=self.renoise, generator=generator).float()


__all__ = ["EXITS", "RENOISE", "BatchKV", "SelfForcingRollout", "causal_rollout", "stream_noise"]
