"""diffusion.num_outputs against diffusers' num_images_per_prompt with a list of generators."""

from __future__ import annotations

import pytest
import torch

from omniloop.errors import RequestError

MAX_LEN = 32  # the tiny FLUX checkpoint's T5 length (tests/flux/test_parity.py)


@pytest.mark.parametrize("scheduler", ["serial", "step"])
def test_flux_group_matches_diffusers_list_of_generators(rl_ckpt, rl_runtime, make_request, scheduler):
    """Sample i of ``num_outputs = k`` is diffusers' image i of ``num_images_per_prompt = k`` with
    ``generator = [Generator().manual_seed(seed + i) for i in range(k)]``. diffusers runs the k
    samples as one batch; the serial scheduler runs them one by one and the step scheduler stacks
    them into one batch too: equal up to float reassociation of the batched GEMMs (atol 1e-5 on
    latents of unit scale; bit-exact where the batch shapes agree is not promised)."""
    import diffusers

    k, seed = 3, 11
    rt = rl_runtime("flux", step=(scheduler == "step"))
    out = rt.generate(make_request("flux", seed=seed, steps=4, num_outputs=k))
    assert out.ok and [s.metrics["seed"] for s in out.samples] == [seed + i for i in range(k)]
    pipe = diffusers.FluxPipeline.from_pretrained(rl_ckpt("flux"), dtype=torch.float32)
    gens = [torch.Generator("cpu").manual_seed(seed + i) for i in range(k)]
    ref = pipe(prompt="a red fox jumps over the lazy dog", num_images_per_prompt=k, generator=gens,
               num_inference_steps=4, height=64, width=64, max_sequence_length=MAX_LEN, output_type="latent").images
    ref = pipe._unpack_latents(ref, 64, 64, pipe.vae_scale_factor)
    ours = torch.cat([s.artifacts["latents"].tensor for s in out.samples])
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    assert not torch.equal(ours[0], ours[1])


def test_group_is_batched_by_the_step_scheduler(rl_runtime, make_request):
    rt = rl_runtime("flux", step=True)
    out = rt.generate(make_request("flux", seed=2, steps=3, num_outputs=4, rollout={"kind": "sde"}))
    assert out.ok and len(out.samples) == 4
    batched = [d for d in rt.scheduler.trace if d.action == "batched_step"]
    assert batched and max(len(d.request_ids) for d in batched) == 4
    # batched rollouts still replay to their own log-probs (the replay runs each alone)
    from omniloop_rl.trainer import replay_log_probs

    for i, s in enumerate(out.samples):
        req = make_request("flux", seed=2 + i, steps=3, rollout={"kind": "sde"})
        again = replay_log_probs(rt, req, s.artifacts["trajectory"])
        torch.testing.assert_close(again, s.artifacts["trajectory"].log_probs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("diffusion,path", [({"num_outputs": 0}, "diffusion.num_outputs"),
                                            ({"num_outputs": 65}, "diffusion.num_outputs"),
                                            ({"num_outputs": 2, "seed": 2**63 - 1}, "diffusion.num_outputs")])
def test_bad_num_outputs(rl_runtime, make_request, diffusion, path):
    rt = rl_runtime("flux")
    with pytest.raises(RequestError) as info:
        rt.generate(make_request("flux", **diffusion))
    assert info.value.path == path


def test_prepare_refuses_a_group(rl_runtime, make_request):
    with pytest.raises(RequestError, match="prepare_group"):
        rl_runtime("flux").prepare(make_request("flux", num_outputs=2))
