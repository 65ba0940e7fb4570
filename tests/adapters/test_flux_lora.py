"""LoRA on the FLUX.1 family against diffusers' ``load_lora_weights`` + ``set_adapters`` (issue 17).

CPU float32, tiny FLUX.1 [dev], 3 steps, 64x64. Tolerance 1e-4 on the final latents (the Wan
module states why: same math and order as PEFT, but PEFT's op order is not a contract). Note that
``proj_out`` matches the single blocks' ``proj_out`` and the model's final ``proj_out`` alike (as
PEFT's suffix matching does), so the adapter covers both.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import omniloop_adapters.plugin as adapters_plugin
import omniloop_flux.plugin as flux_plugin
from omniloop.runtime import Runtime
from omniloop.testing import make_manager, run_interleaved

TOL = 1e-4
PROMPT = "a red fox jumps over the lazy dog"


def request(adapters: list[dict[str, Any]] | None = None, seed: int = 7) -> dict[str, Any]:
    return {"task": "t2i", "prompt": PROMPT, "diffusion": {"steps": 3, "seed": seed, "height": 64, "width": 64},
            "outputs": {"return_latents": True}, "adapters": adapters or []}


def latents(out: Any) -> torch.Tensor:
    assert out.ok, out.error
    return out.artifacts["latents"].tensor


@pytest.fixture(scope="module")
def rt(flux_setup) -> Runtime:
    return Runtime.from_model(flux_setup["ckpt"], manager=make_manager(("flux", flux_plugin), ("adapters", adapters_plugin), toy=False),
                              adapters={"a": str(flux_setup["a"]), "b": str(flux_setup["b"])})


@pytest.fixture(scope="module")
def reference(flux_setup, diffusers_runs) -> dict[str, torch.Tensor]:
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(flux_setup["ckpt"], dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def run() -> torch.Tensor:
        g = torch.Generator("cpu").manual_seed(7)
        out = pipe(prompt=PROMPT, num_inference_steps=3, height=64, width=64, max_sequence_length=32,
                   output_type="latent", generator=g).images
        return pipe._unpack_latents(out, 64, 64, pipe.vae_scale_factor)

    return diffusers_runs(pipe, flux_setup, run, {"a": (["a"], [1.3]), "ba": (["b", "a"], [0.6, -0.4])})


def test_single_stacked_and_none_after_match_diffusers(rt, reference):
    got = {
        "a": latents(rt.generate(request([{"name": "a", "scale": 1.3}]))),
        "ba": latents(rt.generate(request([{"name": "b", "scale": 0.6}, {"name": "a", "scale": -0.4}]))),
        "none": latents(rt.generate(request())),
    }
    assert (reference["a"] - reference["none"]).abs().max() > 1e-2
    assert (reference["ba"] - reference["a"]).abs().max() > 1e-2
    for k, v in got.items():
        diff = (v - reference[k]).abs().max().item()
        print(f"{k}: max |latents - diffusers| = {diff:.3g}")  # recorded with pytest -s
        assert diff <= TOL, f"{k}: max |d| = {diff}"
    assert torch.equal(got["none"], reference["none"])


def test_interleaved_adapter_sets_equal_each_alone(rt):
    sets = {"x": [{"name": "a", "scale": 1.0}], "y": [{"name": "a", "scale": 0.5}, {"name": "b", "scale": 2.0}], "z": []}
    alone = {k: latents(rt.generate(request(v, seed=5))) for k, v in sets.items()}
    outs = run_interleaved(rt, [request(v, seed=5) for v in sets.values()])
    for k, out in zip(sets, outs, strict=True):
        assert torch.equal(latents(out), alone[k]), k
    assert not torch.equal(alone["x"], alone["y"]) and not torch.equal(alone["x"], alone["z"])


def test_per_request_modulation_sees_each_requests_adapters(flux_setup, reference):
    """``options.modulation: per-request`` computes a request's modulation table at its first step, through
    the norm linears as the request's adapters leave them: interleaved requests with different adapter
    sets (``c`` adapts the modulation linears themselves) each match the per-step deployment with their own
    set, and diffusers where it was run."""
    from omniloop_flux import blocks

    def runtime(**options: Any) -> Runtime:
        return Runtime.from_model(flux_setup["ckpt"], manager=make_manager(("flux", flux_plugin), ("adapters", adapters_plugin), toy=False),
                                  adapters={n: str(flux_setup[n]) for n in "abc"}, options=options)

    per_step, per_request = runtime(), runtime(modulation="per-request")
    assert blocks.installed(per_request.model.components["transformer"])
    sets = {"a": [{"name": "a", "scale": 1.3}], "c": [{"name": "c", "scale": 1.0}],
            "ba": [{"name": "b", "scale": 0.6}, {"name": "a", "scale": -0.4}], "none": []}
    want = {k: latents(per_step.generate(request(v))) for k, v in sets.items()}
    assert (want["c"] - want["none"]).abs().max() > 1e-2  # the modulation adapter changes the result
    outs = run_interleaved(per_request, [request(v) for v in sets.values()])
    for k, out in zip(sets, outs, strict=True):
        got = latents(out)
        assert (got - want[k]).abs().max().item() <= TOL, k
        if k in reference:
            assert (got - reference[k]).abs().max().item() <= TOL, k
