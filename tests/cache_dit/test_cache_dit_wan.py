"""Equivalence with cache-dit's own integration, on diffusers' Wan transformer (tiny, random weights).

Reference paths, each with the same cache settings as our interceptor:

* transformer-only: ``cache_dit.enable_cache(transformer, cache_config=DBCacheConfig(...))`` and
  ``cache_dit.refresh_context(...)`` before the request (the transformer-only path must be
  refreshed by hand: see ``test_transformer_only_path_needs_refresh_before_each_request``);
* pipeline: ``cache_dit.enable_cache(WanPipeline(...))`` — the pipeline wrapper resets the
  contexts on every call. The pipeline runs without text encoder or VAE (prompt embeddings in,
  latents out), so its denoise loop is what we compare.

Ours: the Wan family's outer forward (``omniloop_wan.transformer.wan_forward``; a minimal copy in
this file when that package is absent) — the transformer's submodules called the way diffusers'
``WanTransformer3DModel.forward`` calls them, blocks through ``omniloop.run_blocks`` with our
interceptor bound, one context per guidance branch. (test_cache_dit_wan_family.py goes further:
the whole request through the Wan family's runtime.) The outputs must be bit-identical (``torch.equal``).
"""

from __future__ import annotations

import copy
import importlib
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")
cache_dit = pytest.importorskip("cache_dit")

from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel  # noqa: E402

from omniloop.interceptors import BlockContext, run_blocks  # noqa: E402
from omniloop.loop import LoopState, StepContext  # noqa: E402
from omniloop_cache_dit import CacheDiTInterceptor  # noqa: E402
from omniloop_cache_dit.testing import library_configs  # noqa: E402

logging.getLogger("cache_dit").setLevel(logging.WARNING)

STEPS = 16
GUIDANCE = 4.0

SETTINGS = [
    pytest.param(dict(Fn=1, Bn=1, residual_diff_threshold=0.1, max_warmup_steps=2), id="F1B1-R0.1"),
    pytest.param(
        dict(Fn=1, Bn=0, residual_diff_threshold=0.2, max_warmup_steps=3, max_continuous_cached_steps=2),
        id="F1B0-MC2",
    ),
    pytest.param(
        dict(Fn=2, Bn=1, residual_diff_threshold=0.2, max_warmup_steps=2, taylorseer=True, taylorseer_order=1),
        id="F2B1-taylorseer1",
    ),
    pytest.param(
        dict(
            Fn=1,
            Bn=1,
            residual_diff_threshold=0.3,
            max_warmup_steps=2,
            max_cached_steps=10,
            taylorseer=True,
            taylorseer_order=2,
        ),
        id="F1B1-M10-taylorseer2",
    ),
]


def _family_outer_forward() -> Callable[..., torch.Tensor] | None:
    """The Wan family's own outer forward (``omniloop_wan.transformer.wan_forward``) when installed."""
    try:
        mod = importlib.import_module("omniloop_wan.transformer")
    except ImportError:
        return None
    family_forward = mod.wan_forward

    def forward(
        tr: Any, x: torch.Tensor, ts: torch.Tensor, emb: torch.Tensor, ctx: BlockContext | None
    ) -> torch.Tensor:
        return family_forward(tr, x, ts, emb, None, block_ctx=ctx)

    return forward


def wan_forward(
    tr: Any,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    ctx: BlockContext | None,
) -> torch.Tensor:
    """diffusers 0.42.1 ``WanTransformer3DModel.forward`` (T2V path), blocks through ``run_blocks``."""
    b, _, f, h, w = hidden_states.shape
    p_t, p_h, p_w = tr.config.patch_size
    rotary_emb = tr.rope(hidden_states)
    x = tr.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
    temb, tproj, enc, _ = tr.condition_embedder(timestep, encoder_hidden_states, None, timestep_seq_len=None)
    tproj = tproj.unflatten(1, (6, -1))
    x = run_blocks(tr.blocks, x, ctx, lambda blk, hs: blk(hs, enc, tproj, rotary_emb))
    shift, scale = (tr.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    x = (tr.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
    x = tr.proj_out(x)
    x = x.reshape(b, f // p_t, h // p_h, w // p_w, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


@pytest.fixture(scope="module")
def wan() -> dict[str, Any]:
    torch.manual_seed(0)
    tr = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=4,
        rope_max_seq_len=32,
    ).eval()
    g = torch.Generator().manual_seed(1)
    wan = {
        "transformer": tr,
        "latents": torch.randn(1, 4, 2, 4, 4, generator=g),  # 5 frames, 32x32 pixels
        "prompt_embeds": torch.randn(1, 6, 16, generator=g),
        "negative_prompt_embeds": torch.randn(1, 6, 16, generator=g),
    }
    wan["baseline"] = denoise(wan, _library_transformer(tr))
    return wan


def denoise(
    wan: dict[str, Any], model: Callable[[int, str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """WanPipeline's loop (cond then uncond forward per step, CFG, flow-match Euler)."""
    sch = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sch.set_timesteps(STEPS)
    sch.set_begin_index(0)
    lat = wan["latents"].clone()
    with torch.no_grad():
        for i, t in enumerate(sch.timesteps):
            ts = t.expand(lat.shape[0])
            cond = model(i, "cond", lat, ts, wan["prompt_embeds"])
            uncond = model(i, "uncond", lat, ts, wan["negative_prompt_embeds"])
            lat = sch.step(uncond + GUIDANCE * (cond - uncond), t, lat, return_dict=False)[0]
    return lat


_OURS: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {}


def run_ours(wan: dict[str, Any], settings: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Our interceptor's result for ``settings`` (memoized: deterministic, shared by both comparisons)."""
    key = repr(sorted(settings.items()))
    if key not in _OURS:
        _OURS[key] = _run_ours(wan, settings)
    out, metrics = _OURS[key]
    return out.clone(), metrics


def _run_ours(wan: dict[str, Any], settings: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    tr = wan["transformer"]
    forward = _family_outer_forward() or wan_forward
    icpt = CacheDiTInterceptor(settings)
    loop = LoopState(total=STEPS, branches=("cond", "uncond"))
    for br in loop.branches:
        loop.plugin_state[(icpt.name, br)] = icpt.open(StepContext("req", "denoise", 0, STEPS, 1.0, branch=br), loop)

    def model(i: int, br: str, lat: torch.Tensor, ts: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        sc = StepContext("req", "denoise", i, STEPS, float(ts[0]), branch=br)
        return forward(tr, lat, ts, emb, BlockContext(step=sc, loop=loop, interceptor=icpt))

    out = denoise(wan, model)
    metrics = {}
    for br in loop.branches:
        state = loop.plugin_state.pop((icpt.name, br))
        metrics[br] = icpt.metrics(state)
        icpt.close(state)
    return out, metrics


def _db(settings: dict[str, Any], num_inference_steps: int | None = None) -> Any:
    return library_configs(settings, num_inference_steps)[0]


def _calib(settings: dict[str, Any]) -> Any:
    return library_configs(settings)[1]


def _library_transformer(tr: Any) -> Callable[..., torch.Tensor]:
    return lambda i, br, lat, ts, emb: tr(lat, ts, emb, return_dict=False)[0]


@pytest.mark.parametrize("which", ["test", "family"])
def test_outer_forward_matches_diffusers_forward(wan: dict[str, Any], which: str) -> None:
    tr = wan["transformer"]
    forward = wan_forward if which == "test" else _family_outer_forward()
    if forward is None:
        pytest.skip("omniloop-wan is not installed")
    with torch.no_grad():
        t = torch.tensor([500.0])
        ref = tr(wan["latents"], t, wan["prompt_embeds"], return_dict=False)[0]
        ours = forward(tr, wan["latents"], t, wan["prompt_embeds"], None)
    assert torch.equal(ref, ours)


@pytest.mark.parametrize("settings", SETTINGS)
def test_equals_cache_dit_transformer_only_with_refresh(wan: dict[str, Any], settings: dict[str, Any]) -> None:
    ours, metrics = run_ours(wan, settings)
    assert metrics["cond"]["num_cached_steps"] > 0 and metrics["uncond"]["num_cached_steps"] > 0

    tr = copy.deepcopy(wan["transformer"])
    cache_dit.enable_cache(tr, cache_config=_db(settings), calibrator_config=_calib(settings))
    try:
        cache_dit.refresh_context(tr, cache_config=_db(settings, STEPS), calibrator_config=_calib(settings))
        ref = denoise(wan, _library_transformer(tr))
        # its own stats agree with ours: one context, CFG by call parity
        lib_ctx = tr._context_manager.get_context(tr._context_names[0])
        assert sorted(lib_ctx.get_cached_steps()) == metrics["cond"]["cached_steps"]
        assert sorted(lib_ctx.get_cfg_cached_steps()) == metrics["uncond"]["cached_steps"]
    finally:
        cache_dit.disable_cache(tr)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, wan["baseline"])  # caching really changed the result


@pytest.mark.parametrize("settings", SETTINGS)
def test_equals_cache_dit_wan_pipeline(wan: dict[str, Any], settings: dict[str, Any]) -> None:
    ours, _ = run_ours(wan, settings)
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=copy.deepcopy(wan["transformer"]),
    )
    pipe.set_progress_bar_config(disable=True)
    original_call = WanPipeline.__call__
    cache_dit.enable_cache(pipe, cache_config=_db(settings), calibrator_config=_calib(settings))
    try:
        # notes fact: the pipeline wrapper is installed on the class, not the instance
        assert WanPipeline.__call__ is not original_call
        outs = [
            pipe(
                prompt_embeds=wan["prompt_embeds"],
                negative_prompt_embeds=wan["negative_prompt_embeds"],
                height=32,
                width=32,
                num_frames=5,
                num_inference_steps=STEPS,
                guidance_scale=GUIDANCE,
                latents=wan["latents"].clone(),
                output_type="latent",
                return_dict=False,
            )[0]
            for _ in range(2)  # the pipeline path resets its contexts per call
        ]
    finally:
        cache_dit.disable_cache(pipe)
    assert WanPipeline.__call__ is original_call
    assert torch.equal(ours, outs[0])
    assert torch.equal(ours, outs[1])


def test_transformer_only_path_needs_refresh_before_each_request(wan: dict[str, Any]) -> None:
    """The pitfall in the notes: without refresh_context, request 2 starts one forward late."""
    settings = dict(Fn=1, Bn=1, residual_diff_threshold=0.1, max_warmup_steps=2)
    ours, _ = run_ours(wan, settings)
    tr = copy.deepcopy(wan["transformer"])
    cache_dit.enable_cache(tr, cache_config=_db(settings))
    try:
        cache_dit.refresh_context(tr, cache_config=_db(settings, STEPS))
        mgr, name = tr._context_manager, tr._context_names[0]
        assert len(tr._context_names) == 1 and mgr.get_context(name).cache_config.enable_separate_cfg
        first = denoise(wan, _library_transformer(tr))
        assert torch.equal(first, ours)
        ctx1 = mgr.get_context(name)
        assert ctx1.get_current_step() == STEPS - 1

        # request 2, first (cond) forward: counted as step STEPS of request 1, in request 1's context
        lat, t = wan["latents"], torch.tensor([999.0])
        with torch.no_grad():
            tr(lat, t, wan["prompt_embeds"], return_dict=False)
        assert mgr.get_context(name) is ctx1 and ctx1.get_current_step() == STEPS
        # second (uncond) forward: now the reset fires, and this uncond call becomes the new
        # context's transformer step 0, i.e. its non-CFG ("cond") slot: branches are swapped
        with torch.no_grad():
            tr(lat, t, wan["negative_prompt_embeds"], return_dict=False)
        ctx2 = mgr.get_context(name)
        assert ctx2 is not ctx1
        assert ctx2.get_current_transformer_step() == 0 and not ctx2.is_separate_cfg_step()

        # hence a second request without refresh differs; with refresh it is exact again
        cache_dit.refresh_context(tr, cache_config=_db(settings, STEPS))
        first_again = denoise(wan, _library_transformer(tr))
        unrefreshed = denoise(wan, _library_transformer(tr))
        assert torch.equal(first_again, ours)
        assert not torch.equal(unrefreshed, ours)
    finally:
        cache_dit.disable_cache(tr)
