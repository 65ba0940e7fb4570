"""The Wan family on omniloop-policies: a request chooses its sampler and CFG policy.

* Untuned requests run the checkpoint's own scheduler and classic CFG (tests/wan/test_parity.py:
  bit-exact with diffusers).
* Another sampler chosen per request equals diffusers' ``WanPipeline`` driven with that
  scheduler (same class and config the sampler builds), bit for bit.
* Batched CFG (cond and uncond stacked in one forward) equals classic CFG within
  ``BATCHED_CFG_ATOL``: measured max |Δ| of the final latents after 6 steps on the tiny fp32
  checkpoints, CPU, 1 thread, 5 seeds each: t2v 2.0e-6, wan22 2.9e-6, i2v 2.6e-6, ti2v 2.3e-6
  (the stacked batch changes the GEMM shapes, so the last bits differ); decoded uint8 frames
  differ by at most one level where they differ at all.
* Interval and adaptive-gate CFG skip exactly the unconditional forwards they should (counted
  through a step interceptor); at their neutral settings they equal classic bit for bit.
* Bad knobs fail before any compute, naming the node and the policy.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.errors import DeployError, RequestError
from omniloop.testing import run_interleaved

from .test_parity import assert_bit_exact, run_diffusers

#: batched vs classic CFG, final latents (see the module docstring for the measurements)
BATCHED_CFG_ATOL = 2e-5


def with_denoise(req: dict[str, Any], **params: Any) -> dict[str, Any]:
    req["node_params"] = {"denoise": params}
    return req


def latents(out: Any) -> torch.Tensor:
    assert out.ok, out.error
    return out.artifacts["latents"].tensor


# -- defaults --------------------------------------------------------------------------------------


def test_untuned_requests_report_the_checkpoint_sampler_and_classic_cfg(wan_runtime, t2v_request):
    out = wan_runtime("t2v").generate(t2v_request(steps=3))
    assert out.metrics["policies"] == {"sampler": "unipc", "cfg": "classic", "full_steps": 3, "cond_only_steps": 0}
    out = wan_runtime("t2v", "flow_euler").generate(t2v_request(steps=2, guidance_scale=1.0))
    assert out.metrics["policies"] == {"sampler": "flow-euler", "cfg": "classic", "full_steps": 0, "cond_only_steps": 2}


def test_the_denoise_node_schema_is_the_policy_knobs(wan_runtime):
    from omniloop.request import TaskType
    from omniloop_policies import DenoiseParams

    node = wan_runtime("t2v").pipeline(TaskType.T2V).spec.node("denoise")
    assert node.params_schema is DenoiseParams
    menu = wan_runtime("wan22").model.config["policy_menu"]
    d = menu.describe()
    assert d["samplers"] == ["dpmpp", "few-step", "flow-euler", "unipc"]
    assert d["cfgs"] == ["adaptive-gate", "batched", "classic", "interval"]
    assert d["experts"] == ["transformer", "transformer_2"]
    assert d["defaults"]["guidance_scale"] == 5.0  # the tiny checkpoint's omniloop.json


# -- another sampler, per request --------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant, sampler, shift",
    [("t2v", "flow-euler", None), ("t2v", "dpmpp", 5.0), ("wan22", "flow-euler", None), ("t2v", "unipc", 7.0)],
)
def test_a_request_chooses_another_sampler_bit_exact_with_diffusers(wan_runtime, t2v_request, variant, sampler, shift):
    rt = wan_runtime(variant)
    req = with_denoise(t2v_request(steps=4, seed=11), sampler=sampler)
    if shift is not None:
        req["diffusion"]["shift"] = shift
    out = rt.generate(req)
    assert out.metrics["policies"]["sampler"] == sampler
    smp = rt.model.config["policy_menu"].samplers[sampler]

    def scheduler() -> Any:  # what the sampler builds for this request, given to diffusers
        return smp.make_scheduler(shift)

    assert_bit_exact(out, *run_diffusers(rt.model, req, scheduler=scheduler))


def test_few_step_sampler_runs_its_distilled_schedule(wan_runtime, t2v_request):
    rt = wan_runtime("t2v")
    req = t2v_request(steps=3)
    del req["diffusion"]["steps"]
    out = rt.generate(with_denoise(req, sampler="few-step", timesteps=[1000, 757, 522]))
    assert out.ok, out.error
    assert out.metrics["steps"] == 3 and out.metrics["policies"]["sampler"] == "few-step"
    assert torch.isfinite(latents(out)).all()
    again = rt.generate(with_denoise(t2v_request(steps=3), sampler="few-step"))
    assert torch.equal(latents(again), latents(out))  # the default schedule is that one
    with pytest.raises(RequestError) as info:
        rt.prepare(with_denoise(t2v_request(steps=4), sampler="few-step"))
    assert info.value.path == "diffusion.steps" and "few-step" in info.value.message


# -- CFG policies ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["t2v", "wan22", "i2v", "ti2v"])
def test_batched_cfg_is_one_forward_and_equals_classic_within_tolerance(counting, wan_runtime, t2v_request,
                                                                        i2v_request, variant):
    make = i2v_request if variant == "i2v" else t2v_request
    size = {"height": 64, "width": 64} if variant == "ti2v" else {}
    classic = wan_runtime(variant).generate(make(steps=4, **size))
    rt, log = counting(variant)
    batched = rt.generate(with_denoise(make(steps=4, **size), cfg="batched"))
    assert log == [(i, "cond+uncond", 2) for i in range(4)]
    assert batched.metrics["policies"] == {"sampler": "unipc", "cfg": "batched", "full_steps": 4, "cond_only_steps": 0}
    torch.testing.assert_close(latents(batched), latents(classic), atol=BATCHED_CFG_ATOL, rtol=0)
    diff = (batched.artifacts["video"].frames.int() - classic.artifacts["video"].frames.int()).abs()
    assert diff.max() <= 1


def test_interval_cfg_skips_the_unconditional_forward_outside_its_window(counting, wan_runtime, t2v_request):
    rt, log = counting("t2v")
    out = rt.generate(with_denoise(t2v_request(steps=4), cfg="interval", cfg_window=[0.0, 0.5]))
    assert log == [(0, "cond", 1), (0, "uncond", 1), (1, "cond", 1), (1, "uncond", 1), (2, "cond", 1), (3, "cond", 1)]
    assert out.metrics["policies"] == {"sampler": "unipc", "cfg": "interval", "full_steps": 2, "cond_only_steps": 2}
    classic = wan_runtime("t2v").generate(t2v_request(steps=4))
    assert torch.isfinite(latents(out)).all() and not torch.equal(latents(out), latents(classic))
    # the whole range is classic CFG, bit for bit
    full = wan_runtime("t2v").generate(with_denoise(t2v_request(steps=4), cfg="interval", cfg_window=[0.0, 1.0]))
    assert torch.equal(latents(full), latents(classic))


def test_adaptive_gate_reuses_the_delta_and_resets_at_the_expert_switch(counting, wan_runtime, t2v_request):
    rt, log = counting("wan22")  # 4 steps: transformer, transformer, transformer, transformer_2
    out = rt.generate(with_denoise(t2v_request(steps=4), cfg="adaptive-gate", gate_every=2))
    # step 0 full (warm-up), 1 reuses, 2 full (every 2), 3 full again: the expert switched
    assert [b for _, b, _ in log] == ["cond", "uncond", "cond", "cond", "uncond", "cond", "uncond"]
    pol = out.metrics["policies"]
    assert (pol["full_steps"], pol["cond_only_steps"], pol["invalidations"]) == (3, 1, 1)
    classic = wan_runtime("wan22").generate(t2v_request(steps=4))
    every_step = wan_runtime("wan22").generate(with_denoise(t2v_request(steps=4), cfg="adaptive-gate", gate_every=1))
    assert torch.equal(latents(every_step), latents(classic))


def test_requests_with_different_policies_interleave_like_they_run_alone(wan_runtime, t2v_request):
    rt = wan_runtime("wan22")
    reqs = [
        with_denoise(t2v_request(seed=1, steps=4), cfg="adaptive-gate", gate_every=2),
        with_denoise(t2v_request(seed=2, steps=3), sampler="dpmpp", cfg="batched"),
        with_denoise(t2v_request(seed=3, steps=3), sampler="few-step"),
    ]
    serial = [rt.generate(r) for r in reqs]
    for out, ref in zip(run_interleaved(rt, reqs), serial, strict=True):
        assert torch.equal(latents(out), latents(ref))


# -- validation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant, params, path, words",
    [
        ("t2v", {"sampler": "ddim"}, "node_params.denoise.sampler", ["node 'denoise'", "unknown sampler 'ddim'", "unipc"]),
        ("t2v", {"cfg": "pag"}, "node_params.denoise.cfg", ["node 'denoise'", "unknown cfg 'pag'", "batched"]),
        ("t2v", {"cfg_window": [0.2, 0.8]}, "node_params.denoise.cfg_window", ["node 'denoise'", "interval", "classic"]),
        ("t2v", {"cfg": "interval", "cfg_window": [0.8, 0.2]}, "node_params.denoise.cfg_window", ["start < end"]),
        ("t2v", {"gate_every": 2, "cfg": "batched"}, "node_params.denoise.gate_every", ["adaptive-gate", "'batched'"]),
        ("t2v", {"guidance_scale_2": 3.0}, "node_params.denoise.guidance_scale_2", ["node 'denoise'", "router 'single'"]),
        ("t2v", {"sampler": 3}, "node_params.denoise.sampler", ["string"]),
        ("t2v", {"shift": 0.0}, "node_params.denoise.shift", [""]),
        ("t2v", {"timesteps": [1000, 757]}, "node_params.denoise.timesteps", ["few-step"]),
        ("wan22", {"guidance_scale_2": -1.0}, "node_params.denoise.guidance_scale_2", [">= 0"]),
    ],
)
def test_bad_policy_knobs_name_the_node_and_the_policy(wan_runtime, t2v_request, variant, params, path, words):
    with pytest.raises(RequestError) as info:
        wan_runtime(variant).prepare(with_denoise(t2v_request(), **params))
    assert info.value.path == path
    for w in words:
        assert w in info.value.message


def test_node_param_steps_obey_the_limits(wan_runtime, t2v_request):
    rt = wan_runtime("t2v", limits={"max_steps": 3})
    with pytest.raises(RequestError) as info:
        rt.prepare(with_denoise(t2v_request(steps=2), steps=4))
    assert info.value.path == "node_params.denoise.steps" and "limit of 3" in info.value.message
    out = rt.generate(with_denoise(t2v_request(steps=3), steps=2, guidance_scale=1.0))
    assert out.metrics["steps"] == 2 and out.metrics["policies"]["cond_only_steps"] == 2  # node_params win


def test_deploy_policies_set_the_node_defaults(wan_runtime, t2v_request):
    rt = wan_runtime("t2v", policies={"sampler": "flow-euler", "cfg": "batched"})
    out = rt.generate(t2v_request(steps=2))
    assert out.metrics["policies"]["sampler"] == "flow-euler" and out.metrics["policies"]["cfg"] == "batched"
    chosen = rt.generate(with_denoise(t2v_request(steps=2), sampler="unipc", cfg="classic"))
    assert torch.equal(latents(chosen), latents(wan_runtime("t2v").generate(t2v_request(steps=2))))
    with pytest.raises(DeployError, match=r"policies\.samplr: unknown key"):
        wan_runtime("t2v", policies={"samplr": "unipc"})
    with pytest.raises(DeployError, match="no sampler policy named 'euler'"):
        wan_runtime("t2v", policies={"sampler": "euler"})


def test_bf16_untuned_request_is_bit_exact_with_diffusers(wan_runtime, t2v_request):
    """The scheduler step on diffusers' tensors as given (bf16 model output, fp32 latents)."""
    rt = wan_runtime("wan22", dtype="bfloat16")
    req = with_denoise(t2v_request(steps=4), guidance_scale_2=3.0)
    out = rt.generate(req)
    assert rt.model.components["transformer"].dtype == torch.bfloat16
    assert_bit_exact(out, *run_diffusers(rt.model, req))


def test_in_memory_components_default_to_their_scheduler_class(wan_runtime):
    """``from_components`` with a scheduler built in memory (no ``_class_name`` in its config)."""
    from diffusers import UniPCMultistepScheduler

    from omniloop_wan.family import WanFamily
    from omniloop_wan.policies import menu_for

    comps = dict(wan_runtime("t2v").model.components)
    config = {k: v for k, v in comps["scheduler"].config.items() if not k.startswith("_")}
    comps["scheduler"] = UniPCMultistepScheduler(**config)
    model = WanFamily().from_components(comps)
    assert menu_for(model).default_sampler == "unipc"


def test_checkpoint_default_shift_applies_when_the_request_gives_none(tiny_ckpt, wan_runtime, t2v_request, tmp_path):
    """``omniloop.json`` ``defaults.shift`` (wan-demo v2 samples at shift 5 while its scheduler config
    keeps diffusers' 3): an untuned request runs it, a request's own shift wins, a bad value is one
    DeployError naming the file before any compute."""
    import json
    import shutil

    from omniloop.runtime import Runtime

    from .conftest import wan_manager

    src = tiny_ckpt("t2v")
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    meta = json.loads((ck / "omniloop.json").read_text())
    meta["defaults"]["shift"] = 7.0
    (ck / "omniloop.json").write_text(json.dumps(meta))
    rt = Runtime.from_model(ck, manager=wan_manager())
    base = wan_runtime("t2v")
    assert torch.equal(latents(rt.generate(t2v_request(steps=2))), latents(base.generate(t2v_request(steps=2, shift=7.0))))
    assert torch.equal(latents(rt.generate(t2v_request(steps=2, shift=2.0))),
                       latents(base.generate(t2v_request(steps=2, shift=2.0))))
    assert not torch.equal(latents(rt.generate(t2v_request(steps=2))), latents(base.generate(t2v_request(steps=2))))
    for bad in ("high", -1.0, True):
        meta["defaults"]["shift"] = bad
        (ck / "omniloop.json").write_text(json.dumps(meta))
        with pytest.raises(DeployError) as info:
            Runtime.from_model(ck, manager=wan_manager())
        msg = str(info.value)
        assert "omniloop.json" in msg and "defaults.shift" in msg and "\n" not in msg
