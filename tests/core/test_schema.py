"""Request schema: JSON round trip, strict types, dotted-path errors."""

import pytest

from omniloop.errors import RequestError
from omniloop.request import ImagePart, TaskType, TextPart
from omniloop.schema import request_from_dict, request_to_dict


def test_round_trip_is_lossless():
    req = request_from_dict({
        "task": "i2v", "prompt": "a fox", "negative_prompt": "blurry",
        "inputs": [{"type": "image", "path": "/tmp/x.png"}],
        "diffusion": {"steps": 4, "guidance_scale": 5, "seed": 3, "frames": 9},
        "outputs": {"return_latents": True}, "plugin_params": {"cache-dit": {"Fn": 4}},
        "priority": 2, "exact": True,
    })
    assert req.task is TaskType.I2V
    assert req.prompt == "a fox" and req.negative_prompt == "blurry"
    assert isinstance(req.image(), ImagePart)
    assert req.diffusion.guidance_scale == 5.0 and isinstance(req.diffusion.guidance_scale, float)
    assert request_from_dict(request_to_dict(req)) == req


@pytest.mark.parametrize("body, path, words", [
    ({"task": "t2v", "bogus": 1}, "bogus", "unknown key"),
    ({"task": "t2v", "diffusion": {"stepz": 1}}, "diffusion.stepz", "unknown key"),
    ({"task": "t2v", "diffusion": {"steps": -1}}, "diffusion.steps", ">= 1"),
    ({"task": "t2v", "diffusion": {"steps": 0}}, "diffusion.steps", ">= 1"),
    ({"task": "t2v", "diffusion": {"steps": "5"}}, "diffusion.steps", "integer"),
    ({"task": "t2v", "diffusion": {"guidance_scale": -1.0}}, "diffusion.guidance_scale", ">= 0"),
    ({"task": "t2v", "diffusion": 5}, "diffusion", "object"),
    ({"task": "t2v", "exact": 1}, "exact", "true or false"),
    ({"task": "t2v", "priority": True}, "priority", "integer"),
    ({"task": "teleport"}, "task", "t2v"),
    ({"prompt": "x"}, "task", "missing"),
    ({"task": "t2v", "inputs": [{"type": "smell"}]}, "inputs.0.type", "unknown input type"),
    ({"task": "t2v", "inputs": [{"type": "text", "text": 3}]}, "inputs.0.text", "string"),
    ({"task": "t2v", "inputs": [{"type": "image"}]}, "inputs.0", "exactly one"),
    ({"task": "t2v", "prompt": 7}, "prompt", "string"),
    ({"task": "t2v", "plugin_params": {"x": 3}}, "plugin_params.x", "object"),
])
def test_bad_requests_name_the_field(body, path, words):
    with pytest.raises(RequestError) as err:
        request_from_dict(body)
    assert err.value.path == path
    assert words in str(err.value)
    assert str(err.value).startswith(path)


def test_text_parts_join_by_role():
    req = request_from_dict({"task": "t2v", "inputs": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"},
        {"type": "text", "text": "n", "role": "negative_prompt"}]})
    assert req.prompt == "a b" and req.negative_prompt == "n"
    assert all(isinstance(p, TextPart) for p in req.inputs)


# --------------------------------------------------------------------------------------------
# issue 14: non-finite numbers, huge ints, wrong nested types, invalid text, short errors
# --------------------------------------------------------------------------------------------

import json  # noqa: E402

import attrs  # noqa: E402

from omniloop.deploy import load_deploy  # noqa: E402
from omniloop.errors import DeployError  # noqa: E402
from omniloop.schema import structure_params  # noqa: E402

NAN, INF = float("nan"), float("inf")
HUGE = 10**5000  # 5,001 digits: more than Python will even print by default


def _deep(n):
    """``[[[...]]]`` nested ``n`` levels (built without recursion)."""
    v: list = []
    for _ in range(n - 1):
        v = [v]
    return v


DEEP = _deep(1000)


@pytest.mark.parametrize("body, path, words", [
    ({"diffusion": {"guidance_scale": NAN}}, "diffusion.guidance_scale", "finite"),
    ({"diffusion": {"guidance_scale": INF}}, "diffusion.guidance_scale", "finite"),
    ({"diffusion": {"guidance_scale": json.loads("1e999")}}, "diffusion.guidance_scale", "finite"),
    ({"diffusion": {"fps": NAN}}, "diffusion.fps", "finite"),
    ({"diffusion": {"fps": -INF}}, "diffusion.fps", "finite"),
    ({"diffusion": {"fps": 1e-300}}, "diffusion.fps", ">= 0.1"),
    ({"diffusion": {"fps": 1e308}}, "diffusion.fps", "<= 1000"),
    ({"diffusion": {"shift": NAN}}, "diffusion.shift", "finite"),
    ({"sampling": {"top_p": NAN}}, "sampling.top_p", "finite"),
    ({"inputs": [{"type": "action", "values": [1.0, NAN]}]}, "inputs.0.values.1", "finite"),
    ({"diffusion": {"seed": HUGE}}, "diffusion.seed", "5001-digit"),
    ({"diffusion": {"guidance_scale": HUGE}}, "diffusion.guidance_scale", "out of range"),
    ({"diffusion": {"steps": 2**64}}, "diffusion.steps", "64 bits"),
    ({"priority": -HUGE}, "priority", "64 bits"),
    ({"plugin_params": {"cache": {"threshold": NAN}}}, "plugin_params.cache.threshold", "finite"),
    ({"node_params": {"denoise": {"deep": {"x": [INF]}}}}, "node_params.denoise.deep.x.0", "finite"),
    ({"node_params": {"denoise": DEEP}}, "node_params.denoise", "expected an object"),
    ({"node_params": {"denoise": {"x": DEEP}}}, "node_params.denoise.x" + ".0" * 32, "levels deep"),
    ({"node_params": {"denoise": 5}}, "node_params.denoise", "expected an object"),
    ({"node_params": [1]}, "node_params", "expected an object"),
    ({"diffusion": {"fps": "abc"}}, "diffusion.fps", "expected a number"),
    ({"inputs": 5}, "inputs", "expected a list"),
    ({"inputs": [{"type": "action", "values": "abc"}]}, "inputs.0.values", "expected a list"),
    ({"request_id": [1]}, "request_id", "expected a string"),
    ({"prompt": "\ud800"}, "inputs.0.text", "Unicode"),
    ({"prompt": "x\x00y"}, "inputs.0.text", "NUL"),
    ({"plugin_params": {"\ud800": {}}}, "plugin_params.\\ud800", "Unicode"),
])
def test_bad_values_are_refused_at_validation_naming_the_field(body, path, words):
    with pytest.raises(RequestError) as err:
        request_from_dict({"task": "t2v", **body})
    assert err.value.path == path
    assert words in err.value.message
    str(err.value).encode("utf-8")  # printable and JSON-able even for a lone surrogate


@pytest.mark.parametrize("rid", ["/abs/dir/x", "../../etc/passwd", "a/b", "", ".hidden", "x\x00", "a" * 129, "é"])
def test_request_ids_are_identifiers_not_paths(rid):
    with pytest.raises(RequestError) as err:
        request_from_dict({"task": "t2v", "prompt": "x", "request_id": rid})
    assert err.value.path == "request_id"


@pytest.mark.parametrize("rid", ["abc123", "__warmup__", "vid_0a1b", "r-1.2:3@x+y=z", "a" * 128])
def test_ordinary_request_ids_pass(rid):
    assert request_from_dict({"task": "t2v", "prompt": "x", "request_id": rid}).request_id == rid


@pytest.mark.parametrize("body", [
    {"outputs": {"format": "x" * (1 << 20)}},
    {"task": "x" * (1 << 20)},
    {"x" * (1 << 20): 1},
    {"inputs": [{"type": "y" * (1 << 20)}]},
    {"diffusion": {"steps": "z" * (1 << 20)}},
    {"request_id": "r" * (1 << 20)},
])
def test_errors_never_echo_a_huge_value(body):
    with pytest.raises(RequestError) as err:
        request_from_dict({"task": "t2v", **body})
    assert len(str(err.value)) < 400, str(err.value)[:500]


def test_finite_floats_and_64_bit_ints_still_pass():
    req = request_from_dict({"task": "t2v", "prompt": "x", "diffusion": {
        "guidance_scale": 1e300, "fps": 0.1, "seed": 2**63 - 1, "shift": 5e-324}})
    assert req.diffusion.seed == 2**63 - 1 and req.diffusion.fps == 0.1


@pytest.mark.parametrize("deploy, where", [
    ({"options": {"shift": NAN}}, "options.shift"),
    ({"policies": {"guidance": {"scale": INF}}}, "policies.guidance"),
    ({"plugins": {"cache": {"threshold": NAN}}}, "plugins.cache.threshold"),
    ({"scheduler_options": {"memory_budget_gib": json.loads("1e999")}}, "scheduler_options.memory_budget_gib"),
    ({"limits": {"max_steps": HUGE}}, "limits.max_steps"),
    ({"limits": 5}, "limits"),
])
def test_deploy_files_refuse_non_finite_numbers_and_huge_ints(deploy, where):
    with pytest.raises(DeployError) as err:
        load_deploy(deploy)
    assert where in str(err.value) and len(str(err.value)) < 300


def test_a_deploy_file_with_nan_names_the_file(tmp_path):
    f = tmp_path / "deploy.json"
    f.write_text('{"model": {"preset": "x"}, "options": {"shift": NaN}}')
    with pytest.raises(DeployError) as err:
        load_deploy(f)
    assert "deploy.json" in str(err.value) and "options.shift" in str(err.value) and "finite" in str(err.value)


@attrs.define(frozen=True)
class _Params:
    threshold: float = attrs.field(default=0.1, metadata={"ge": 0.0})
    extra: dict = attrs.field(factory=dict)


@pytest.mark.parametrize("params, path", [
    ({"threshold": NAN}, "plugin_params.p.threshold"),
    ({"threshold": -INF}, "plugin_params.p.threshold"),
    ({"extra": {"k": INF}}, "plugin_params.p.extra.k"),
])
def test_plugin_params_refuse_non_finite_numbers(params, path):
    with pytest.raises(RequestError) as err:
        structure_params(_Params, params, "plugin_params.p")
    assert err.value.path.startswith(path) and "finite" in err.value.message
