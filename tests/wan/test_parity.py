"""Parity with diffusers — the acceptance test for loop inversion.

Same tiny checkpoint (the very same module objects), seed, scheduler config, steps and guidance,
CPU float32: omniloop's final latents and decoded frames must equal diffusers' ``WanPipeline`` /
``WanImageToVideoPipeline`` bit for bit (``torch.equal``, no tolerance). omniloop runs its own
attention processor (the deploy's ``sdpa`` backend); diffusers runs with its own
``WanAttnProcessor`` put back for the reference run (``diffusers_attention``).

diffusers is given a fresh scheduler built from the checkpoint's config and a CPU generator
seeded with the request's seed, as omniloop's execution does (``randn_tensor`` semantics).

One adjustment on diffusers' side, not ours: diffusers 0.42's ``pipeline_wan_i2v.basic_clean``
calls ``ftfy.fix_text`` without checking that ftfy is installed (``pipeline_wan`` does check).
When ftfy is missing we give the I2V pipeline ``pipeline_wan.prompt_clean`` — the function
omniloop uses — which is what the I2V one does with ftfy present.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v
from diffusers.utils import is_ftfy_available
from PIL import Image

from omniloop_wan.attention import diffusers_attention, installed


@pytest.fixture
def i2v_prompt_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    if not is_ftfy_available():
        monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", pipeline_wan.prompt_clean)


def diffusers_pipeline(model: Any, i2v: bool, scheduler: Any = None) -> Any:
    c, cfg = model.components, model.config
    if scheduler is None:
        scheduler = type(c["scheduler"]).from_config(c["scheduler"].config)
    kw: dict[str, Any] = dict(
        tokenizer=c["tokenizer"], text_encoder=c["text_encoder"], vae=c["vae"],
        scheduler=scheduler,
        transformer=c["transformer"], transformer_2=c.get("transformer_2"),
        boundary_ratio=cfg["boundary_ratio"], expand_timesteps=cfg["expand_timesteps"],
    )
    if i2v:
        kw.update(image_encoder=c.get("image_encoder"), image_processor=c.get("image_processor"))
        pipe = WanImageToVideoPipeline(**kw)
    else:
        pipe = WanPipeline(**kw)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_diffusers(
    model: Any, req: dict[str, Any], image_path: Any = None, scheduler: Any = None
) -> tuple[torch.Tensor, np.ndarray]:
    """(final latents, frames as float [T, H, W, 3] in [0, 1]) from diffusers for ``req``.

    ``scheduler``: a scheduler *factory* (a fresh instance per pipeline call); default: the
    checkpoint's own scheduler class and config."""
    d = req["diffusion"]
    i2v = req["task"] == "i2v"
    make = scheduler or (lambda: None)
    call: dict[str, Any] = dict(
        prompt=req["inputs"][0]["text"], negative_prompt=req["inputs"][1]["text"], height=d["height"],
        width=d["width"], num_frames=d["frames"], num_inference_steps=d["steps"], guidance_scale=d["guidance_scale"],
    )
    if "guidance_scale_2" in req.get("node_params", {}).get("denoise", {}):
        call["guidance_scale_2"] = req["node_params"]["denoise"]["guidance_scale_2"]
    if i2v:
        call["image"] = Image.open(image_path).convert("RGB")
    gen = torch.Generator("cpu")
    experts = [c for n, c in model.components.items() if n.startswith("transformer")]
    with diffusers_attention(*experts):  # diffusers' own WanAttnProcessor, not omniloop's backend one
        latents = diffusers_pipeline(model, i2v, make())(**call, generator=gen.manual_seed(d["seed"]),
                                                         output_type="latent").frames
        frames = diffusers_pipeline(model, i2v, make())(**call, generator=gen.manual_seed(d["seed"]),
                                                        output_type="np").frames
    return latents, frames[0]


def assert_bit_exact(out: Any, ref_latents: torch.Tensor, ref_frames: np.ndarray) -> None:
    assert out.ok, out.error
    latents = out.artifacts["latents"].tensor
    assert latents.shape == ref_latents.shape
    assert torch.equal(latents, ref_latents), f"latents differ: max |d| = {(latents - ref_latents).abs().max()}"
    frames = out.artifacts["video"].frames
    ref_u8 = torch.from_numpy((ref_frames * 255).round().astype(np.uint8))
    assert frames.dtype == torch.uint8 and frames.shape == ref_u8.shape
    assert torch.equal(frames, ref_u8)


def _decoded_unit_frames(runtime: Any, req: dict[str, Any]) -> torch.Tensor:
    """Our decoded frames as float [T, H, W, 3] in [0, 1] (before uint8), for an exact float comparison."""
    from omniloop_wan.stages import to_unit_frames

    ex = runtime.prepare(req)
    ex.run()
    return to_unit_frames(ex.state.artifacts["decoded"].values["video"])


def test_t2v_unipc_bit_exact(wan_runtime, t2v_request):
    rt = wan_runtime("t2v")
    assert installed(rt.model.components["transformer"]) == "sdpa"  # ours runs; diffusers' for the reference
    req = t2v_request(steps=4)
    ref_latents, ref_frames = run_diffusers(rt.model, req)
    assert_bit_exact(rt.generate(req), ref_latents, ref_frames)
    # the decoded float frames too, not only their uint8 rounding
    assert torch.equal(_decoded_unit_frames(rt, req), torch.from_numpy(ref_frames))


def test_t2v_flow_euler_bit_exact(wan_runtime, t2v_request):
    rt = wan_runtime("t2v", "flow_euler")
    req = t2v_request(steps=3, seed=3)
    assert_bit_exact(rt.generate(req), *run_diffusers(rt.model, req))


def test_t2v_without_cfg_bit_exact(wan_runtime, t2v_request):
    # guidance <= 1: one branch, diffusers skips the unconditional forward too
    rt = wan_runtime("t2v")
    req = t2v_request(guidance_scale=1.0)
    out = rt.generate(req)
    assert_bit_exact(out, *run_diffusers(rt.model, req))


def test_wan22_two_expert_routing_bit_exact(wan_runtime, t2v_request):
    rt = wan_runtime("wan22")
    # 4 steps at flow shift 12, boundary 0.875 (875): timesteps 999, 973, 923 (high noise), 800 (low)
    req = t2v_request(steps=4)
    req["node_params"] = {"denoise": {"guidance_scale_2": 3.0}}
    out = rt.generate(req)
    assert out.metrics["experts"] == ["transformer", "transformer_2"]
    assert_bit_exact(out, *run_diffusers(rt.model, req))


def test_i2v_wan21_clip_bit_exact(wan_runtime, i2v_request, image_file, i2v_prompt_clean):
    rt = wan_runtime("i2v")
    assert "image_encoder" in rt.model.components
    req = i2v_request(steps=3)
    assert_bit_exact(rt.generate(req), *run_diffusers(rt.model, req, image_file))


def test_i2v_wan22_two_experts_bit_exact(wan_runtime, i2v_request, image_file, i2v_prompt_clean):
    rt = wan_runtime("wan22_i2v")
    req = i2v_request(steps=4)
    out = rt.generate(req)
    assert out.metrics["experts"] == ["transformer", "transformer_2"]
    assert_bit_exact(out, *run_diffusers(rt.model, req, image_file))


def test_ti2v_5b_text_to_video_bit_exact(wan_runtime, t2v_request):
    rt = wan_runtime("ti2v")
    req = t2v_request(height=64, width=64)
    assert_bit_exact(rt.generate(req), *run_diffusers(rt.model, req))


def test_ti2v_5b_image_to_video_bit_exact(wan_runtime, i2v_request, image_file, i2v_prompt_clean):
    rt = wan_runtime("ti2v")
    req = i2v_request(height=64, width=64)
    assert_bit_exact(rt.generate(req), *run_diffusers(rt.model, req, image_file))


def test_uint8_conversion_equals_diffusers_rounding():
    from omniloop_wan.stages import to_uint8, to_uint8_frames, to_unit_frames

    g = torch.Generator().manual_seed(0)
    video = torch.rand(1, 3, 5, 8, 8, generator=g) * 2.4 - 1.2  # includes values outside [-1, 1]
    video[0, 0, 0, 0, :4] = torch.tensor([-1.0, 1.0, 0.0, 1 / 255])
    assert torch.equal(to_uint8_frames(video), to_uint8(to_unit_frames(video)))
