"""Each sampler reproduces the corresponding diffusers scheduler, bit for bit, on the same inputs."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from omniloop_policies import (
    DMD_WAN_TIMESTEPS,
    DPMppSampler,
    FewStepSampler,
    FlowEulerSampler,
    PolicyError,
    ResolutionShift,
    UniPCSampler,
    calculate_shift,
)
from omniloop_policies.testing import WAN_UNIPC_CONFIG

STEPS = 10
SHAPE = (1, 4, 3, 6, 6)


def fake_model(x: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """A fixed velocity field: deterministic in (x, t), any dtype."""
    tt = float(t) / 1000.0
    return (torch.tanh(x * 0.7 + 0.1) * (0.5 + tt) - 0.3 * x).to(x.dtype)


def start(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(dtype)


def run_ours(
    sampler, num_steps=STEPS, *, shift=None, mu=None, generator=None, model_dtype=None, latents_dtype=torch.float32
):
    state = sampler.init(num_steps, device="cpu", shift=shift, mu=mu, generator=generator)
    x = start(latents_dtype)
    outs = []
    for i in range(state.num_steps):
        t = sampler.timesteps(state)[i]
        assert state.timestep_value(i) == float(t)
        v = fake_model(x.to(model_dtype or x.dtype), t)
        x = sampler.step(state, v, t, x)
        outs.append(x)
    return state, outs


def run_diffusers(
    scheduler, num_steps=STEPS, *, generator=None, model_dtype=None, latents_dtype=torch.float32, **set_kw
):
    """The diffusers pipelines' loop (pipeline_wan.py): set_timesteps, set_begin_index(0), step."""
    if num_steps is not None:
        scheduler.set_timesteps(num_steps, device="cpu", **set_kw)
    scheduler.set_begin_index(0)
    x = start(latents_dtype)
    outs = []
    for t in scheduler.timesteps:
        v = fake_model(x.to(model_dtype or x.dtype), t)
        kw = {"generator": generator} if generator is not None else {}
        x = scheduler.step(v, t, x, return_dict=False, **kw)[0]
        outs.append(x)
    return outs


def assert_all_equal(ours, theirs):
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.dtype == b.dtype, f"step {i}: dtype {a.dtype} vs {b.dtype}"
        assert torch.equal(a, b), f"step {i}: max abs diff {(a.float() - b.float()).abs().max().item()}"


def test_unipc_matches_diffusers_unipc_on_wan_config():
    _, ours = run_ours(UniPCSampler.from_config(WAN_UNIPC_CONFIG))
    theirs = run_diffusers(UniPCMultistepScheduler.from_config(WAN_UNIPC_CONFIG))
    assert_all_equal(ours, theirs)


def test_flow_euler_matches_diffusers_flow_match_euler():
    _, ours = run_ours(FlowEulerSampler.from_config(WAN_UNIPC_CONFIG))  # shift taken from flow_shift=3
    theirs = run_diffusers(FlowMatchEulerDiscreteScheduler(shift=3.0))
    assert_all_equal(ours, theirs)


def test_dpmpp_matches_diffusers_dpm_solver_plus_plus_flow():
    _, ours = run_ours(DPMppSampler.from_config(WAN_UNIPC_CONFIG))
    theirs = run_diffusers(
        DPMSolverMultistepScheduler(
            prediction_type="flow_prediction",
            use_flow_sigmas=True,
            flow_shift=3.0,
            algorithm_type="dpmsolver++",
            solver_order=2,
            lower_order_final=True,
            final_sigmas_type="zero",
        )
    )
    assert_all_equal(ours, theirs)


def test_sde_dpmpp_draws_noise_from_the_request_generator_like_diffusers():
    cfg = {**WAN_UNIPC_CONFIG, "_class_name": "DPMSolverMultistepScheduler", "algorithm_type": "sde-dpmsolver++"}
    sampler = DPMppSampler.from_config(cfg)
    assert sampler.config["algorithm_type"] == "sde-dpmsolver++"
    _, ours = run_ours(sampler, generator=torch.Generator().manual_seed(7))
    theirs = run_diffusers(
        DPMSolverMultistepScheduler.from_config({**cfg, "solver_type": "midpoint"}),
        generator=torch.Generator().manual_seed(7),
    )
    assert_all_equal(ours, theirs)


@pytest.mark.parametrize("name", ["flow-euler", "unipc", "dpmpp"])
def test_native_step_dtype_reproduces_a_bf16_diffusers_pipeline(name):
    """step_dtype=None: bf16 model outputs, fp32 latents — exactly what diffusers' Wan pipeline does
    (including FlowMatchEuler returning bf16 latents)."""
    cls = {"flow-euler": FlowEulerSampler, "unipc": UniPCSampler, "dpmpp": DPMppSampler}[name]
    sampler = cls.from_config(WAN_UNIPC_CONFIG, step_dtype=None)
    _, ours = run_ours(sampler, model_dtype=torch.bfloat16)
    theirs = run_diffusers(sampler.make_scheduler(), model_dtype=torch.bfloat16)
    assert_all_equal(ours, theirs)


def test_fp32_step_dtype_casts_back_to_the_latents_dtype():
    sampler = FlowEulerSampler.from_config(WAN_UNIPC_CONFIG)  # step_dtype=float32
    _, ours = run_ours(sampler, model_dtype=torch.bfloat16, latents_dtype=torch.bfloat16)
    assert all(x.dtype == torch.bfloat16 for x in ours)
    # and the math ran in fp32: the same as diffusers fed fp32 copies of the same bf16 tensors
    state = sampler.init(STEPS)
    x = start(torch.bfloat16)
    ref = sampler.make_scheduler()
    ref.set_timesteps(STEPS)
    ref.set_begin_index(0)
    for t in ref.timesteps:
        v = fake_model(x, t)
        want = ref.step(v.float(), t, x.float(), return_dict=False)[0].to(torch.bfloat16)
        x = sampler.step(state, v, t, x)
        assert torch.equal(x, want)


def test_request_shift_overrides_the_checkpoint_shift():
    _, ours = run_ours(UniPCSampler.from_config(WAN_UNIPC_CONFIG), shift=5.0)
    theirs = run_diffusers(UniPCMultistepScheduler.from_config({**WAN_UNIPC_CONFIG, "flow_shift": 5.0}))
    assert_all_equal(ours, theirs)


def test_dynamic_shifting_passes_mu_like_diffusers():
    cfg = {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
        "shift": 3.0,
    }
    sampler = FlowEulerSampler.from_config(cfg)
    sv = ResolutionShift.from_config(cfg).resolve(seq_len=1024)
    assert sv.mu == pytest.approx(calculate_shift(1024))
    _, ours = run_ours(sampler, mu=sv.mu)
    theirs = run_diffusers(FlowMatchEulerDiscreteScheduler.from_config(cfg), mu=sv.mu)
    assert_all_equal(ours, theirs)


def test_dynamic_shifting_without_mu_is_a_clear_error():
    sampler = FlowEulerSampler.from_config(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True}
    )
    with pytest.raises(PolicyError, match="resolution"):
        sampler.init(STEPS)


def test_each_request_gets_its_own_scheduler_instance():
    sampler = UniPCSampler.from_config(WAN_UNIPC_CONFIG)
    a, b = sampler.init(STEPS), sampler.init(STEPS)
    assert a.scheduler is not b.scheduler
    assert a.scheduler.model_outputs is not b.scheduler.model_outputs


def test_step_after_the_last_step_is_an_error():
    sampler = FlowEulerSampler.from_config(None)
    state, _ = run_ours(sampler, 2)
    with pytest.raises(PolicyError, match="after all 2 steps"):
        sampler.step(state, start(), state.timesteps[-1], start())


# -- few-step (DMD) ------------------------------------------------------------------------------


def fastvideo_dmd_reference(timesteps, *, grid_shift=8.0, seed=3):
    """FastVideo's DmdDenoisingStage written out: sigma at the nearest training-grid timestep,
    x0 = x - sigma * v, then (1 - sigma_next) * x0 + sigma_next * noise; last step keeps x0."""
    grid = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=grid_shift)
    gen = torch.Generator().manual_seed(seed)

    def sigma(t):
        idx = torch.argmin((grid.timesteps - float(t)).abs())
        return grid.sigmas[idx]

    x = start()
    outs = []
    for i, t in enumerate(timesteps):
        v = fake_model(x, t)
        x0 = x - sigma(t) * v
        if i + 1 < len(timesteps):
            noise = torch.randn(x0.shape, generator=gen, dtype=x0.dtype)
            s = sigma(timesteps[i + 1])
            x = (1.0 - s) * x0 + s * noise
        else:
            x = x0
        outs.append(x)
    return outs


def test_few_step_default_is_the_dmd_wan_schedule():
    sampler = FewStepSampler.from_config(WAN_UNIPC_CONFIG)
    state = sampler.init(None)
    assert state.timestep_values == (1000.0, 757.0, 522.0)
    assert state.timesteps.tolist() == list(DMD_WAN_TIMESTEPS)
    assert state.sigma_values[0] == 1.0 and state.sigma_values[-1] == 0.0
    assert all(abs(s - t / 1000) < 1e-3 for s, t in zip(state.sigma_values[:-1], DMD_WAN_TIMESTEPS, strict=True))


def test_few_step_matches_the_fastvideo_dmd_reference():
    sampler = FewStepSampler.from_config(WAN_UNIPC_CONFIG)
    _, ours = run_ours(sampler, None, generator=torch.Generator().manual_seed(3))
    assert_all_equal(ours, fastvideo_dmd_reference(DMD_WAN_TIMESTEPS))


def test_few_step_matches_diffusers_stochastic_flow_match_euler():
    """The same math as diffusers' FlowMatchEuler(stochastic_sampling=True) on the same sigmas."""
    sampler = FewStepSampler.from_config(WAN_UNIPC_CONFIG)
    state, ours = run_ours(sampler, None, generator=torch.Generator().manual_seed(3))
    ref = FlowMatchEulerDiscreteScheduler(shift=1.0, stochastic_sampling=True)
    ref.set_timesteps(sigmas=list(state.sigma_values[:-1]), timesteps=list(state.timestep_values))
    ref.set_begin_index(0)
    x = start()
    gen = torch.Generator().manual_seed(3)
    for i, t in enumerate(ref.timesteps):
        x = ref.step(fake_model(x, t), t, x, generator=gen, return_dict=False)[0]
        assert torch.equal(x, ours[i]), f"step {i}"


def test_few_step_warp_maps_onto_the_training_grid_like_self_forcing():
    sampler = FewStepSampler.from_config(None, timesteps=(1000, 750, 500, 250), grid_shift=5.0, warp=True)
    state = sampler.init(4)
    grid = FlowMatchEulerDiscreteScheduler(shift=5.0)
    full = torch.cat([grid.timesteps, torch.zeros(1)])
    want = [float(full[1000 - t]) for t in (1000, 750, 500, 250)]
    assert list(state.timestep_values) == want
    assert state.timesteps.dtype == torch.float32


def test_few_step_rejects_a_different_step_count():
    sampler = FewStepSampler.from_config(WAN_UNIPC_CONFIG)
    with pytest.raises(PolicyError, match=r"exactly its 3 distilled timesteps \[1000, 757, 522\]; 50 steps"):
        sampler.init(50)


@pytest.mark.parametrize("bad", [(), (757, 1000), (1000, -5), (2000, 10)])
def test_few_step_rejects_bad_schedules(bad):
    with pytest.raises(PolicyError):
        FewStepSampler.from_config(None, timesteps=bad)


def test_few_step_noise_comes_only_from_the_request_generator():
    sampler = FewStepSampler.from_config(None)
    torch.manual_seed(0)
    _, a = run_ours(sampler, None, generator=torch.Generator().manual_seed(11))
    torch.manual_seed(1)  # the global RNG must not matter
    _, b = run_ours(sampler, None, generator=torch.Generator().manual_seed(11))
    assert_all_equal(a, b)
    assert not math.isnan(float(a[-1].sum()))
