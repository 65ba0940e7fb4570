"""What omniloop-policies gained for FLUX.1 (general, usable by any flow family):

* ``sigma_schedule="linear"`` on the flow samplers: ``np.linspace(1, 1/n, n)`` handed to
  ``set_timesteps`` with ``mu`` — the schedule diffusers' Flux pipelines build;
* ``strength`` (``node_params.<node>.strength``) and ``Sampler.truncate``: diffusers' img2img
  ``get_timesteps`` (the tail of the schedule, the scheduler's begin index there).

Both equal diffusers' scheduler on the same calls (timesteps, sigmas and steps ``torch.equal``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from omniloop.errors import RequestError
from omniloop_policies import FlowEulerSampler, PolicyError, PolicyMenu, ResolutionShift, UniPCSampler, calculate_shift
from omniloop_policies.testing import WAN_UNIPC_CONFIG

DEV = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
       "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
       "use_dynamic_shifting": True}


def _diffusers(steps: int, mu: float, strength: float | None = None) -> FlowMatchEulerDiscreteScheduler:
    sch = FlowMatchEulerDiscreteScheduler.from_config({k: v for k, v in DEV.items() if k != "_class_name"})
    sch.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    sch.set_begin_index(0)
    if strength is not None:
        t_start = int(max(steps - min(steps * strength, steps), 0))
        sch.timesteps = sch.timesteps[t_start:]
        sch.set_begin_index(t_start)
    return sch


@pytest.mark.parametrize("strength", [None, 0.6, 0.95])
def test_linear_sigmas_and_strength_equal_diffusers(strength):
    steps, seq = 7, 1024
    mu = calculate_shift(seq)
    sampler = FlowEulerSampler.from_config(DEV, sigma_schedule="linear", step_dtype=None)
    state = sampler.init(steps, mu=ResolutionShift.from_config(DEV).resolve(seq_len=seq).mu)
    if strength is not None:
        sampler.truncate(state, strength)
    ref = _diffusers(steps, mu, strength)
    assert torch.equal(state.timesteps, ref.timesteps)
    assert state.num_steps == len(ref.timesteps) and len(state.timestep_values) == state.num_steps
    x = torch.randn(1, 16, 4, generator=torch.Generator().manual_seed(0))
    ours, theirs = x.clone(), x.clone()
    for t in ref.timesteps:
        v = torch.tanh(ours) * 0.3
        ours = sampler.step(state, v, state.timestep(), ours)
        theirs = ref.step(torch.tanh(theirs) * 0.3, t, theirs, return_dict=False)[0]
    assert torch.equal(ours, theirs) and state.done


def test_default_sigma_schedule_is_unchanged():
    a = FlowEulerSampler.from_config(DEV).init(5, mu=0.8)
    b = FlowEulerSampler.from_config(DEV, sigma_schedule=None).init(5, mu=0.8)
    lin = FlowEulerSampler.from_config(DEV, sigma_schedule="linear").init(5, mu=0.8)
    assert torch.equal(a.timesteps, b.timesteps) and not torch.equal(a.timesteps, lin.timesteps)


def test_bad_sigma_schedule_and_truncate_misuse():
    with pytest.raises(PolicyError, match="sigma_schedule must be one of"):
        FlowEulerSampler.from_config(DEV, sigma_schedule="cosine")
    sampler = FlowEulerSampler.from_config(DEV)
    state = sampler.init(4, mu=0.5)
    sampler.step(state, torch.zeros(1, 2), state.timestep(), torch.zeros(1, 2))
    with pytest.raises(PolicyError, match="before any step"):
        sampler.truncate(state, 0.5)
    assert isinstance(UniPCSampler.from_config(WAN_UNIPC_CONFIG), UniPCSampler)  # no option: unchanged


def test_strength_is_a_denoise_param():
    menu = PolicyMenu.build(DEV, samplers=["flow-euler", "few-step"], cfgs=["embedded"], default_cfg="embedded",
                            sampler_options={"flow-euler": {"sigma_schedule": "linear"}}, default_steps=10)
    pol = menu.resolve(None, {"strength": 0.5})
    assert pol.strength == 0.5
    for bad in (0.0, 1.5, "x", float("nan")):
        with pytest.raises(RequestError) as err:
            menu.resolve(None, {"strength": bad})
        assert err.value.path == "node_params.denoise.strength", err.value
    with pytest.raises(RequestError) as err:  # few-step runs its fixed schedule: no strength
        menu.resolve(None, {"strength": 0.5, "sampler": "few-step"})
    assert err.value.path == "node_params.denoise.strength" and "flow-euler" in err.value.message
    with pytest.raises(RequestError, match="leaves no step"):
        menu.resolve(None, {"strength": 1e-17})
