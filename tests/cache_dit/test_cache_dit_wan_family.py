"""One request through omniloop (Wan family + this interceptor) equals cache-dit's own integration.

The acceptance test of the issue: the same tiny Wan checkpoint (the very same module objects),
prompt, seed, scheduler, steps and cache settings; omniloop's final latents must be
``torch.equal`` to

* ``cache_dit.enable_cache(WanPipeline(...))`` — the pipeline wrapper resets its contexts per call;
* ``cache_dit.enable_cache(transformer)`` + ``cache_dit.refresh_context(...)`` before the request,
  driven by ``WanPipeline`` (transformer-only integration, Wan2.1);

for Wan2.1 (one transformer) and Wan2.2 A14B (two experts: cache-dit keeps one context per
transformer, we keep one per block list). The settings vary per request through
``plugin_params`` on one deployment.

The reference runs on the runtime's own transformer objects, not copies: a deep copy changes the
parameters' memory alignment, which changes CPU matmul rounding (measured: ~1e-6 on these tiny
models). cache-dit's hooks are removed (``disable_cache``) before the test ends.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("omniloop_wan")
cache_dit = pytest.importorskip("cache_dit")

from diffusers import WanPipeline  # noqa: E402

import omniloop_cache_dit.plugin as cache_dit_plugin  # noqa: E402
import omniloop_wan.plugin as wan_plugin  # noqa: E402
from omniloop.runtime import Runtime  # noqa: E402
from omniloop.testing import make_manager  # noqa: E402
from omniloop_cache_dit.testing import cached_run, library_configs  # noqa: E402
from omniloop_wan.tiny import build_tiny_checkpoint  # noqa: E402

logging.getLogger("cache_dit").setLevel(logging.WARNING)

STEPS = 12
PROMPT, NEGATIVE, SEED, GUIDANCE = "a red fox jumps over the lazy dog", "blurry, low quality", 7, 5.0
# The tiny checkpoints have 2 blocks: F1B0 leaves one middle block to cache.
DEPLOY = {"Fn": 1, "Bn": 0, "residual_diff_threshold": 0.08, "max_warmup_steps": 2}
VARIANTS = [
    pytest.param({}, id="deploy-R0.08"),
    pytest.param({"residual_diff_threshold": 0.12, "taylorseer": True, "taylorseer_order": 1}, id="taylorseer1-R0.12"),
    pytest.param(
        {"residual_diff_threshold": 0.2, "max_continuous_cached_steps": 1, "max_warmup_steps": 3}, id="MC1-R0.2"
    ),
]


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = {}
    for variant in ("t2v", "wan22"):
        ckpt: Path = build_tiny_checkpoint(tmp_path_factory.mktemp(f"cd-{variant}"), variant=variant)
        manager = make_manager(("wan", wan_plugin), ("cache-dit", cache_dit_plugin), toy=False)
        out[variant] = Runtime.from_model(ckpt, manager=manager, plugins={"cache-dit": DEPLOY})
    return out


def _request(params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    req: dict[str, Any] = {
        "task": "t2v",
        "inputs": [
            {"type": "text", "text": PROMPT},
            {"type": "text", "text": NEGATIVE, "role": "negative_prompt"},
        ],
        "diffusion": {"steps": STEPS, "guidance_scale": GUIDANCE, "seed": SEED, "height": 32, "width": 32, "frames": 9},
        "outputs": {"return_latents": True},
        **extra,
    }
    if params:
        req["plugin_params"] = {"cache-dit": params}
    return req


def _settings(params: dict[str, Any]) -> tuple[Any, Any]:
    return library_configs({**DEPLOY, **params})


def _pipeline(rt: Any) -> Any:
    c, cfg = rt.model.components, rt.model.config
    pipe = WanPipeline(
        tokenizer=c["tokenizer"],
        text_encoder=c["text_encoder"],
        vae=c["vae"],
        scheduler=type(c["scheduler"]).from_config(c["scheduler"].config),
        transformer=c["transformer"],
        transformer_2=c.get("transformer_2"),
        boundary_ratio=cfg["boundary_ratio"],
        expand_timesteps=cfg["expand_timesteps"],
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe: Any) -> torch.Tensor:
    return pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        output_type="latent",
        generator=torch.Generator("cpu").manual_seed(SEED),
    ).frames


def _ours(rt: Any, params: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    return cached_run(rt, _request(params), _request({}, exact=True))


@pytest.mark.parametrize("variant", ["t2v", "wan22"])
@pytest.mark.parametrize("params", VARIANTS)
def test_equals_cache_dit_on_wan_pipeline(runtimes: dict[str, Any], variant: str, params: dict[str, Any]) -> None:
    rt = runtimes[variant]
    ours, _ = _ours(rt, params)
    pipe = _pipeline(rt)
    cache_config, calib = _settings(params)
    cache_dit.enable_cache(pipe, cache_config=cache_config, calibrator_config=calib)
    try:
        ref = _call(pipe)
    finally:
        cache_dit.disable_cache(pipe)
    assert torch.equal(ours, ref), f"max |d| = {(ours - ref).abs().max()}"


@pytest.mark.parametrize("params", VARIANTS)
def test_equals_cache_dit_transformer_only_with_refresh(runtimes: dict[str, Any], params: dict[str, Any]) -> None:
    rt = runtimes["t2v"]
    ours, stats = _ours(rt, params)
    tr = rt.model.components["transformer"]
    pipe = _pipeline(rt)
    cache_config, calib = _settings(params)
    cache_dit.enable_cache(tr, cache_config=cache_config, calibrator_config=calib)
    try:
        cache_config.num_inference_steps = STEPS
        cache_dit.refresh_context(tr, cache_config=cache_config, calibrator_config=calib)
        ref = _call(pipe)
        ctx = tr._context_manager.get_context(tr._context_names[0])
        assert ctx.get_cached_steps() == stats["cond"]["cached_steps"]
        assert ctx.get_cfg_cached_steps() == stats["uncond"]["cached_steps"]
    finally:
        cache_dit.disable_cache(tr)
    assert torch.equal(ours, ref), f"max |d| = {(ours - ref).abs().max()}"


def test_cache_dit_hooks_are_gone_afterwards(runtimes: dict[str, Any]) -> None:
    for rt in runtimes.values():
        for name in ("transformer", "transformer_2"):
            tr = rt.model.components.get(name)
            if tr is not None:
                assert not hasattr(tr, "_context_manager") and not hasattr(tr, "_original_forward")
    assert not hasattr(WanPipeline, "_original_call")
