"""wan-demo v2's default sampling (stochastic flow Euler, ``training.common.V2_SAMPLING``) and the
batched GPU evaluator that measures it (``training.sampling.FlowEulerGenerator``): the evaluator
must draw the clips the runtime draws, or its figures say nothing about ``omniloop generate``."""

import json

import numpy as np
import pytest
import torch

from omniloop_wan_demo.checkpoint_path import checkpoint_dir
from omniloop_wan_demo_training.common import V2_SAMPLING, load_tokenizer
from omniloop_wan_demo_training.sampling import FlowEulerGenerator, euler_schedule
from omniloop_wan_demo_training.train_dit import duplicates

torch.set_num_threads(2)
CKPT = checkpoint_dir()


@pytest.fixture(scope="module")
def pipe():
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(str(CKPT), torch_dtype=torch.float32)


def _gen(pipe, *, stochastic: bool = True, shift: float = V2_SAMPLING["shift"]) -> FlowEulerGenerator:
    return FlowEulerGenerator(pipe, load_tokenizer(CKPT / "tokenizer"), device="cpu", shift=shift, stochastic=stochastic)


def test_the_shipped_preset_samples_with_v2_sampling():
    defaults = json.loads((CKPT / "omniloop.json").read_text())["defaults"]
    assert {k: defaults[k] for k in V2_SAMPLING} == V2_SAMPLING
    assert V2_SAMPLING["sampler_options"]["flow-euler"] == {"stochastic_sampling": True}
    # the fast LoRA's schedule (issue 41): the few-step sampler's timesteps when a request picks it
    assert V2_SAMPLING["sampler_options"]["few-step"] == {"timesteps": [1000, 750, 500, 250], "grid_shift": 8.0}


def test_schedule_is_the_flow_euler_samplers():
    from omniloop_policies.samplers import FlowEulerSampler

    sched = json.loads((CKPT / "scheduler" / "scheduler_config.json").read_text())
    state = FlowEulerSampler.from_config(sched).init(20, shift=5.0)
    timesteps, sigmas = euler_schedule(20, 5.0)
    assert timesteps == list(state.timestep_values) and sigmas == list(state.sigma_values)
    assert len(sigmas) == 21 and sigmas[0] == 1.0 and sigmas[-1] == 0.0


def test_batched_evaluator_draws_the_runtimes_clips(pipe):
    """Two prompts at two seeds in one batch vs the ``wan-demo`` preset at its defaults (3 steps to
    keep it quick): the same initial noise and per-step noise from each request's generator, so the
    frames agree to one uint8 level (the preset decodes with the fast oneDNN VAE kernels)."""
    from omniloop.runtime import Runtime

    prompts, seeds = ["a blue circle moving down", "a red star moving left"], [1, 5]
    ours = _gen(pipe)(prompts, seeds, steps=3, guidance_scale=V2_SAMPLING["guidance_scale"])
    rt = Runtime.from_model("wan-demo")
    for p, s, v in zip(prompts, seeds, ours, strict=True):
        out = rt.generate({"task": "t2v", "prompt": p, "diffusion": {"seed": s, "steps": 3}})
        assert out.ok, out.error
        theirs = np.asarray(out.artifacts["video"].frames).astype(int)
        assert theirs.shape == v.shape == (17, 64, 64, 3)
        assert np.abs(theirs - v.astype(int)).max() <= 1


def test_stochastic_steps_draw_fresh_noise_and_stay_seeded(pipe):
    prompts, seeds = ["a green square moving up"], [2]
    sde = _gen(pipe)(prompts, seeds, steps=3, guidance_scale=2.0)[0]
    assert np.array_equal(sde, _gen(pipe)(prompts, seeds, steps=3, guidance_scale=2.0)[0])  # a seed is a clip
    ode = _gen(pipe, stochastic=False)(prompts, seeds, steps=3, guidance_scale=2.0)[0]
    assert np.abs(sde.astype(int) - ode.astype(int)).mean() > 1.0
    other = _gen(pipe)(prompts, [3], steps=3, guidance_scale=2.0)[0]
    assert not np.array_equal(sde, other)


def test_duplicates_counts_clips_with_a_ghost_in_most_frames():
    clips = [{"s": 1, "g": 17}, {"s": 1, "g": 8}, {"s": 0, "g": 7}, {"s": 12, "g": 9}, {"s": 3, "g": 0}]
    assert duplicates(clips) == {"duplicate_clips": 3, "duplicates_per_seed": {"1": 2, "12": 1}, "clips_with_a_ghost": 4}
    assert duplicates([]) == {"duplicate_clips": 0, "duplicates_per_seed": {}, "clips_with_a_ghost": 0}
