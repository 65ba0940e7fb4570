"""The FLUX.1 pipeline's moving parts: our outer forward against diffusers' forward, regional
compile, taps and block taps for observers, the first-block cache, and the core's conformance kit."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import omniloop_flux.plugin as flux_plugin
from omniloop.family import PluginComponentSpec
from omniloop.hookspecs import hookimpl
from omniloop.request import Status
from omniloop.runtime import Runtime
from omniloop.testing import make_manager
from omniloop.testing.conformance import check_family
from omniloop_flux.transformer import flux_forward, request_constants


@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_outer_forward_equals_diffusers_forward(flux_runtime, variant):
    tf = flux_runtime(variant).model.components["transformer"]
    g = torch.Generator().manual_seed(0)
    kw = dict(
        hidden_states=torch.randn(2, 16, 16, generator=g), timestep=torch.tensor([0.7, 0.3]),
        encoder_hidden_states=torch.randn(2, 8, 32, generator=g), pooled_projections=torch.randn(2, 32, generator=g),
        img_ids=torch.randn(16, 3, generator=g), txt_ids=torch.zeros(8, 3),
        guidance=torch.tensor([3.5, 1.0]) if variant == "dev" else None,
    )
    with torch.no_grad():
        ref = tf(**kw, return_dict=False)[0]
        assert torch.equal(flux_forward(tf, **kw), ref)
        context, rotary = request_constants(tf, kw["encoder_hidden_states"], kw["img_ids"], kw["txt_ids"])
        rest = {k: v for k, v in kw.items() if k not in ("encoder_hidden_states", "img_ids", "txt_ids")}
        assert torch.equal(flux_forward(tf, **rest, context=context, image_rotary_emb=rotary), ref)


def test_regional_compile_equals_eager(flux_ckpt, flux_runtime, make_t2i, make_manager_flux):
    """Deploy ``compile: true`` (backend ``eager``: dynamo's full-graph tracing of every block, no codegen)."""
    rt = Runtime.from_model(flux_ckpt("dev"), device="cpu", dtype="float32", manager=make_manager_flux(),
                            compile=True, options={"compile_backend": "eager"})
    out = rt.generate(make_t2i(steps=2))
    assert out.status is Status.COMPLETED, out.error
    info = out.metrics["denoise"]["compile"]
    assert info["enabled"] and info["blocks"] == 3 and info["fullgraph"] and info["backend"] == "eager"
    ref = flux_runtime("dev").generate(make_t2i(steps=2))
    assert torch.equal(out.artifacts["latents"].tensor, ref.artifacts["latents"].tensor)


class TapRecorder:
    def __init__(self) -> None:
        self.taps: list[tuple[str, int | None, tuple[int, ...]]] = []

    @hookimpl
    def omniloop_tap(self, request: Any, node: str, step: Any, name: str, value: Any) -> None:
        self.taps.append((name, getattr(step, "step_index", None), tuple(value.shape)))

    @hookimpl
    def omniloop_wants_block_taps(self, node: str) -> Any:
        return re.compile(r"\.blocks\.(0|2)$")


class TapPlugin:
    OMNILOOP_HOOK_API = ">=1.0,<2"

    def __init__(self) -> None:
        self.recorder = TapRecorder()

    @hookimpl
    def omniloop_register_observers(self, register: Any) -> None:
        register(PluginComponentSpec(name="taprec", kind="observer", factory=lambda config=None: self.recorder))


def test_taps_and_block_taps_reach_observers(flux_ckpt, make_t2i):
    plugin = TapPlugin()
    rt = Runtime.from_model(flux_ckpt("dev"), manager=make_manager(("flux", flux_plugin), ("taprec", plugin), toy=False),
                            plugins={"taprec": {}})
    out = rt.generate(make_t2i(steps=2))
    assert out.status is Status.COMPLETED, out.error
    taps = plugin.recorder.taps
    step0 = [t[0] for t in taps if t[1] == 0]
    # the double-stream block 0 and the second single-stream block (index 2 of the stack): image tokens only
    assert step0 == ["transformer.blocks.0", "transformer.blocks.2", "noise_pred", "guided", "latents"]
    assert all(t[2] == (1, 16, 32) for t in taps if t[0].startswith("transformer.blocks"))
    assert taps[-1][0] == "image" and taps[-1][2] == (1, 64, 64, 3)


def test_first_block_cache_runs_on_flux(flux_ckpt, make_t2i):
    import omniloop_fbcache.plugin as fb_plugin

    rt = Runtime.from_model(flux_ckpt("dev"), manager=make_manager(("flux", flux_plugin), ("fbcache", fb_plugin), toy=False),
                            plugins={"fbcache": {"threshold": 1.0, "warmup_steps": 1}})
    req = make_t2i(steps=6)
    cached = rt.generate(req)
    assert cached.status is Status.COMPLETED, cached.error
    assert cached.metrics["plugins"]["fbcache"]["cond"]["cached_steps"]
    exact = rt.generate({**req, "exact": True})  # the interceptor is bypassed for exact requests
    again = rt.generate({**req, "plugin_params": {"fbcache": {"threshold": 0.0}}})
    assert not torch.equal(cached.artifacts["latents"].tensor, exact.artifacts["latents"].tensor)
    assert torch.equal(again.artifacts["latents"].tensor, exact.artifacts["latents"].tensor)


@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_conformance_kit(flux_runtime, make_t2i, variant):
    check_family(lambda: flux_runtime(variant), make_t2i(steps=3), output="image")


def test_conformance_kit_i2i(flux_runtime, make_i2i, input_png):
    check_family(lambda: flux_runtime("dev"), make_i2i(input_png, steps=4), output="image")
