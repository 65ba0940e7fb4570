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
