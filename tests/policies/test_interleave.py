"""Every stateful policy keeps its state per request: two requests run interleaved step by step
give exactly what each gives alone."""

from __future__ import annotations

import itertools

import pytest
import torch

from omniloop.request import DiffusionParams, OmniRequest, TaskType
from omniloop_policies import BoundaryRouter, PolicyMenu
from omniloop_policies.testing import WAN_UNIPC_CONFIG, ToyDenoiseLoop, ToyDenoiser

SAMPLERS = {
    "flow-euler": {},
    "unipc": {},
    "dpmpp": {},
    "sde-dpmpp": {"algorithm_type": "sde-dpmsolver++"},  # draws noise from the request generator
    "few-step": {},  # re-noises with the request generator
}
CFGS = {
    "classic": {},
    "batched": {},
    "interval": {"start": 0.2, "end": 0.8},
    "adaptive-gate": {"every": 3},
    "adaptive-gate-threshold": {"every": 4, "threshold": 0.5},
    "guider-apg": None,  # diffusers AdaptiveProjectedGuidance: a momentum buffer per request
}


def make_menu(sampler: str, cfg: str) -> PolicyMenu:
    sampler_name = "dpmpp" if sampler == "sde-dpmpp" else sampler
    cfg_name = {"adaptive-gate-threshold": "adaptive-gate", "guider-apg": "guider"}.get(cfg, cfg)
    cfg_opts = CFGS[cfg]
    if cfg == "guider-apg":
        from diffusers.guiders import AdaptiveProjectedGuidance

        cfg_opts = {"guider": AdaptiveProjectedGuidance(guidance_scale=5.0, adaptive_projected_guidance_momentum=-0.5)}
    return PolicyMenu.build(
        WAN_UNIPC_CONFIG,
        samplers=[sampler_name],
        cfgs=[cfg_name],
        default_sampler=sampler_name,
        default_cfg=cfg_name,
        sampler_options={sampler_name: SAMPLERS[sampler]},
        cfg_options={cfg_name: cfg_opts},
        router=BoundaryRouter(boundary_ratio=0.875),
        default_guidance_scale_2=3.0,
    )


def requests(sampler: str) -> tuple[OmniRequest, OmniRequest]:
    steps_a, steps_b = (None, None) if sampler == "few-step" else (8, 6)
    a = OmniRequest(task=TaskType.T2V, diffusion=DiffusionParams(steps=steps_a, guidance_scale=5.0), request_id="a")
    b = OmniRequest(
        task=TaskType.T2V,
        diffusion=DiffusionParams(steps=steps_b, guidance_scale=3.5, shift=5.0),
        request_id="b",
        node_params={"denoise": {"guidance_scale_2": 2.0}},
    )
    return a, b


@pytest.mark.parametrize("sampler,cfg", list(itertools.product(SAMPLERS, CFGS)))
def test_interleaved_requests_equal_each_request_alone(sampler, cfg):
    menu = make_menu(sampler, cfg)
    experts = {"transformer": ToyDenoiser(seed=1), "transformer_2": ToyDenoiser(seed=2)}
    loop = ToyDenoiseLoop(menu, experts)
    req_a, req_b = requests(sampler)

    alone_a = loop.run(req_a, seed=10, request_id="a")
    alone_b = loop.run(req_b, seed=20, request_id="b")

    la = loop.init(req_a, seed=10, request_id="a")
    lb = loop.init(req_b, seed=20, request_id="b")
    done_a = done_b = False
    while not (done_a and done_b):
        if not done_a:
            done_a = loop.step(la)
        if not done_b:
            done_b = loop.step(lb)

    assert torch.equal(la.tensors["latents"], alone_a)
    assert torch.equal(lb.tensors["latents"], alone_b)
    assert not torch.equal(alone_a, alone_b)
    # the per-request policy state objects are distinct
    for key in ("sampler", "cfg"):
        assert la.policy_state[key] is not lb.policy_state[key]


def test_interleaving_in_any_order_gives_the_same_results():
    menu = make_menu("unipc", "adaptive-gate")
    loop = ToyDenoiseLoop(menu, {"transformer": ToyDenoiser(seed=1), "transformer_2": ToyDenoiser(seed=2)})
    req_a, req_b = requests("unipc")
    want_a = loop.run(req_a, seed=10, request_id="a")
    want_b = loop.run(req_b, seed=20, request_id="b")
    la = loop.init(req_a, seed=10, request_id="a")
    lb = loop.init(req_b, seed=20, request_id="b")
    order = [lb, lb, la, lb, la, la, la, lb, la, lb, la, la, lb]
    for s in order:
        if not s.done:
            loop.step(s)
    for s in (la, lb):
        while not s.done:
            loop.step(s)
    assert torch.equal(la.tensors["latents"], want_a) and torch.equal(lb.tensors["latents"], want_b)
