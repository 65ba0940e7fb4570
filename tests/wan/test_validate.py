"""Bad requests fail before any compute with an error naming the field; soft problems are warnings."""

from __future__ import annotations

import base64

import pytest

from omniloop.errors import RequestError
from omniloop.request import Status


def _prepare_error(rt, req) -> RequestError:
    with pytest.raises(RequestError) as info:
        rt.prepare(req)
    return info.value


@pytest.mark.parametrize(
    "field, value, path, words",
    [
        ("frames", 10, "diffusion.frames", "4k+1"),
        ("frames", 8, "diffusion.frames", "try 5 or 9"),
        ("height", 40, "diffusion.height", "multiple of 16"),
        ("width", 30, "diffusion.width", "multiple of 16"),
        ("steps", 0, "diffusion.steps", ""),
        ("guidance_scale", -1.0, "diffusion.guidance_scale", ""),
        ("shift", 0.0, "diffusion.shift", ""),
    ],
)
def test_bad_diffusion_params_name_the_field(wan_runtime, t2v_request, field, value, path, words):
    err = _prepare_error(wan_runtime("t2v"), t2v_request(**{field: value}))
    assert err.path == path
    assert words in err.message


def test_limits_of_the_deployment(wan_runtime, t2v_request):
    rt = wan_runtime("t2v", limits={"max_steps": 3, "max_frames": 9, "max_height": 32, "max_width": 32})
    assert rt.prepare(t2v_request(steps=3))
    for field, value in (("steps", 4), ("frames", 13), ("height", 48), ("width", 48)):
        err = _prepare_error(rt, t2v_request(**{field: value}))
        assert err.path == f"diffusion.{field}" and "limit" in err.message


def test_the_limits_apply_to_the_resolved_defaults_once(wan_runtime, t2v_request):
    """The default steps of a model may exceed the deploy's limits: the runtime checks the resolved
    workload (defaults applied), once, after resolve. Issue 34: the family no longer checks limits
    itself (``validate_request`` with tight limits passes; it was the second copy of this check)."""
    from omniloop.deploy import Limits
    from omniloop.schema import request_from_dict

    rt = wan_runtime("t2v", limits={"max_steps": 1})
    err = _prepare_error(rt, t2v_request(steps=None))  # tiny default: 2 steps
    assert err.path == "diffusion.steps" and err.message == "2 is above this deployment's limit of 1"
    req = request_from_dict(t2v_request(steps=None))
    assert rt.family.validate_request(rt.model, req, Limits(max_steps=1)) == []
    assert wan_runtime("t2v", limits={"max_steps": 5}).prepare(t2v_request(steps=None))


def test_a_node_param_override_is_checked_by_its_own_path(wan_runtime, t2v_request):
    rt = wan_runtime("t2v", limits={"max_steps": 3})
    err = _prepare_error(rt, {**t2v_request(steps=2), "node_params": {"denoise": {"steps": 4}}})
    assert err.path == "node_params.denoise.steps" and err.message == "4 is above this deployment's limit of 3"


def test_size_multiple_follows_the_vae_and_patch(wan_runtime, t2v_request):
    # TI2V-5B: VAE x16 and 2x2 patches → multiples of 32
    err = _prepare_error(wan_runtime("ti2v"), t2v_request(height=48, width=64))
    assert err.path == "diffusion.height" and "multiple of 32" in err.message


def test_i2v_without_image(wan_runtime, t2v_request):
    req = t2v_request()
    req["task"] = "i2v"
    err = _prepare_error(wan_runtime("i2v"), req)
    assert err.path == "inputs" and "needs an image" in err.message


def test_image_that_does_not_decode(wan_runtime, i2v_request, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    req = i2v_request()
    req["inputs"][-1] = {"type": "image", "path": str(bad)}
    err = _prepare_error(wan_runtime("i2v"), req)
    assert err.path == "inputs[2].path" and "could not be decoded" in err.message


def test_image_file_that_does_not_exist(wan_runtime, i2v_request, tmp_path):
    req = i2v_request()
    req["inputs"][-1] = {"type": "image", "path": str(tmp_path / "missing.png")}
    err = _prepare_error(wan_runtime("i2v"), req)
    assert err.path == "inputs[2].path" and "does not exist" in err.message


def test_image_as_bad_base64(wan_runtime, i2v_request):
    req = i2v_request()
    req["inputs"][-1] = {"type": "image", "data_b64": "%%%not base64"}
    err = _prepare_error(wan_runtime("i2v"), req)
    assert err.path == "inputs[2].data_b64"


def test_image_as_base64_runs(wan_runtime, i2v_request, image_file):
    rt = wan_runtime("i2v")
    by_path = rt.generate(i2v_request(steps=1))
    req = i2v_request(steps=1)
    req["inputs"][-1] = {"type": "image", "data_b64": base64.b64encode(image_file.read_bytes()).decode()}
    by_data = rt.generate(req)
    assert by_data.ok
    assert (by_data.artifacts["video"].frames == by_path.artifacts["video"].frames).all()


def test_task_the_checkpoint_cannot_do(wan_runtime, t2v_request):
    err = _prepare_error(wan_runtime("i2v"), t2v_request())
    assert err.path == "task" and "wan2.1-i2v" in err.message


def test_prompt_is_required(wan_runtime, t2v_request):
    req = t2v_request()
    req["inputs"] = [{"type": "text", "text": "   "}]
    err = _prepare_error(wan_runtime("t2v"), req)
    assert err.path == "inputs" and "prompt" in err.message


def test_long_prompt_is_truncated_with_a_warning(wan_runtime, t2v_request):
    rt = wan_runtime("t2v")
    req = t2v_request(steps=1)
    req["inputs"][0]["text"] = "fox " * 600
    ex = rt.prepare(req)
    assert any("truncated" in w and "512" in w for w in ex.state.metrics["warnings"])
    out = ex.run()
    assert out.status is Status.COMPLETED
    assert len(out.metrics["warnings"]) == 1  # said once, not again by the validate node


def test_image_given_to_t2v_is_ignored_with_a_warning(wan_runtime, t2v_request, image_file):
    req = t2v_request(steps=1)
    req["inputs"].append({"type": "image", "path": str(image_file)})
    ex = wan_runtime("ti2v").prepare({**req, "diffusion": {**req["diffusion"], "height": 64, "width": 64}})
    assert any("ignored" in w for w in ex.state.metrics["warnings"])


def test_unknown_node_param_is_refused(wan_runtime, t2v_request):
    req = t2v_request()
    req["node_params"] = {"denoise": {"guidance_scale_2": -2.0}}
    err = _prepare_error(wan_runtime("wan22"), req)
    assert err.path.startswith("node_params.denoise.guidance_scale_2")


def test_defaults_come_from_the_checkpoint(wan_runtime):
    rt = wan_runtime("t2v")
    out = rt.generate({"task": "t2v", "inputs": [{"type": "text", "text": "a fox"}]})
    assert out.ok, out.error
    assert out.metrics["steps"] == 2  # omniloop.json of the tiny checkpoint
    assert tuple(out.artifacts["video"].frames.shape) == (9, 32, 32, 3)
    assert out.artifacts["video"].fps == 16.0
    assert "latents" not in out.artifacts  # only when outputs.return_latents


def test_last_frame_image_is_not_supported_yet(wan_runtime, i2v_request, image_file):
    req = i2v_request(steps=1)
    req["inputs"].append({"type": "image", "path": str(image_file), "role": "last_frame"})
    ex = wan_runtime("i2v").prepare(req)
    assert any("last_frame" in w and "ignored" in w for w in ex.state.metrics["warnings"])
    req["inputs"] = [p for p in req["inputs"] if p["type"] != "image" or p.get("role") == "last_frame"]
    err = _prepare_error(wan_runtime("i2v"), req)  # a last frame alone is no first frame
    assert err.path == "inputs" and "first_frame" in err.message


def test_runtime_defaults_per_task(wan_runtime):
    rt = wan_runtime("wan22")
    d = rt.defaults("t2v")
    assert (d["steps"], d["height"], d["width"], d["frames"], d["fps"]) == (2, 32, 32, 9, 16.0)
    assert d["sampler"] == "unipc" and d["cfg"] == "classic" and d["guidance_scale"] == 5.0
