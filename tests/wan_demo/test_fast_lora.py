"""wan-demo-fast as a LoRA of wan-demo (issue 41): the ``wan-demo`` preset offers the ``fast``
adapter (``omniloop_wan_demo/adapters/fast.safetensors``), the ``wan-demo-fast`` preset is wan-demo with it
fused at load, and one loaded wan-demo serves 20-step requests and 4-step ``--adapter fast``
requests interleaved.

Tolerance of ``--adapter fast`` vs wan-demo-fast: the same weights, applied unfused (a forward hook
adds ``B(A x)`` to ``W x``) vs fused (``(W + B A) x``); float32 rounding differs, nothing else. Over
4 steps the final latents agree to ``FUSED_ATOL`` and the frames to one uint8 level."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.errors import DeployError
from omniloop.runtime import Deployment, Runtime
from omniloop_wan_demo.checkpoint_path import fast_lora_path

torch.set_num_threads(2)
pytestmark = pytest.mark.skipif(not fast_lora_path().is_file(), reason="no fast LoRA in the package")

#: measured max |d| of the final latents, fused vs unfused (CPU float32): ~1e-6; bound with margin
FUSED_ATOL = 1e-4
FAST = {"steps": 4, "guidance_scale": 1.0}
#: the schedule comes from wan-demo's omniloop.json (sampler_options.few-step: 1000, 750, 500, 250)
FEW_STEP = {"denoise": {"sampler": "few-step"}}


def request(prompt: str, seed: int, *, fast: bool) -> dict[str, Any]:
    req: dict[str, Any] = {"task": "t2v", "prompt": prompt, "diffusion": {"seed": seed},
                           "outputs": {"return_latents": True}}
    if fast:
        req["diffusion"].update(FAST)
        req["node_params"] = FEW_STEP
        req["adapters"] = [{"name": "fast", "scale": 1.0}]
    return req


def latents(out: Any) -> torch.Tensor:
    assert out.ok, out.error
    return out.artifacts["latents"].tensor


@pytest.fixture(scope="module")
def base() -> Runtime:
    return Runtime.from_model("wan-demo")


def test_the_presets_declare_the_adapter():
    dep = Deployment({"model": {"preset": "wan-demo"}})
    assert dep.deploy.adapters == {"fast": str(fast_lora_path())} and not dep.deploy.adapter_fuse
    fast = Deployment({"model": {"preset": "wan-demo-fast"}})
    assert fast.deploy.adapters == {"fast": str(fast_lora_path())} and fast.deploy.adapter_fuse == {"fast": 1.0}
    # a deploy that fuses, offloads or quantizes is not offered the adapter (it would be refused)
    assert Deployment({"model": {"preset": "wan-demo"}, "offload": "model"}).deploy.adapters == {}
    with pytest.raises(DeployError, match="fuses its own adapter"):
        Deployment({"model": {"preset": "wan-demo-fast"}, "adapters": {"x": str(fast_lora_path())}})


def test_without_the_adapters_plugin_wan_demo_fast_is_refused_and_wan_demo_runs_plain():
    import omniloop_wan.plugin as wan_plugin
    import omniloop_wan_demo.plugin as demo_plugin
    from omniloop.testing import make_manager

    manager = make_manager(("wan", wan_plugin), ("wan-demo", demo_plugin), toy=False)
    with pytest.raises(DeployError, match="pip install omniloop-adapters") as info:
        Deployment({"model": {"preset": "wan-demo-fast"}}, manager=manager)
    assert "\n" not in str(info.value)
    assert Deployment({"model": {"preset": "wan-demo"}}, manager=manager).deploy.adapters == {}


def test_adapter_fast_at_4_steps_is_wan_demo_fast(base):
    fast = Runtime.from_model("wan-demo-fast")
    for prompt, seed in [("a red star moving left", 3), ("a blue square moving up", 11)]:
        a = base.generate(request(prompt, seed, fast=True))
        b = fast.generate(request(prompt, seed, fast=False))
        assert b.metrics["steps"] == 4 and b.metrics["policies"]["sampler"] == "few-step"
        d = (latents(a) - latents(b)).abs().max().item()
        print(f"adapter fast vs wan-demo-fast: max |d| latents {d:.2e}")
        assert d <= FUSED_ATOL
        fa, fb = a.artifacts["video"].frames.int(), b.artifacts["video"].frames.int()
        assert (fa - fb).abs().max() <= 1


def test_interleaved_20_and_4_step_requests_equal_each_alone(base):
    reqs = [request("a green circle moving right", 5, fast=False), request("a yellow triangle moving down", 6, fast=True),
            request("a red square moving up", 7, fast=True)]
    alone = [latents(base.generate(r)) for r in reqs]
    exes = [base.prepare(r) for r in reqs]
    while not all(e.done for e in exes):
        for e in exes:
            if not e.done:
                e.advance()
    for ex, ref in zip(exes, alone, strict=True):
        assert torch.equal(latents(ex.output), ref)
    assert not torch.equal(alone[1], latents(base.generate(request("a yellow triangle moving down", 6, fast=False))))
