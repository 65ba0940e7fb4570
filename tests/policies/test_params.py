"""Denoise node params: validated with errors naming the node, the field path and the policy."""

from __future__ import annotations

import attrs
import pytest

from omniloop.errors import RequestError
from omniloop.request import DiffusionParams, OmniRequest, TaskType
from omniloop_policies import (
    AdaptiveGateCFG,
    BoundaryRouter,
    DenoiseParams,
    IntervalCFG,
    PolicyMenu,
)
from omniloop_policies.testing import WAN_UNIPC_CONFIG


@pytest.fixture(scope="module")
def menu() -> PolicyMenu:
    return PolicyMenu.build(WAN_UNIPC_CONFIG, default_guidance_scale=5.0, default_steps=30)


def req(node=None, **diffusion) -> OmniRequest:
    return OmniRequest(
        task=TaskType.T2V, diffusion=DiffusionParams(**diffusion), node_params={"denoise": node} if node else {}
    )


def error(menu, node=None, **diffusion) -> RequestError:
    with pytest.raises(RequestError) as info:
        menu.resolve(req(node, **diffusion))
    return info.value


@pytest.mark.parametrize(
    "node,path,fragment",
    [
        ({"samplr": "unipc"}, "node_params.denoise.samplr", "unknown key (samplr); known: sampler, cfg"),
        (
            {"sampler": "euler-a"},
            "node_params.denoise.sampler",
            "unknown sampler 'euler-a'; available: dpmpp, few-step, flow-euler, unipc",
        ),
        ({"sampler": 3}, "node_params.denoise.sampler", "expected a string, got int 3"),
        (
            {"cfg": "pag"},
            "node_params.denoise.cfg",
            "unknown cfg 'pag'; available: adaptive-gate, batched, classic, interval",
        ),
        ({"guidance_scale": -1}, "node_params.denoise.guidance_scale", "must be >= 0.0, got -1.0"),
        ({"guidance_scale": "high"}, "node_params.denoise.guidance_scale", "expected a number, got str 'high'"),
        ({"guidance_scale": float("nan")}, "node_params.denoise.guidance_scale", "must be a finite number, got float nan"),
        ({"shift": 0}, "node_params.denoise.shift", "must be > 0.0, got 0.0"),
        ({"steps": 0}, "node_params.denoise.steps", "must be >= 1, got 0"),
        ({"steps": 2.5}, "node_params.denoise.steps", "expected an integer, got float 2.5"),
        ({"cfg": "interval", "cfg_window": [0.8, 0.2]}, "node_params.denoise.cfg_window", "0 <= start < end <= 1"),
        ({"cfg": "interval", "cfg_window": [0.1]}, "node_params.denoise.cfg_window", "[start, end)"),
        (
            {"cfg_window": [0.1, 0.5]},
            "node_params.denoise.cfg_window",
            "read by the adaptive-gate / interval cfg policy, but this request uses cfg 'classic'",
        ),
        (
            {"gate_every": 2},
            "node_params.denoise.gate_every",
            "read by the adaptive-gate cfg policy, but this request uses cfg 'classic'; set cfg='adaptive-gate'",
        ),
        ({"cfg": "adaptive-gate", "gate_every": 0}, "node_params.denoise.gate_every", "must be >= 1, got 0"),
        (
            {"timesteps": [1000, 500]},
            "node_params.denoise.timesteps",
            "read by the few-step sampler policy, but this request uses sampler 'unipc'",
        ),
        ({"sampler": "few-step", "timesteps": [500, 1000]}, "node_params.denoise.timesteps", "strictly decreasing"),
        ({"modality_scales": {"audio": 2}}, "node_params.denoise.modality_scales", "per-modality"),
    ],
)
def test_invalid_params_name_the_node_the_path_and_the_policy(menu, node, path, fragment):
    err = error(menu, node)
    assert err.path == path
    # one line: the dotted path, the node, then what is wrong (with the value, cut short)
    assert str(err).startswith(f"{path}: node 'denoise': ") and "\n" not in str(err), str(err)
    assert fragment in str(err), str(err)


def test_few_step_with_a_different_step_count_names_the_field_it_came_from(menu):
    err = error(menu, {"sampler": "few-step"}, steps=20)
    assert err.path == "diffusion.steps" and "exactly its 3 distilled timesteps" in str(err)
    assert "steps=20 was asked" in str(err)
    err = error(menu, {"sampler": "few-step", "steps": 4})
    assert err.path == "node_params.denoise.steps" and "steps=4 was asked" in str(err)
    pol = menu.resolve(req({"sampler": "few-step"}))  # the family's default step count does not apply
    assert pol.num_steps is None
    pol = menu.resolve(req({"sampler": "few-step", "timesteps": [999, 500], "steps": 2}))
    assert pol.timesteps == (999, 500)


def test_guidance_scale_2_needs_a_second_expert(menu):
    err = error(menu, {"guidance_scale_2": 3.0})
    assert err.path == "node_params.denoise.guidance_scale_2" and "has one ('transformer')" in str(err)


def test_resolution_order_is_node_params_then_request_then_node_defaults(menu):
    pol = menu.resolve(req())
    assert (pol.sampler.name, pol.cfg.name, pol.guidance_scale, pol.num_steps, pol.requested_shift) == (
        "unipc",
        "classic",
        5.0,
        30,
        None,
    )
    pol = menu.resolve(req(steps=12, guidance_scale=4.0, shift=7.0))
    assert (pol.guidance_scale, pol.num_steps, pol.requested_shift) == (4.0, 12, 7.0)
    pol = menu.resolve(
        req(
            {"guidance_scale": 2.5, "steps": 8, "shift": 2.0, "sampler": "dpmpp"},
            steps=12,
            guidance_scale=4.0,
            shift=7.0,
        )
    )
    assert (pol.sampler.name, pol.guidance_scale, pol.num_steps, pol.requested_shift) == ("dpmpp", 2.5, 8, 2.0)


def test_guidance_scale_2_defaults_like_diffusers_wan_pipeline():
    menu = PolicyMenu.build(
        WAN_UNIPC_CONFIG,
        router=BoundaryRouter(boundary_ratio=0.875),
        default_guidance_scale=4.0,
        default_guidance_scale_2=3.0,
    )
    assert menu.resolve(req()).scales_by_expert == {"transformer_2": 3.0}  # model defaults
    assert menu.resolve(req(guidance_scale=6.0)).scales_by_expert == {"transformer_2": 6.0}  # = guidance_scale
    assert menu.resolve(req({"guidance_scale_2": 2.0}, guidance_scale=6.0)).scales_by_expert == {"transformer_2": 2.0}


def test_windows_and_gate_knobs_tune_a_copy_of_the_bound_policy(menu):
    pol = menu.resolve(req({"cfg": "interval", "cfg_window": [0.1, 0.6]}))
    assert isinstance(pol.cfg, IntervalCFG) and (pol.cfg.start, pol.cfg.end) == (0.1, 0.6)
    assert (menu.cfgs["interval"].start, menu.cfgs["interval"].end) == (0.0, 1.0)  # the menu is untouched
    pol = menu.resolve(req({"cfg": "adaptive-gate", "gate_every": 4, "gate_threshold": 0.1, "cfg_window": [0.0, 0.9]}))
    assert isinstance(pol.cfg, AdaptiveGateCFG)
    assert (pol.cfg.every, pol.cfg.threshold, pol.cfg.end) == (4, 0.1, 0.9)


def test_a_custom_node_name_is_used_in_paths():
    menu = PolicyMenu.build(WAN_UNIPC_CONFIG, node="denoise_hi")
    with pytest.raises(RequestError) as info:
        menu.resolve(OmniRequest(task=TaskType.T2V, node_params={"denoise_hi": {"sampler": "x"}}))
    assert info.value.path == "node_params.denoise_hi.sampler" and "node 'denoise_hi'" in str(info.value)


def test_params_must_be_an_object(menu):
    with pytest.raises(RequestError, match="params must be an object, got list") as info:
        menu.parse(["unipc"])
    assert info.value.path == "node_params.denoise"
    err = error(menu, "unipc")
    assert err.path == "node_params.denoise" and "params must be an object, got str" in str(err)


def test_parse_accepts_an_already_built_params_object(menu):
    p = menu.parse(DenoiseParams(sampler="flow-euler", guidance_scale=3.0))
    assert p == DenoiseParams(sampler="flow-euler", guidance_scale=3.0)


def test_the_schema_carries_range_metadata_for_the_core_converter():
    fields = attrs.fields_dict(DenoiseParams)
    assert fields["guidance_scale"].metadata == {"ge": 0.0}
    assert fields["shift"].metadata == {"gt": 0.0}
    assert fields["gate_every"].metadata == {"ge": 1}


def test_the_core_structure_params_accepts_the_schema():
    schema = pytest.importorskip("omniloop.schema")
    p = schema.structure_params(
        DenoiseParams, {"sampler": "unipc", "guidance_scale": 4.0, "cfg_window": [0.1, 0.5]}, "node_params.denoise"
    )
    assert p.sampler == "unipc" and p.cfg_window == (0.1, 0.5)
    with pytest.raises(RequestError) as info:
        schema.structure_params(DenoiseParams, {"guidance_scale": -1.0}, "node_params.denoise")
    assert info.value.path == "node_params.denoise.guidance_scale"


def test_describe_lists_what_the_node_offers():
    menu = PolicyMenu.build({**WAN_UNIPC_CONFIG, "use_flow_sigmas": False}, source="s.json")
    d = menu.describe()
    assert d["defaults"]["sampler"] == "unipc" and "classic" in d["cfgs"] and d["experts"] == ["transformer"]
    assert "normalized to flow sigmas" in d["notes"]["unipc"][0]
