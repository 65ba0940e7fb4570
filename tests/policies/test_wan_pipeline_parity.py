"""The policies reproduce diffusers' own WanPipeline denoise loop, bit for bit (fp32, CPU).

A tiny randomly initialised ``WanTransformer3DModel`` (no weights are downloaded) runs inside the
real ``diffusers.WanPipeline`` (prompt embeddings given, latent output) and inside a denoise loop
written against the policy API — the loop the Wan family moves onto. Wan2.1 (one expert) and
Wan2.2 A14B (two experts, ``boundary_ratio``, ``guidance_scale_2``) are both covered.
"""

from __future__ import annotations

import pytest
import torch

from omniloop.loop import LoopState
from omniloop.request import DiffusionParams, OmniRequest, TaskType
from omniloop_policies import BoundaryRouter, PolicyMenu, PrecisionPolicy, SingleExpert

pytestmark = pytest.mark.slow

HEIGHT = WIDTH = 32
FRAMES = 5
STEPS = 6


def tiny_transformer(seed: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
        freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()


def embeds():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 8, 16, generator=g), torch.randn(1, 8, 16, generator=g)


def diffusers_latents(scheduler_config, experts, boundary_ratio, **call):
    from diffusers import UniPCMultistepScheduler, WanPipeline

    pipe = WanPipeline(
        tokenizer=None, text_encoder=None, vae=None, transformer=experts["transformer"],
        transformer_2=experts.get("transformer_2"), scheduler=UniPCMultistepScheduler.from_config(scheduler_config),
        boundary_ratio=boundary_ratio,
    )
    pipe.set_progress_bar_config(disable=True)
    pe, ne = embeds()
    out = pipe(
        prompt_embeds=pe, negative_prompt_embeds=ne, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
        num_inference_steps=STEPS, generator=torch.Generator().manual_seed(1), output_type="latent", **call,
    )
    return out.frames


def policy_latents(menu: PolicyMenu, experts, request: OmniRequest):
    """The denoise loop a family writes on the policy API (the sketch in the README)."""
    from diffusers.utils.torch_utils import randn_tensor

    pol = menu.resolve(request)
    gen = torch.Generator().manual_seed(1)
    shape = (1, 4, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)
    loop = LoopState()
    loop.tensors["latents"] = randn_tensor(shape, generator=gen, device=torch.device("cpu"), dtype=torch.float32)
    pol.init(loop, device="cpu", generator=gen)
    pe, ne = embeds()
    text = {"cond": pe, "uncond": ne}
    with torch.no_grad():
        while not pol.done(loop):
            step = pol.step_context(loop, request_id=request.request_id, node="denoise")
            model = experts[step.expert]
            x = loop.tensors["latents"]
            t = pol.timestep(loop)
            xin = x.to(pol.precision.dtype_for(step.expert))

            def forward(s, model=model, xin=xin, t=t):
                return model(
                    hidden_states=xin,
                    timestep=t.expand(xin.shape[0]),
                    encoder_hidden_states=text[s.branch],
                    return_dict=False,
                )[0]

            guided = pol.predict(step, loop, forward=forward)
            loop.tensors["latents"] = pol.advance(step, loop, guided, x)
    return loop.tensors["latents"], loop


def test_wan21_single_expert_matches_diffusers_wan_pipeline():
    from omniloop_policies.testing import WAN_UNIPC_CONFIG

    experts = {"transformer": tiny_transformer(0)}
    want = diffusers_latents(WAN_UNIPC_CONFIG, experts, None, guidance_scale=5.0)
    menu = PolicyMenu.build(WAN_UNIPC_CONFIG, router=SingleExpert(), precision=PrecisionPolicy(step_dtype=None))
    req = OmniRequest(task=TaskType.T2V, diffusion=DiffusionParams(steps=STEPS, guidance_scale=5.0))
    got, _ = policy_latents(menu, experts, req)
    assert torch.equal(got, want)


def test_wan22_two_experts_with_guidance_scale_2_match_diffusers_wan_pipeline():
    from omniloop_policies.testing import WAN_UNIPC_CONFIG

    experts = {"transformer": tiny_transformer(0), "transformer_2": tiny_transformer(1)}
    want = diffusers_latents(WAN_UNIPC_CONFIG, experts, 0.875, guidance_scale=4.0, guidance_scale_2=3.0)
    menu = PolicyMenu.build(
        WAN_UNIPC_CONFIG,
        router=BoundaryRouter(boundary_ratio=0.875),
        precision=PrecisionPolicy(step_dtype=None),
        default_guidance_scale=4.0,
        default_guidance_scale_2=3.0,
    )
    req = OmniRequest(task=TaskType.T2V, diffusion=DiffusionParams(steps=STEPS))
    got, loop = policy_latents(menu, experts, req)
    assert torch.equal(got, want)
    # and both experts really ran: the boundary falls inside the 6-step schedule
    ts = loop.policy_state["sampler"].timestep_values
    assert ts[0] >= 875.0 > ts[-1]
    # the default fp32 step dtype gives the same result here (everything is fp32 already)
    menu32 = PolicyMenu.build(
        WAN_UNIPC_CONFIG,
        router=BoundaryRouter(boundary_ratio=0.875),
        default_guidance_scale=4.0,
        default_guidance_scale_2=3.0,
    )
    got32, _ = policy_latents(menu32, experts, req)
    assert torch.equal(got32, want)
