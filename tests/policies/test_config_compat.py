"""A checkpoint scheduler config a flow sampler cannot run is rejected (or normalized) at load,
with a message naming the file and the key — never a silent black video."""

from __future__ import annotations

import pytest
import torch
from diffusers import UniPCMultistepScheduler

from omniloop.errors import CheckpointError, RequestError
from omniloop_policies import (
    DPMppSampler,
    FewStepSampler,
    FlowEulerSampler,
    PolicyError,
    PolicyMenu,
    SchedulerConfigError,
    UniPCSampler,
)
from omniloop_policies.testing import WAN_UNIPC_CONFIG

SRC = "ckpt/scheduler/scheduler_config.json"
FLOW_SAMPLERS = [FlowEulerSampler, UniPCSampler, DPMppSampler, FewStepSampler]


@pytest.mark.parametrize("cls", FLOW_SAMPLERS, ids=lambda c: c.name)
@pytest.mark.parametrize("pred", ["epsilon", "v_prediction", "sample"])
def test_non_flow_prediction_is_rejected_naming_file_and_key(cls, pred):
    with pytest.raises(SchedulerConfigError) as info:
        cls.from_config({**WAN_UNIPC_CONFIG, "prediction_type": pred}, source=SRC)
    msg = str(info.value)
    assert SRC in msg and "UniPCMultistepScheduler" in msg
    assert f"prediction_type={pred!r}" in msg and cls.name in msg
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, PolicyError)


def test_multistep_config_without_prediction_type_defaults_to_epsilon_and_is_rejected():
    cfg = {k: v for k, v in WAN_UNIPC_CONFIG.items() if k != "prediction_type"}
    with pytest.raises(SchedulerConfigError, match=r"prediction_type is not set.*defaults to 'epsilon'"):
        UniPCSampler.from_config(cfg, source=SRC)


def test_epsilon_scheduler_class_is_rejected():
    ddim = {"_class_name": "DDIMScheduler", "num_train_timesteps": 1000, "beta_schedule": "scaled_linear"}
    with pytest.raises(SchedulerConfigError, match="DDIMScheduler"):
        FlowEulerSampler.from_config(ddim, source=SRC)


@pytest.mark.parametrize("key", ["use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "use_lu_lambdas"])
@pytest.mark.parametrize("cls", [FlowEulerSampler, UniPCSampler, DPMppSampler], ids=lambda c: c.name)
def test_vp_sigma_rewrites_are_rejected(cls, key):
    with pytest.raises(SchedulerConfigError, match=f"{key}=true is a VP-sigma rewrite.*Set {key}=false"):
        cls.from_config({**WAN_UNIPC_CONFIG, key: True}, source=SRC)


def test_karras_with_flow_sigmas_really_is_a_broken_schedule_in_diffusers():
    """Why the rule exists: diffusers takes the karras branch and ignores flow_shift entirely."""
    good = UniPCMultistepScheduler.from_config(WAN_UNIPC_CONFIG)
    bad = UniPCMultistepScheduler.from_config({**WAN_UNIPC_CONFIG, "use_karras_sigmas": True})
    good.set_timesteps(10)
    bad.set_timesteps(10)
    assert not torch.allclose(good.sigmas, bad.sigmas)


def test_thresholding_is_rejected():
    with pytest.raises(SchedulerConfigError, match="thresholding=true"):
        UniPCSampler.from_config({**WAN_UNIPC_CONFIG, "thresholding": True}, source=SRC)


def test_flow_prediction_without_flow_sigmas_is_normalized_with_a_note():
    cfg = {**WAN_UNIPC_CONFIG, "use_flow_sigmas": False}
    sampler = UniPCSampler.from_config(cfg, source=SRC)
    assert sampler.config["use_flow_sigmas"] is True
    assert len(sampler.notes) == 1 and SRC in sampler.notes[0] and "normalized to flow sigmas" in sampler.notes[0]
    # the normalized sampler runs exactly the correct flow schedule
    ref = UniPCSampler.from_config(WAN_UNIPC_CONFIG)
    assert sampler.init(8).sigma_values == ref.init(8).sigma_values


def test_flow_prediction_without_flow_sigmas_is_rejected_when_strict():
    with pytest.raises(SchedulerConfigError, match="use_flow_sigmas=true"):
        UniPCSampler.from_config({**WAN_UNIPC_CONFIG, "use_flow_sigmas": False}, source=SRC, strict=True)


def test_dpm_solver_without_plus_plus_is_normalized_for_flow():
    cfg = {**WAN_UNIPC_CONFIG, "_class_name": "DPMSolverMultistepScheduler", "algorithm_type": "dpmsolver"}
    sampler = DPMppSampler.from_config(cfg, source=SRC)
    assert sampler.config["algorithm_type"] == "dpmsolver++"
    assert any("normalized to 'dpmsolver++'" in n for n in sampler.notes)
    with pytest.raises(SchedulerConfigError, match="algorithm_type='dpmsolver'"):
        DPMppSampler.from_config(cfg, source=SRC, strict=True)
    with pytest.raises(SchedulerConfigError, match="algorithm_type='sde-dpmsolver'"):
        DPMppSampler.from_config(WAN_UNIPC_CONFIG, source=SRC, strict=True, algorithm_type="sde-dpmsolver")


@pytest.mark.parametrize("shift", [0, -1.0, float("nan"), "three"])
def test_bad_shift_is_rejected(shift):
    with pytest.raises(SchedulerConfigError, match="flow_shift"):
        UniPCSampler.from_config({**WAN_UNIPC_CONFIG, "flow_shift": shift}, source=SRC)


def test_schedule_keys_the_target_cannot_honour_are_rejected_not_dropped():
    cfg = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "shift_terminal": 0.1}
    assert FlowEulerSampler.from_config(cfg).config["shift_terminal"] == 0.1
    with pytest.raises(SchedulerConfigError, match="shift_terminal"):
        DPMppSampler.from_config(cfg, source=SRC)


def test_another_class_config_feeds_a_sampler_with_its_shift():
    sampler = FlowEulerSampler.from_config(WAN_UNIPC_CONFIG, source=SRC)
    assert sampler.shift == 3.0 and sampler.config["shift"] == 3.0
    assert "solver_order" in sampler.ignored  # listed, not silently mixed in


def test_unknown_and_owned_options_are_policy_errors():
    with pytest.raises(PolicyError, match="unknown option 'solver_ordr'"):
        UniPCSampler.from_config(WAN_UNIPC_CONFIG, solver_ordr=3)
    with pytest.raises(PolicyError, match="owned by the sampler"):
        UniPCSampler.from_config(WAN_UNIPC_CONFIG, prediction_type="epsilon")
    assert UniPCSampler.from_config(WAN_UNIPC_CONFIG, solver_order=3).config["solver_order"] == 3


def test_menu_build_fails_at_load_when_the_default_sampler_cannot_run():
    eps = {**WAN_UNIPC_CONFIG, "prediction_type": "epsilon"}
    with pytest.raises(SchedulerConfigError, match=SRC):
        PolicyMenu.build(eps, source=SRC)


def test_menu_records_unavailable_samplers_and_requests_get_the_reason():
    cfg = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "shift_terminal": 0.1}
    menu = PolicyMenu.build(cfg, source=SRC, default_sampler="flow-euler")
    assert "dpmpp" in menu.unavailable and "dpmpp" not in menu.samplers
    with pytest.raises(RequestError) as info:
        menu.resolve(params={"sampler": "dpmpp"})
    assert info.value.path == "node_params.denoise.sampler"
    assert "cannot run on this model" in str(info.value) and "shift_terminal" in str(info.value)
