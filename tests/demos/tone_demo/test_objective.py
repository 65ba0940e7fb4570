"""The training objective is the one diffusers' StableAudioPipeline + CosineDPMSolverMultistepScheduler
sample with: the model input the scheduler forms (``x * c_in``) is ``cos z + sin n`` at the
timestep ``t`` it passes, and its ``precondition_outputs`` turns the true ``v`` back into ``z``."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("torchsde")


def test_v_objective_matches_the_scheduler_preconditioning():
    from diffusers import CosineDPMSolverMultistepScheduler

    sched = CosineDPMSolverMultistepScheduler()
    sched.set_timesteps(20)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    n = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    for i, sigma in enumerate(sched.sigmas[:-1].double()):
        t = sched.timesteps[i].double()  # what the pipeline passes to the transformer
        assert float(t) == pytest.approx(math.atan(float(sigma)) * 2 / math.pi, rel=1e-6)
        a, s = math.cos(float(t) * math.pi / 2), math.sin(float(t) * math.pi / 2)
        x = z + sigma * n  # the scheduler's sample at sigma (init_noise_sigma ~ sqrt(sigma_max^2 + 1))
        model_in = sched.precondition_inputs(x, sigma)
        torch.testing.assert_close(model_in, a * z + s * n, rtol=2e-6, atol=2e-6)
        v = a * n - s * z  # the training target (omniloop_tone_demo_training.train.v_loss)
        torch.testing.assert_close(sched.precondition_outputs(x, v, sigma), z, rtol=1e-5, atol=1e-4 * max(1.0, float(sigma)))
