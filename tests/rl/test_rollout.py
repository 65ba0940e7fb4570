"""Rollouts with per-step log-probs (omniloop.rl) on the Wan, FLUX.1 and SD3 tiny checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from omniloop.errors import RequestError
from omniloop.request import Status
from omniloop.rl import RolloutRecorder
from omniloop.schema import request_from_dict
from omniloop_policies.rollout import rollout_step, step_stats
from omniloop_rl.trainer import replay_log_probs, step_log_prob

FAMILIES = ["wan", "flux", "sd3"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_trajectory_and_replayed_log_probs_match(rl_runtime, make_request, family, kind):
    """C1: the log-probs recomputed from fresh forwards on the recorded trajectory equal the
    rollout's (within 1e-6; CPU float32); the trajectory is in the family's unpacked layout."""
    rt = rl_runtime(family)
    req = make_request(family, steps=4, rollout={"kind": kind, "noise_level": 0.7})
    out = rt.generate(req)
    assert out.status is Status.COMPLETED, out.error
    tr = out.artifacts["trajectory"]
    final = out.artifacts["latents"].tensor  # the family's unpacked layout [1, C, ...]
    assert tr.latents.shape == (5, *final.shape[1:]) and tr.latents.dtype == torch.float32
    assert torch.equal(tr.latents[-1], final[0].float())
    assert tr.log_probs.shape == (4,) and tr.log_probs.dtype == torch.float32
    assert torch.isfinite(tr.log_probs).all()
    assert tr.sigmas.shape == (5,) and tr.timesteps.shape == (4,) and tr.sde_mask.all()
    assert out.metrics["weight_version"] == rt.weight_version == tr.weight_version
    again = replay_log_probs(rt, req, tr)
    assert torch.allclose(again, tr.log_probs, rtol=0, atol=1e-6), (again, tr.log_probs)


@pytest.mark.parametrize("family", FAMILIES)
def test_ode_rollout_is_the_euler_sampler(rl_runtime, make_request, family):
    """kind ode with the flow-euler sampler is the plain deterministic run (same sigmas, same step)."""
    rt = rl_runtime(family)
    params = {"node_params": {"denoise": {"sampler": "flow-euler"}}}
    plain = rt.generate({**make_request(family), **params})
    ode = rt.generate({**make_request(family, rollout={"kind": "ode"}), **params})
    assert ode.ok, ode.error
    tr = ode.artifacts["trajectory"]
    assert tr.log_probs.numel() == 0
    torch.testing.assert_close(ode.artifacts["latents"].tensor, plain.artifacts["latents"].tensor, rtol=0, atol=1e-6)


def test_same_seed_same_rollout_and_sde_steps(rl_runtime, make_request):
    rt = rl_runtime("flux")
    a = rt.generate(make_request("flux", rollout={"kind": "sde"})).artifacts["trajectory"]
    b = rt.generate(make_request("flux", rollout={"kind": "sde"})).artifacts["trajectory"]
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    c = rt.generate(make_request("flux", rollout={"kind": "sde", "sde_steps": [1, 2]})).artifacts["trajectory"]
    assert c.sde_mask.tolist() == [False, True, True, False]
    assert c.log_probs[0] == 0 and c.log_probs[3] == 0 and (c.log_probs[1:3] != 0).all()
    assert torch.equal(c.latents[0], a.latents[0])  # the same initial noise
    ode = rt.generate(make_request("flux", rollout={"kind": "ode"})).artifacts["trajectory"]
    assert torch.equal(c.latents[1], ode.latents[1])  # step 0 took the deterministic step


def _reference_sde(x, v, sigma, sigma_next, a, sigma_max):
    """The issue's formula, written out independently (float64)."""
    dt = sigma_next - sigma
    s_den = sigma_max if sigma == 1 else sigma
    std = a * math.sqrt(sigma / (1 - s_den))
    mean = x * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std * math.sqrt(-dt)


@pytest.mark.parametrize("sigmas", [(1.0, 0.8, 0.5), (0.6, 0.45), (0.3, 0.0)])
def test_sde_step_distribution(sigmas):
    """Many draws of the runtime's SDE step (the recorder's, as a rollout takes it): the empirical
    mean/std of x' match the formula's within sampling error (sigma = 1 uses the second sigma)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 8, 8, generator=g)
    v = torch.randn(1, 4, 8, 8, generator=g)
    params = request_from_dict({"task": "t2i", "prompt": "x", "rollout": {"kind": "sde", "noise_level": 0.7}}).rollout
    rec = RolloutRecorder(params, torch.Generator().manual_seed(1))
    n = 4000
    draws = []
    for _ in range(n):
        draws.append(rollout_step(rec, 0, v, x, sigmas, (0.0,) * len(sigmas)))
        rec.states.clear()
    d = torch.cat(draws).double()
    mean, scale = _reference_sde(x.double(), v.double(), sigmas[0], sigmas[1], 0.7, sigma_max=sigmas[1])
    emp_mean, emp_std = d.mean(0), d.std(0)
    # the mean's standard error is scale/sqrt(n): within 5 of them per element; the std within 10 %
    # per element (its relative standard error is 1/sqrt(2n) = 1.1 %) and 2 % on average
    assert ((emp_mean - mean[0]).abs() < 5 * scale / math.sqrt(n)).all()
    assert ((emp_std - scale).abs() < 0.1 * scale).all()
    assert abs(emp_std.mean().item() - scale) < 0.02 * scale


def test_cps_step_distribution_and_formula():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(1, 256, generator=g), torch.randn(1, 256, generator=g)
    sigma, sigma_next, a = 0.7, 0.5, 0.8
    mean, std = step_stats(v, x, sigma, sigma_next, kind="cps", noise_level=a, sigma_max=0.9)
    s = sigma_next * math.sin(a * math.pi / 2)
    x0, x1 = x - sigma * v, x + (1 - sigma) * v
    ref = (1 - sigma_next) * x0 + math.sqrt(sigma_next**2 - s**2) * x1
    torch.testing.assert_close(mean, ref, rtol=0, atol=1e-6)
    assert abs(float(std) - s) < 1e-7
    nxt = mean + std * torch.randn(1, 256, generator=g)
    torch.testing.assert_close(step_log_prob(v, x, nxt, sigma, sigma_next, kind="cps", noise_level=a, sigma_max=0.9),
                               -((nxt - mean) ** 2).mean(dim=1), rtol=0, atol=1e-7)


def test_sde_log_prob_is_the_gaussian_density():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    mean, scale = step_stats(v, x, 0.5, 0.3, kind="sde", noise_level=0.7, sigma_max=0.9)
    nxt = mean + scale * torch.randn(2, 3, 5, generator=g)
    ref = torch.distributions.Normal(mean.double(), float(scale)).log_prob(nxt.double()).mean(dim=(1, 2))
    lp = step_log_prob(v, x, nxt, 0.5, 0.3, kind="sde", noise_level=0.7, sigma_max=0.9)
    assert lp.shape == (2,)
    torch.testing.assert_close(lp.double(), ref, rtol=0, atol=1e-5)
    vv = v.clone().requires_grad_(True)  # trainers differentiate through the velocity
    step_log_prob(vv, x, nxt, 0.5, 0.3, kind="sde", noise_level=0.7, sigma_max=0.9).sum().backward()
    assert vv.grad is not None and torch.isfinite(vv.grad).all()


@pytest.mark.parametrize("rollout,path", [
    ({"kind": "bogus"}, "rollout.kind"),
    ({"noise_level": 0.0}, "rollout.noise_level"),
    ({"noise_level": float("nan")}, "rollout.noise_level"),
    ({"sde_steps": [0, 9]}, "rollout.sde_steps.1"),
    ({"sde_steps": [-1]}, "rollout.sde_steps"),
    ({"sde_steps": [1, 1]}, "rollout.sde_steps.1"),
    ({"capture": ["velocity"]}, "rollout.capture"),
    ({"kind": "ode", "sde_steps": [0]}, "rollout.sde_steps"),
])
def test_bad_rollouts_name_the_field(rl_runtime, make_request, rollout, path):
    rt = rl_runtime("flux")
    with pytest.raises(RequestError) as info:
        rt.prepare(make_request("flux", rollout=rollout))
    assert info.value.path.startswith(path), info.value


def test_family_without_rollouts_is_refused(toy_runtime_factory):
    rt = toy_runtime_factory()
    task = sorted(rt.supported_tasks)[0].value
    with pytest.raises(RequestError) as info:
        rt.prepare({"task": task, "prompt": "x", "rollout": {"kind": "sde"}})
    assert info.value.path == "rollout" and "cannot run rollouts" in str(info.value)


def test_cache_interceptor_refused_unless_allowed(rl_runtime, make_request):
    import omniloop_fbcache.plugin as fbcache_plugin

    rt = rl_runtime("flux", extra=(("fbcache", fbcache_plugin),), plugins={"fbcache": {"threshold": 1.0, "warmup_steps": 1}})
    with pytest.raises(RequestError) as info:
        rt.prepare(make_request("flux", rollout={"kind": "sde"}))
    assert info.value.path == "rollout.allow_cache" and "fbcache" in str(info.value)
    out = rt.generate(make_request("flux", rollout={"kind": "sde", "allow_cache": True}))
    assert out.ok and out.metrics["plugins"]["fbcache"]["cond"]["cached_steps"]
    assert rt.generate(make_request("flux", rollout={"kind": "ode"})).ok  # no log-probs: nothing to break


def test_group_of_samples_equals_each_seed_alone(rl_runtime, make_request):
    """diffusion.num_outputs: sample i is the request with seed + i (its own generator)."""
    rt = rl_runtime("flux")
    req = make_request("flux", seed=5, num_outputs=3)
    out = rt.generate(req)
    assert out.ok and len(out.samples) == 3 and out.metrics["seeds"] == [5, 6, 7]
    for i, s in enumerate(out.samples):
        alone = rt.generate(make_request("flux", seed=5 + i))
        assert torch.equal(s.artifacts["latents"].tensor, alone.artifacts["latents"].tensor)
    assert torch.equal(out.artifacts["latents"].tensor, out.samples[0].artifacts["latents"].tensor)


def test_group_rollouts_with_same_initial_noise(rl_runtime, make_request):
    rt = rl_runtime("flux")
    out = rt.generate(make_request("flux", seed=5, num_outputs=3, rollout={"kind": "sde", "same_initial_noise": True}))
    trs = [s.artifacts["trajectory"] for s in out.samples]
    assert all(torch.equal(t.latents[0], trs[0].latents[0]) for t in trs)
    assert not torch.equal(trs[0].latents[1], trs[1].latents[1]) and not torch.equal(trs[1].latents[1], trs[2].latents[1])
    # each sample's SDE noise is not its initial noise drawn again
    other = rt.generate(make_request("flux", seed=5, num_outputs=3, rollout={"kind": "sde"}))
    t2 = [s.artifacts["trajectory"] for s in other.samples]
    assert not torch.equal(t2[0].latents[0], t2[1].latents[0])


def test_sd3_step_log_prob_from_an_independent_forward(rl_ckpt, rl_runtime, make_request):
    """C1 against a forward the runtime does not own: diffusers' SD3 transformer (the reference
    pipeline's text embeddings, CFG combined as diffusers does) at every recorded state, then
    omniloop_rl.trainer.step_log_prob on the recorded transition, equals the rollout's log-probs."""
    import diffusers

    rt = rl_runtime("sd3")
    req = make_request("sd3", steps=3, rollout={"kind": "sde"}, guidance_scale=4.0)
    req["negative_prompt"] = "blurry"
    out = rt.generate(req)
    assert out.ok, out.error
    tr = out.artifacts["trajectory"]
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(rl_ckpt("sd3"), dtype=torch.float32)
    with torch.no_grad():
        pe, npe, ppe, nppe = pipe.encode_prompt(prompt=req["prompt"], prompt_2=None, prompt_3=None,
                                                negative_prompt="blurry", do_classifier_free_guidance=True)
        for i in range(3):
            x = tr.latents[i][None]
            t = tr.timesteps[i].expand(2)
            both = pipe.transformer(hidden_states=torch.cat([x, x]), timestep=t, encoder_hidden_states=torch.cat([npe, pe]),
                                    pooled_projections=torch.cat([nppe, ppe]), return_dict=False)[0]
            uncond, cond = both.chunk(2)
            v = uncond + 4.0 * (cond - uncond)
            lp = step_log_prob(v, x, tr.latents[i + 1][None], tr.sigmas[i], tr.sigmas[i + 1], kind="sde",
                               noise_level=0.7, sigma_max=tr.sigmas[1])
            assert abs(float(lp[0]) - float(tr.log_probs[i])) <= 1e-6, (i, float(lp[0]), float(tr.log_probs[i]))


def test_wan_step_log_prob_from_an_independent_forward(rl_ckpt, rl_runtime, make_request):
    """The same for Wan: diffusers' WanTransformer3DModel with WanPipeline's embeddings, one forward
    per branch and diffusers' CFG combine."""
    import diffusers

    rt = rl_runtime("wan")
    req = make_request("wan", steps=3, rollout={"kind": "cps", "noise_level": 0.8}, guidance_scale=4.0)
    req["negative_prompt"] = "blurry"
    out = rt.generate(req)
    assert out.ok, out.error
    tr = out.artifacts["trajectory"]
    pipe = diffusers.WanPipeline.from_pretrained(rl_ckpt("wan"), dtype=torch.float32)
    with torch.no_grad():
        pe, npe = pipe.encode_prompt(prompt=req["prompt"], negative_prompt="blurry", do_classifier_free_guidance=True,
                                     max_sequence_length=512)  # WanPipeline.__call__'s default
        for i in range(3):
            x = tr.latents[i][None]
            t = tr.timesteps[i].expand(1)
            cond = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=pe, return_dict=False)[0]
            uncond = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=npe, return_dict=False)[0]
            v = uncond + 4.0 * (cond - uncond)
            lp = step_log_prob(v, x, tr.latents[i + 1][None], tr.sigmas[i], tr.sigmas[i + 1], kind="cps",
                               noise_level=0.8, sigma_max=tr.sigmas[1])
            assert abs(float(lp[0]) - float(tr.log_probs[i])) <= 1e-6, (i, float(lp[0]), float(tr.log_probs[i]))
