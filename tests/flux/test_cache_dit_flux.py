"""cache-dit on FLUX.1: one request through omniloop (the flux family + our cache-dit interceptor)
equals ``cache_dit.enable_cache(FluxPipeline(...))`` at the same settings.

The same tiny checkpoint (the very same module objects: a deep copy changes parameter alignment
and with it CPU matmul rounding), prompt, seed, steps and cache settings; final latents compared
with ``torch.equal``. cache-dit's Flux adapter runs the 2 double-stream and 4 single-stream blocks
as one stack (its default "dummy blocks" mode), measuring the residual of the image stream after
the first ``Fn`` blocks — as our forward does, which carries the image stream through
``run_blocks`` and the text stream beside it.

Scope: ``Bn = 0`` (cache-dit's default). With ``Bn > 0`` the trailing blocks after a cache hit see
cache-dit's text stream updated by the cached text residual, while ours see the text stream as
the first ``Fn`` blocks left it, so results differ on hit steps (asserted below, so a change in
either side is noticed).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

cache_dit = pytest.importorskip("cache_dit")

import omniloop_cache_dit.plugin as cache_dit_plugin  # noqa: E402
import omniloop_flux.plugin as flux_plugin  # noqa: E402
from omniloop.runtime import Runtime  # noqa: E402
from omniloop.testing import make_manager  # noqa: E402
from omniloop_cache_dit.testing import cached_run, library_configs  # noqa: E402
from omniloop_flux.tiny import build_tiny_checkpoint  # noqa: E402

logging.getLogger("cache_dit").setLevel(logging.WARNING)

STEPS, SEED, PROMPT, SIZE = 12, 7, "a red fox jumps over the lazy dog", 64
# random weights: the first block's residual changes by 0.16-0.56 (relative L1) between steps
DEPLOY = {"Fn": 1, "Bn": 0, "residual_diff_threshold": 0.35, "max_warmup_steps": 2}
VARIANTS = [
    pytest.param({}, id="F1B0-R0.35"),
    pytest.param({"residual_diff_threshold": 0.4, "taylorseer": True, "taylorseer_order": 1}, id="taylorseer1-R0.4"),
    pytest.param({"Fn": 2, "residual_diff_threshold": 0.5, "max_continuous_cached_steps": 1, "max_warmup_steps": 3},
                 id="F2B0-MC1-R0.5"),
]


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = {}
    for variant in ("dev", "schnell"):
        ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp(f"cd-flux-{variant}"), variant=variant,
                                     num_layers=2, num_single_layers=4)
        manager = make_manager(("flux", flux_plugin), ("cache-dit", cache_dit_plugin), toy=False)
        out[variant] = Runtime.from_model(ckpt, manager=manager, plugins={"cache-dit": DEPLOY})
    return out


def _request(params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    req: dict[str, Any] = {
        "task": "t2i", "prompt": PROMPT,
        "diffusion": {"steps": STEPS, "seed": SEED, "height": SIZE, "width": SIZE},
        "outputs": {"return_latents": True}, **extra,
    }
    if params:
        req["plugin_params"] = {"cache-dit": params}
    return req


def _settings(params: dict[str, Any]) -> tuple[Any, Any]:
    return library_configs({**DEPLOY, **params})


def _reference(rt: Any, params: dict[str, Any]) -> tuple[torch.Tensor, list[int]]:
    from diffusers import FluxPipeline

    c = rt.model.components
    pipe = FluxPipeline(scheduler=type(c["scheduler"]).from_config(c["scheduler"].config), vae=c["vae"],
                        text_encoder=c["text_encoder"], tokenizer=c["tokenizer"], text_encoder_2=c["text_encoder_2"],
                        tokenizer_2=c["tokenizer_2"], transformer=c["transformer"])
    pipe.set_progress_bar_config(disable=True)
    cache_config, calib = _settings(params)
    cache_dit.enable_cache(pipe, cache_config=cache_config, calibrator_config=calib)
    try:
        lat = pipe(PROMPT, height=SIZE, width=SIZE, num_inference_steps=STEPS, max_sequence_length=32,
                   generator=torch.Generator("cpu").manual_seed(SEED), output_type="latent").images
        tr = c["transformer"]
        cached = sorted(tr._context_manager.get_context(tr._context_names[0]).get_cached_steps())
    finally:
        cache_dit.disable_cache(pipe)
    return pipe._unpack_latents(lat, SIZE, SIZE, pipe.vae_scale_factor), cached


def _ours(rt: Any, params: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    latents, stats = cached_run(rt, _request(params), _request({}, exact=True))
    assert set(stats) == {"cond"}, stats  # one branch (no CFG); cached_run checks it cached
    return latents, stats


@pytest.mark.parametrize("variant", ["dev", "schnell"])
@pytest.mark.parametrize("params", VARIANTS)
def test_equals_cache_dit_on_flux_pipeline(runtimes: dict[str, Any], variant: str, params: dict[str, Any]) -> None:
    rt = runtimes[variant]
    ours, stats = _ours(rt, params)
    ref, cached = _reference(rt, params)
    assert cached == stats["cond"]["cached_steps"]
    assert torch.equal(ours, ref), f"max |d| = {(ours - ref).abs().max()}"


def test_trailing_blocks_after_a_hit_differ_from_cache_dit(runtimes: dict[str, Any]) -> None:
    """The documented limit: Bn > 0 (see the module docstring)."""
    params = {"Bn": 1, "residual_diff_threshold": 0.4}
    ours, stats = _ours(runtimes["dev"], params)
    ref, cached = _reference(runtimes["dev"], params)
    assert cached == stats["cond"]["cached_steps"]  # same decisions up to the first hit...
    assert not torch.equal(ours, ref)  # ...but the text stream the last block sees differs


def test_cache_dit_hooks_are_gone_afterwards(runtimes: dict[str, Any]) -> None:
    for rt in runtimes.values():
        tr = rt.model.components["transformer"]
        assert not hasattr(tr, "_context_manager")


def test_per_request_modulation_under_cache_dit(tmp_path_factory: pytest.TempPathFactory, runtimes: dict[str, Any]) -> None:
    """``options.modulation: per-request`` (omniloop's block forwards, a modulation row per block) under the
    cache-dit interceptor: the same cache decisions as the per-step deployment and the same latents up to
    the table's float reassociation."""
    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("cd-flux-mod"), variant="dev", num_layers=2, num_single_layers=4)
    manager = make_manager(("flux", flux_plugin), ("cache-dit", cache_dit_plugin), toy=False)
    rt = Runtime.from_model(ckpt, manager=manager, plugins={"cache-dit": DEPLOY}, options={"modulation": "per-request"})
    got, got_stats = _ours(rt, {})
    want, want_stats = _ours(runtimes["dev"], {})
    assert got_stats["cond"]["cached_steps"] == want_stats["cond"]["cached_steps"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
