"""The ``denoise`` node: one UniPC step per ``step()`` over a packed text + vision sequence.

A documented custom step body (not ``omniloop_kit.denoise.DenoiseLoop`` with the policies
plugin's samplers): Cosmos 3 steps each modality's latents with its own UniPC instance and reads
two differently long packed sequences per step (the CFG branches' prompts differ in length), which
the policies' one-latent sampler and stacked-branch CFG do not express. The math is diffusers'
``Cosmos3OmniPipeline`` loop, op for op:

``init`` (once per request)
    the request's UniPC instance (the pipeline's shifted flow schedule, or its native one); the
    initial noise drawn with diffusers' ``randn_tensor`` from the request's generator at the
    latent shape *computed* from the VAE's factors (diffusers runs its encoder over an all-zero
    clip to learn it: the same shape, and for t2v the noise unchanged by the zero mask); for each
    CFG branch its packed layout (:mod:`omniloop_kit.packed`: text on the und pathway, vision on
    the gen pathway), the rotary tables of the whole sequence, and the **text segment's K/V**: the
    und pathway run once (:func:`omniloop_cosmos3.transformer.understand`) and stored in the
    model's text-KV pool (``omniloop_kvcache.CacheManager``, the family's KV class
    ``cosmos3-text``), the request holding one handle per branch.
``step``
    the vision latents embedded once (both branches' gen tokens have the same inputs), then per
    branch the gen pathway with that branch's K/V gathered from the pool, the prediction masked
    on clean frames, ``uncond + g * (cond - uncond)`` in float32 whenever ``g != 1`` (diffusers'
    test, so ``g < 1`` runs CFG too), and the UniPC step on ``latents[None]``.
``finalize`` / ``release``
    the handles freed (``release`` also on cancel or failure; ``init`` frees what it took when it
    fails, e.g. a full pool).

Sound (``[C, T]``, every frame noisy) and action (``[T, D]``, domain-aware projections, given
frames clean, zero beyond the domain's width) streams ride along in the gen pathway after the
vision tokens, each with its own UniPC instance. The step scheduler batches requests whose packed
layouts are equal (``batch_key`` / ``step_batch``): one gen-pathway forward ``[B, G, hidden]`` per
branch, the text K/V gathered from the pool as one ``[B, L]`` slot table; ``kv_demand`` tells its
admission how many pool blocks a request takes.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from omniloop.artifacts import Latents
from omniloop.context import StageContext
from omniloop.interceptors import call_model
from omniloop.loop import LoopState, RequestState, StepContext, StepResult
from omniloop_kit.denoise import randn, request_generator, step_time_metrics
from omniloop_kit.packed import GEN, UND, PackedLayout, pack
from omniloop_kit.stages import params_of

from . import transformer as T
from .resolve import V2V_CONDITION_FRAMES, Cosmos3Resolved

BRANCHES = ("cond", "uncond")


def latent_shape(model_config: dict[str, Any], p: Cosmos3Resolved) -> tuple[int, int, int, int, int]:
    """``[1, z, T, H, W]``: what the VAE encoder would return for a ``num_frames x height x width`` clip."""
    c = model_config
    return (1, c["latent_channels"], (p.num_frames - 1) // c["vae_scale_temporal"] + 1,
            p.height // c["vae_scale_spatial"], p.width // c["vae_scale_spatial"])


def sound_frames(model_config: dict[str, Any], p: Cosmos3Resolved) -> int:
    """Sound latent frames: the clip's samples (``int(frames / fps * rate)``) in whole decoder hops."""
    s = model_config["sound"]
    n = int(p.num_frames / p.fps * s["sampling_rate"])
    return (n + s["hop"] - 1) // s["hop"]


def packed_layout(tf: Any, n_text: int, grid: tuple[int, int, int], noisy: list[int], fps: float,
                  temporal: int, sound: int = 0, action: tuple[int, list[int], str] | None = None) -> PackedLayout:
    """The packed sequence of one branch: ``n_text`` text tokens (und), then the vision grid and
    ``sound`` sound frames (gen; vision and sound are temporal siblings: both start at one offset)."""
    cfg = tf.config
    text_pos, nxt = T.text_positions(n_text, 0, cfg.enable_fps_modulation)
    offset = nxt + cfg.unified_3d_mrope_temporal_modality_margin
    common = dict(reset_spatial=cfg.unified_3d_mrope_reset_spatial_ids, base_fps=float(cfg.base_fps))
    vision_pos = T.grid_positions(*grid, offset, fps=fps if cfg.enable_fps_modulation else None,
                                  compression=temporal, **common)
    parts = [("text", UND, (n_text, 1, 1), (), None), ("vision", GEN, grid, noisy, None)]
    positions = [text_pos, vision_pos]
    if sound:
        sound_fps = float(cfg.sound_latent_fps) if cfg.enable_fps_modulation else None
        positions.append(T.grid_positions(sound, 1, 1, offset, fps=sound_fps, compression=1, **common))
        parts.append(("sound", GEN, (sound, 1, 1), range(sound), None))
    if action is not None:  # (frames, noisy frames, domain): time from the second video frame on
        n, noisy_a, domain = action
        positions.append(T.grid_positions(n, 1, 1, offset, fps=fps if cfg.enable_fps_modulation else None,
                                          compression=1, base_compression=temporal, start_frame=1, **common))
        parts.append(("action", GEN, (n, 1, 1), noisy_a, domain))
    return pack(parts, positions)


def initial_actions(spec: Any, dim: int, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The action latents ``[T, dim]`` (given actions on the clean frames, noise elsewhere, zero
    beyond the domain's width) and the condition mask ``[T, 1]``."""
    dev = noise.device
    mask = torch.zeros((spec.chunk_size, 1), device=dev, dtype=torch.float32)
    x0 = torch.zeros(spec.chunk_size, dim, device=dev, dtype=torch.float32)
    if spec.raw_actions is not None:  # short sequences repeat their last action; channels padded with zeros
        raw = torch.tensor(spec.raw_actions, dtype=torch.float32, device=dev)
        if raw.shape[0] < spec.chunk_size:
            raw = torch.cat([raw, raw[-1:].expand(spec.chunk_size - raw.shape[0], -1)], dim=0)
        raw = raw[:spec.chunk_size]
        x0 = torch.cat([raw, torch.zeros(raw.shape[0], dim - raw.shape[1], dtype=raw.dtype, device=dev)], dim=-1)
    for i in spec.condition_frames:
        mask[i, 0] = 1.0
    latents = mask * x0 + (1.0 - mask) * noise
    latents[:, spec.width:] = 0
    return latents, mask


class Denoise:
    """The denoise loop node (see the module docstring)."""

    def __init__(self, model_config: dict[str, Any], pool: Any, layer_fn: Any = None) -> None:
        self.config = model_config
        #: the model's text-KV pool (``omniloop_kvcache.CacheManager``)
        self.pool = pool
        #: the gen pathway's layer body (:func:`omniloop_cosmos3.transformer.gen_layer`, compiled
        #: under deploy ``compile: true``)
        self.layer_fn = layer_fn

    # -- init ---------------------------------------------------------------------------------
    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        p: Cosmos3Resolved = params_of(state)
        tf, dev = ctx.components["transformer"], ctx.device
        template = ctx.components["scheduler"]
        sched = type(template).from_config(template.config)
        if self.config["native_flow_schedule"]:
            n = sched.config.num_train_timesteps
            sched.set_timesteps(p.steps, device=dev, sigmas=np.linspace(1.0 - 1.0 / n, 0.0, p.steps + 1)[:-1])
        else:
            sched.set_timesteps(p.steps, device=dev)
        clean = state.get("image_latents")
        shape = tuple(clean.tensor.shape) if isinstance(clean, Latents) else latent_shape(self.config, p)
        gen = request_generator(state)
        latents = randn(shape, gen, dev, torch.float32)
        n_sound = sound_frames(self.config, p) if p.sound else 0
        grid = T.patch_grid(tf, shape)
        mask = torch.zeros((shape[2], 1, 1), device=dev, dtype=torch.float32)
        if isinstance(clean, Latents):  # i2v / actions: the first latent frame (inverse dynamics: all) kept clean
            kept = (p.action.vision_condition_frames(shape[2]) if p.action is not None
                    else V2V_CONDITION_FRAMES if p.video is not None else [0])
            for i in kept:
                if 0 <= i < shape[2]:
                    mask[i, 0, 0] = 1.0
            latents = mask * clean.tensor.to(device=dev, dtype=torch.float32) + (1.0 - mask) * latents
        noisy = [i for i in range(shape[2]) if mask[i, 0, 0] == 0]
        loop = LoopState(total=p.steps, branches=BRANCHES if p.cfg else ("cond",))
        loop.tensors["latents"] = latents
        if n_sound:  # all sound frames are noisy: the zero conditioning mask leaves the noise as drawn
            loop.tensors["sound"] = randn((self.config["sound"]["dim"], n_sound), gen, dev, torch.float32)
            loop.extra["sound_scheduler"] = copy.deepcopy(sched)
        spec, action = p.action, None
        if spec is not None:
            dim = self.config["action"]["dim"]
            a_lat, a_mask = initial_actions(spec, dim, randn((spec.chunk_size, dim), gen, dev, torch.float32))
            a_noisy = [i for i in range(spec.chunk_size) if a_mask[i, 0] == 0]
            loop.tensors["action"] = a_lat
            loop.extra.update(action_scheduler=copy.deepcopy(sched), action_mask=a_mask, action_width=spec.width,
                              action_noisy=torch.tensor(a_noisy, dtype=torch.long, device=dev),
                              domain=torch.tensor([spec.domain_id], dtype=torch.long, device=dev))
            action = (spec.chunk_size, a_noisy, spec.domain)
        loop.extra.update(scheduler=sched, timesteps=sched.timesteps, grid=grid, mask=mask, shape=shape,
                          noisy=torch.tensor(noisy, dtype=torch.long, device=dev), handles={})
        try:
            self._understand(ctx, state, loop, p, grid, noisy, n_sound, action)
        except BaseException:  # a full pool (CacheFull) or a failed forward: nothing stays allocated
            self._free(loop)
            raise
        return loop

    def _understand(self, ctx: StageContext, state: RequestState, loop: LoopState, p: Cosmos3Resolved,
                    grid: tuple[int, int, int], noisy: list[int], n_sound: int, action: Any) -> None:
        """Each branch's packed layout and rotary tables, and its text K/V computed once into the pool."""
        tf, dev, pool = ctx.components["transformer"], ctx.device, self.pool
        branches: dict[str, Any] = {}
        with torch.no_grad():
            for name in loop.branches:
                ids = p.cond_ids if name == "cond" else p.uncond_ids
                layout = packed_layout(tf, len(ids), grid, noisy, p.fps, self.config["vae_scale_temporal"], n_sound,
                                       action)
                cos, sin = T.rotary(tf, layout.position_ids, dev, tf.dtype)
                u = layout.und_len
                kv = T.understand(tf, torch.tensor(ids, dtype=torch.long, device=dev), (cos[:u], sin[:u]))
                handle = pool.allocate(u, tag=(state.request.request_id, name))
                loop.extra["handles"][name] = handle
                slots = pool.append(handle, u)
                for layer, (k, v) in enumerate(kv):
                    pool.write(layer, slots.to(pool.k[layer].device), k, v)
                branches[name] = {"layout": layout, "rot": (cos[u:], sin[u:]), "slots": pool.slots(handle),
                                  "vision": layout.gen_indexes("vision", device=dev),
                                  "noisy": layout.gen_indexes("vision", noisy=True, device=dev),
                                  "sound": layout.gen_indexes("sound", device=dev) if n_sound else None,
                                  "action": layout.gen_indexes("action", device=dev) if action else None,
                                  "action_noisy": layout.gen_indexes("action", noisy=True, device=dev)
                                  if action else None}
        loop.extra["branches"] = branches
        state.metrics["text_kv"] = {"branches": len(branches), "tokens": {n: b["layout"].und_len
                                                                          for n, b in branches.items()}}

    def kv_demand(self, state: RequestState) -> tuple[Any, int] | None:
        """(pool, blocks) this request takes at ``init`` — its branches' text tokens: what the step
        scheduler's admission checks, so a request waits for room instead of failing."""
        p = state.resolved
        if not isinstance(p, Cosmos3Resolved):
            return None
        texts = [p.cond_ids, p.uncond_ids] if p.cfg else [p.cond_ids]
        return self.pool, sum(self.pool.blocks_for(len(ids)) for ids in texts)

    # -- one step -----------------------------------------------------------------------------
    def embed(self, tf: Any, loop: LoopState, t: float) -> dict[str, torch.Tensor]:
        """This step's gen tokens of every modality (the same inputs for both branches)."""
        x = loop.extra
        lat, sound, act = loop.tensors["latents"], loop.tensors.get("sound"), loop.tensors.get("action")
        tokens = {"vision": T.embed_vision(tf, lat.to(tf.dtype), x["grid"], x["noisy"], t)}
        if sound is not None:
            tokens["sound"] = T.embed_sound(tf, sound.to(tf.dtype), t)
        if act is not None:
            tokens["action"] = T.embed_action(tf, act.to(tf.dtype), x["domain"], x["action_noisy"], t)
        return tokens

    @staticmethod
    def fill(gen: torch.Tensor, b: dict[str, Any], tokens: dict[str, torch.Tensor]) -> None:
        """The tokens at their gen-pathway positions (``gen`` ``[G, hidden]``, zeros elsewhere)."""
        for key, tok in tokens.items():
            gen[b[key]] = tok

    def read(self, tf: Any, out: torch.Tensor, loop: LoopState, b: dict[str, Any]) -> dict[str, torch.Tensor]:
        """One branch's velocities from its gen output ``[G, hidden]``: vision ``[1, C, T, H, W]``
        masked on clean frames, sound ``[C, T]``, actions ``[T, D]`` masked on given frames and
        zero beyond the domain's width; float32."""
        x = loop.extra
        pred = T.read_vision(tf, out, b["noisy"], x["grid"], x["noisy"], x["shape"])
        keep = (1.0 - x["mask"]).to(dtype=pred.dtype, device=pred.device)
        got = {"vision": pred * keep if keep.sum() > 0 else torch.zeros_like(pred)}
        if "sound" in loop.tensors:
            got["sound"] = T.read_sound(tf, out, b["sound"])  # its conditioning mask is all zero: kept whole
        if "action" in loop.tensors:
            a = T.read_action(tf, out, b["action_noisy"], x["domain"], x["action_noisy"], len(x["action_mask"]))
            keep_a = (1.0 - x["action_mask"]).to(dtype=a.dtype, device=a.device)
            a = a * keep_a if keep_a.sum() > 0 else torch.zeros_like(a)
            a[:, self.width(loop):] = 0
            got["action"] = a
        return {k: v.float() for k, v in got.items()}

    def predict(self, ctx: StageContext, loop: LoopState, name: str, tokens: dict[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        """One branch's velocities from this step's embedded tokens."""
        tf, b = ctx.components["transformer"], loop.extra["branches"][name]
        gen = tokens["vision"].new_zeros((b["layout"].gen_len, tokens["vision"].shape[-1]))
        self.fill(gen, b, tokens)
        out = T.generate(tf, gen, b["rot"], lambda i: self.pool.gather(i, b["slots"]), self.layer_fn)
        return self.read(tf, out, loop, b)

    @staticmethod
    def width(loop: LoopState) -> int:
        return int(loop.extra["action_width"])

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        p: Cosmos3Resolved = params_of(state)
        tf, x = ctx.components["transformer"], loop.extra
        t = x["timesteps"][loop.step]
        sc = StepContext(request_id=state.request.request_id, node=ctx.node.name, step_index=loop.step,
                         num_steps=loop.total, timestep=float(t), branch=loop.branches[0])
        with torch.no_grad():
            tokens = self.embed(tf, loop, t.item())
            preds = {name: call_model(ctx.step_interceptors, sc.with_branch(name), loop, tokens,
                                      lambda n=name: self.predict(ctx, loop, n, tokens))
                     for name in loop.branches}
            self.advance(p, loop, preds)
        if ctx.taps_enabled:
            ctx.tap("latents", loop.tensors["latents"], sc)
        return StepResult(done=loop.step + 1 >= loop.total)

    def advance(self, p: Cosmos3Resolved, loop: LoopState, preds: dict[str, dict[str, torch.Tensor]]) -> None:
        """CFG combine (float32, whenever ``g != 1``) and each modality's UniPC step."""
        x = loop.extra
        t = x["timesteps"][loop.step]
        lat, sound, act = loop.tensors["latents"], loop.tensors.get("sound"), loop.tensors.get("action")

        def guided(key: str) -> torch.Tensor:
            c = preds["cond"][key]
            return preds["uncond"][key] + p.guidance_scale * (c - preds["uncond"][key]) if p.cfg else c

        with torch.no_grad():
            loop.tensors["latents"] = x["scheduler"].step(guided("vision").unsqueeze(0), t, lat.unsqueeze(0),
                                                          return_dict=False)[0].squeeze(0)
            if sound is not None:
                loop.tensors["sound"] = x["sound_scheduler"].step(guided("sound").unsqueeze(0), t, sound.unsqueeze(0),
                                                                  return_dict=False)[0].squeeze(0)
            if act is not None and len(x["action_noisy"]) > 0:  # forward dynamics: every action given, never stepped
                stepped = x["action_scheduler"].step(guided("action").unsqueeze(0), t, act.unsqueeze(0),
                                                     return_dict=False)[0].squeeze(0)
                stepped[:, self.width(loop):] = 0
                loop.tensors["action"] = stepped

    # -- batched steps (the step scheduler) -----------------------------------------------------
    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None:
        """Equal for requests whose next step may run as one batched gen-pathway forward per
        branch: equal packed layouts (latent shape, clean frames, sound frames, action chunk,
        given frames and domain, text lengths per branch, fps: so equal rotary tables) at the same
        step of an equally long schedule. Not batched: step interceptors, taps, ``exact`` requests
        (a batched GEMM rounds differently from a request alone)."""
        if ctx.step_interceptors or ctx.taps_enabled or state.request.exact or loop.step >= loop.total:
            return None
        p: Cosmos3Resolved = params_of(state)
        x, lat = loop.extra, loop.tensors["latents"]
        layouts = tuple(repr(b["layout"].describe()) for b in x["branches"].values())
        return ("cosmos3-denoise", tuple(lat.shape), str(lat.dtype), str(lat.device), loop.step, loop.total,
                float(x["timesteps"][loop.step]), p.fps, loop.branches, layouts,
                p.action.domain_id if p.action is not None else None)

    def step_batch(self, ctxs: Sequence[StageContext], states: Sequence[RequestState],
                   loops: Sequence[LoopState]) -> list[StepResult]:
        """One gen-pathway forward per branch over every request (their text K/V gathered from
        the pool as one ``[B, L]`` slot table), then each request's own combine and steps."""
        if not loops:
            return []
        tf = ctxs[0].components["transformer"]
        t = loops[0].extra["timesteps"][loops[0].step].item()
        with torch.no_grad():
            tokens = [self.embed(tf, lp, t) for lp in loops]
            preds: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in loops]
            for name in loops[0].branches:
                bs = [lp.extra["branches"][name] for lp in loops]
                width = tokens[0]["vision"].shape[-1]
                gen = tokens[0]["vision"].new_zeros((len(loops), bs[0]["layout"].gen_len, width))
                for j, b in enumerate(bs):
                    self.fill(gen[j], b, tokens[j])
                slots = torch.stack([b["slots"] for b in bs])
                out = T.generate(tf, gen, bs[0]["rot"], lambda i, s=slots: self.pool.gather(i, s), self.layer_fn)
                for j, lp in enumerate(loops):
                    preds[j][name] = self.read(tf, out[j], lp, bs[j])
        for st, lp, mine in zip(states, loops, preds, strict=True):
            self.advance(params_of(st), lp, mine)
        return [StepResult(done=lp.step + 1 >= lp.total) for lp in loops]

    # -- end ------------------------------------------------------------------------------------
    def release(self, state: RequestState, node: str) -> None:
        """Free the request's text-KV handles (idempotent; finalize, cancel, failure)."""
        loop = state.loops.get(node)
        if loop is not None:
            self._free(loop)

    def _free(self, loop: LoopState) -> None:
        for h in loop.extra.pop("handles", {}).values():
            if self.pool.is_live(h):
                self.pool.free(h)

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        metrics = step_time_metrics(ctx, state)
        if metrics is not None:
            state.metrics["denoise"] = metrics
        state.write("denoised", Latents(tensor=loop.tensors["latents"], modality="video"), ctx.node.name)
        if "action" in loop.tensors:
            state.write("denoised_action", Latents(tensor=loop.tensors["action"], modality="action"), ctx.node.name)
        if "sound" in loop.tensors:
            state.write("denoised_sound", Latents(tensor=loop.tensors["sound"], modality="audio"), ctx.node.name)
        self._free(loop)
        loop.extra.pop("scheduler", None)
        loop.extra.pop("sound_scheduler", None)
        loop.extra.pop("action_scheduler", None)
        loop.extra.pop("branches", None)


__all__ = ["BRANCHES", "Denoise", "latent_shape", "packed_layout"]
