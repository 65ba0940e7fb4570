"""LoRA on the SD3 family against diffusers' ``load_lora_weights`` + ``set_adapters`` (issue 17).

CPU float32, tiny SD3.5-medium with T5, 3 steps with CFG. Tolerance 1e-4 on the final latents
(see tests/adapters/test_wan_lora.py for why). Observed: 0 without adapters, <= 3.4e-6 with them
(diffusers 0.42.1 / peft 0.21.2; unlike Wan and FLUX.1 not bit-identical — not investigated)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import omniloop_adapters.plugin as adapters_plugin
import omniloop_sd3.plugin as sd3_plugin
from omniloop.errors import DeployError
from omniloop.runtime import Runtime
from omniloop.testing import make_manager, run_interleaved

TOL = 1e-4
PROMPT = "a red fox jumps over the lazy dog"
NEGATIVE = "blurry low quality"


def request(adapters: list[dict[str, Any]] | None = None, seed: int = 5) -> dict[str, Any]:
    return {"task": "t2i", "prompt": PROMPT, "negative_prompt": NEGATIVE, "diffusion": {"steps": 3, "seed": seed},
            "outputs": {"return_latents": True}, "adapters": adapters or []}


def latents(out: Any) -> torch.Tensor:
    assert out.ok, out.error
    return out.artifacts["latents"].tensor


def runtime(setup: dict[str, Any], **deploy: Any) -> Runtime:
    return Runtime.from_model(setup["ckpt"], manager=make_manager(("sd3", sd3_plugin), ("adapters", adapters_plugin), toy=False),
                              adapters={"a": str(setup["a"]), "b": str(setup["b"])}, **deploy)


def test_single_stacked_none_after_match_diffusers_and_interleave(sd3_setup, diffusers_runs):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_setup["ckpt"], dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def ref() -> torch.Tensor:
        return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=3, output_type="latent",
                    generator=torch.Generator().manual_seed(5)).images

    want = diffusers_runs(pipe, sd3_setup, ref, {"a": (["a"], [0.9]), "ab": (["a", "b"], [0.5, 1.5])})
    rt = runtime(sd3_setup)
    sets = {"a": [{"name": "a", "scale": 0.9}], "ab": [{"name": "a", "scale": 0.5}, {"name": "b", "scale": 1.5}], "none": []}
    got = {k: latents(rt.generate(request(v))) for k, v in sets.items()}
    assert (want["a"] - want["none"]).abs().max() > 1e-2
    for k, v in got.items():
        diff = (v - want[k].reshape(v.shape)).abs().max().item()
        print(f"{k}: max |latents - diffusers| = {diff:.3g}")
        assert diff <= TOL, f"{k}: max |d| = {diff}"
    outs = run_interleaved(rt, [request(v) for v in sets.values()])
    for k, out in zip(sets, outs, strict=True):
        assert torch.equal(latents(out), got[k]), k


def test_fused_qkv_refused_with_adapters(sd3_setup):
    with pytest.raises(DeployError, match="qkv 'fused'"):
        runtime(sd3_setup, options={"qkv": "fused"})
