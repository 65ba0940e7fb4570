"""Flow shift, expert routing and precision policies."""

from __future__ import annotations

import pytest
import torch
from diffusers import UniPCMultistepScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as diffusers_calculate_shift

from omniloop.loop import StepContext
from omniloop_policies import (
    BoundaryRouter,
    ConstantShift,
    PolicyError,
    PrecisionPolicy,
    ResolutionShift,
    ShiftValue,
    SingleExpert,
    calculate_shift,
    parse_dtype,
)
from omniloop_policies.testing import WAN_UNIPC_CONFIG


@pytest.mark.parametrize("seq_len", [64, 256, 1024, 4096, 9000])
def test_calculate_shift_is_diffusers(seq_len):
    assert calculate_shift(seq_len) == diffusers_calculate_shift(seq_len)


def test_constant_shift_precedence():
    assert ConstantShift().resolve() == ShiftValue(shift=None)  # the checkpoint's
    assert ConstantShift(default=5.0).resolve() == ShiftValue(shift=5.0)
    assert ConstantShift(default=5.0).resolve(requested=3.0) == ShiftValue(shift=3.0)
    with pytest.raises(PolicyError, match="> 0"):
        ConstantShift().resolve(requested=-1.0)


def test_resolution_shift_uses_the_token_count_unless_a_shift_is_requested():
    pol = ResolutionShift.from_config(
        {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}
    )
    assert pol.resolve(seq_len=4096) == ShiftValue(mu=pytest.approx(1.15))
    assert pol.resolve(seq_len=4096, requested=2.0) == ShiftValue(shift=2.0)
    with pytest.raises(PolicyError, match="seq_len"):
        pol.resolve()


def test_mu_on_a_non_dynamic_sampler_is_the_same_exponential_shift():
    from omniloop_policies import UniPCSampler

    sampler = UniPCSampler.from_config(WAN_UNIPC_CONFIG)
    mu = calculate_shift(1024)
    a = sampler.init(10, mu=mu).sigma_values
    b = sampler.init(10, shift=float(torch.tensor(mu).exp())).sigma_values
    assert a == pytest.approx(b, abs=1e-6)


def test_boundary_router_matches_the_diffusers_wan22_rule():
    router = BoundaryRouter(boundary_ratio=0.875)
    sched = UniPCMultistepScheduler.from_config({**WAN_UNIPC_CONFIG, "flow_shift": 12.0})
    sched.set_timesteps(40)
    boundary = 0.875 * sched.config.num_train_timesteps
    for t in sched.timesteps:
        want = "transformer" if t >= boundary else "transformer_2"  # pipeline_wan.py
        assert router.active_expert(float(t)) == want
        ctx = StepContext(request_id="r", node="denoise", step_index=0, num_steps=40, timestep=float(t))
        assert router.active_expert(ctx) == want
    assert router.experts == ("transformer", "transformer_2")


def test_boundary_router_from_model_index():
    assert BoundaryRouter.from_config({"_class_name": "WanPipeline"}) is None
    r = BoundaryRouter.from_config({"boundary_ratio": 0.9})
    assert r is not None and r.boundary_timestep == 900.0


@pytest.mark.parametrize("ratio", [0.0, 1.0, -0.5, float("nan")])
def test_boundary_router_rejects_bad_ratios(ratio):
    with pytest.raises(PolicyError, match="boundary_ratio"):
        BoundaryRouter(boundary_ratio=ratio)


def test_single_expert():
    assert SingleExpert().active_expert(999.0) == "transformer"
    assert SingleExpert(expert="dit").experts == ("dit",)


def test_precision_policy_dtypes_and_autocast():
    p = PrecisionPolicy(
        dtypes={"transformer": "bf16", "vae": "float32"},
        autocast={"transformer": "bfloat16"},
        step_dtype="fp32",
        combine_dtype="native",
    )
    assert p.dtype_for("transformer") == torch.bfloat16 and p.dtype_for("text_encoder") == torch.float32
    assert p.step_dtype == torch.float32 and p.combine_dtype is None
    with p.autocast_for("transformer", "cpu"):
        y = torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert y.dtype == torch.bfloat16
    with p.autocast_for("vae", "cpu"):
        assert torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype == torch.float32
    assert p.to_model("transformer", torch.ones(2)).dtype == torch.bfloat16


def test_precision_rejects_unknown_dtypes():
    with pytest.raises(PolicyError, match="not a dtype"):
        PrecisionPolicy(dtypes={"transformer": "int7"})
    assert parse_dtype("torch.float16") == torch.float16


def test_combine_dtype_is_applied_before_the_cfg_combine():
    from omniloop.loop import LoopState
    from omniloop_policies import PolicyMenu

    menu = PolicyMenu.build(WAN_UNIPC_CONFIG, precision=PrecisionPolicy(combine_dtype="float32"))
    pol = menu.resolve()
    loop = LoopState()
    pol.init(loop, device="cpu")
    step = pol.step_context(loop, request_id="r", node="denoise")
    c, u = torch.randn(2, 3).bfloat16(), torch.randn(2, 3).bfloat16()
    out = pol.combine(step, loop, {"cond": c, "uncond": u})
    assert out.dtype == torch.float32
    assert torch.equal(out, u.float() + 5.0 * (c.float() - u.float()))
