"""The FLUX.1 family through the public entry points: ``Runtime.from_model``, the ``flux`` entry
point, ``omniloop generate`` writing a PNG, the task defaults, and bad requests — each one error
naming the field, before any compute."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from omniloop.errors import RequestError
from omniloop.request import Status, TaskType


def test_entry_point_registers_the_family():
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="omniloop.plugins") if e.name == "flux"]
    assert eps and eps[0].value == "omniloop_flux.plugin"
    fams = {}
    eps[0].load().omniloop_register_families(register=lambda f: fams.setdefault(f.name, f))
    assert set(fams) == {"flux"} and fams["flux"].tasks == {TaskType.T2I, TaskType.I2I}


def test_from_model_detects_flux_and_generates(make_manager_flux, flux_ckpt, make_t2i):
    from omniloop import Runtime

    rt = Runtime.from_model(flux_ckpt("schnell"), device="cpu", dtype="float32", manager=make_manager_flux())
    assert rt.family.name == "flux"
    out = rt.generate(make_t2i(steps=2))
    assert out.status is Status.COMPLETED, out.error
    frames = out.artifacts["image"].frames
    assert frames.shape == (1, 64, 64, 3) and frames.dtype == torch.uint8
    assert out.artifacts["latents"].tensor.shape == (1, 4, 8, 8)
    assert out.metrics["steps"] == 2
    no_latents = rt.generate({"task": "t2i", "prompt": "a cat", "diffusion": {"steps": 1}})
    assert "latents" not in no_latents.artifacts


def test_task_defaults_are_diffusers_pipeline_defaults(flux_runtime):
    rt = flux_runtime("dev")
    fam, model = rt.family, rt.model
    t2i = fam.task_defaults(model, TaskType.T2I)
    i2i = fam.task_defaults(model, TaskType.I2I)
    assert t2i["guidance_scale"] == 3.5 and i2i["guidance_scale"] == 7.0 and i2i["strength"] == 0.6
    from omniloop_flux.defaults import defaults_for

    real = defaults_for(8)  # the FLUX.1 VAE: 8x, so default_sample_size 128 -> 1024
    assert (real["height"], real["width"], real["steps"], real["max_sequence_length"]) == (1024, 1024, 28, 512)


def test_i2i_from_base64_equals_from_path(flux_runtime, make_i2i, input_png):
    rt = flux_runtime("dev")
    by_path = rt.generate(make_i2i(input_png, steps=2))
    req = make_i2i(input_png, steps=2)
    req["inputs"] = [{"type": "image", "data_b64": base64.b64encode(input_png.read_bytes()).decode()}]
    by_b64 = rt.generate(req)
    assert torch.equal(by_path.artifacts["image"].frames, by_b64.artifacts["image"].frames)
    req["inputs"][0]["role"] = "reference"  # any image role the server or a client may use
    assert torch.equal(rt.generate(req).artifacts["image"].frames, by_path.artifacts["image"].frames)


def test_max_sequence_length_is_a_text_encode_param(flux_runtime, make_t2i):
    rt = flux_runtime("dev")
    a = rt.generate(make_t2i(steps=1))
    req = make_t2i(steps=1)
    req["node_params"] = {"text_encode": {"max_sequence_length": 16}}
    b = rt.generate(req)
    assert b.status is Status.COMPLETED, b.error
    assert not torch.equal(a.artifacts["latents"].tensor, b.artifacts["latents"].tensor)


BAD = [
    ({"diffusion": {"frames": 3}}, "diffusion.frames"),
    ({"diffusion": {"height": 8}}, "diffusion.height"),
    ({"diffusion": {"shift": 2.0}}, "diffusion.shift"),  # dev shifts by resolution
    ({"node_params": {"denoise": {"shift": 2.0}}}, "node_params.denoise.shift"),
    ({"node_params": {"denoise": [1]}}, "node_params.denoise"),
    ({"node_params": {"denoise": {"strength": 0.5}}}, "node_params.denoise.strength"),  # t2i
    ({"node_params": {"denoise": {"sampler": "unipc"}}}, "node_params.denoise.sampler"),
    ({"node_params": {"text_encode": {"max_sequence_length": 600}}}, "node_params.text_encode.max_sequence_length"),
    ({"node_params": {"text_encode": {"oops": 1}}}, "node_params.text_encode.oops"),
    ({"task": "t2v"}, "task"),
]


@pytest.mark.parametrize("change, field", BAD, ids=[b[1] for b in BAD])
def test_bad_requests_name_the_field(flux_runtime, make_t2i, change, field):
    req = {**make_t2i(steps=2), **change}
    with pytest.raises(RequestError) as err:
        flux_runtime("dev").prepare(req)
    assert err.value.path == field, err.value


def test_bad_i2i_requests(flux_runtime, make_i2i, input_png):
    rt = flux_runtime("dev")
    req = make_i2i(input_png, steps=2)
    req["inputs"] = []
    with pytest.raises(RequestError) as err:
        rt.prepare(req)
    assert err.value.path == "inputs"
    req = make_i2i(input_png, steps=2)
    req["node_params"] = {"denoise": {"strength": 1e-17}}  # 2 - int(2 - 2e-17) = 0 steps
    with pytest.raises(RequestError) as err:
        rt.prepare(req)
    assert err.value.path == "node_params.denoise.strength" and "no step" in str(err.value)
    req = make_i2i(input_png, steps=2)
    req["inputs"] = [{"type": "image", "data_b64": "not base64!"}]
    with pytest.raises(RequestError) as err:
        rt.prepare(req)
    assert err.value.path == "inputs[0].data_b64"


def test_negative_prompt_without_true_cfg_is_ignored_with_a_warning(flux_runtime, make_t2i):
    req = make_t2i(steps=1)
    req["inputs"] = [{"type": "text", "text": "blurry", "role": "negative_prompt"}]
    out = flux_runtime("dev").generate(req)
    assert any("negative prompt is ignored" in w for w in out.metrics["warnings"])
    assert torch.equal(out.artifacts["latents"].tensor, flux_runtime("dev").generate(make_t2i(steps=1)).artifacts["latents"].tensor)


def test_schnell_takes_a_fixed_shift(flux_runtime, make_t2i):
    a = flux_runtime("schnell").generate(make_t2i(steps=2))
    b = flux_runtime("schnell").generate(make_t2i(steps=2, shift=3.0))
    assert b.status is Status.COMPLETED, b.error
    assert not torch.equal(a.artifacts["latents"].tensor, b.artifacts["latents"].tensor)


def test_cli_generate_writes_a_png(make_manager_flux, flux_ckpt, tmp_path):
    from omniloop_cli import cli

    out = tmp_path / "fox.png"
    res = CliRunner().invoke(
        cli, ["generate", "a red fox", "--model", str(flux_ckpt("dev")), "--task", "t2i", "--steps", "2",
              "--seed", "5", "--out", str(out), "--json"],
        obj=make_manager_flux(),
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    assert doc["status"] == "completed" and Path(doc["output_path"]) == out
    img = np.asarray(Image.open(out))
    assert img.shape == (64, 64, 3)
    from omniloop import Runtime

    rt = Runtime.from_model(flux_ckpt("dev"), device="cpu", dtype="float32", manager=make_manager_flux())
    ref = rt.generate({"task": "t2i", "prompt": "a red fox", "diffusion": {"steps": 2, "seed": 5}})
    assert np.array_equal(img, ref.artifacts["image"].frames[0].numpy())


def test_cli_bad_request_is_one_line_exit_2(make_manager_flux, flux_ckpt):
    from omniloop_cli import cli

    res = CliRunner().invoke(
        cli, ["generate", "a red fox", "--model", str(flux_ckpt("dev")), "--task", "t2i", "--frames", "4"],
        obj=make_manager_flux(),
    )
    assert res.exit_code == 2, res.output
    assert "diffusion.frames" in res.stderr


def test_vae_in_its_own_dtype(flux_ckpt, make_manager_flux, make_i2i, input_png):
    """Deploy option ``vae_dtype``: a float32 VAE beside a bfloat16 transformer and text encoders."""
    from omniloop import Runtime

    rt = Runtime.from_model(flux_ckpt("dev"), device="cpu", dtype="bfloat16", manager=make_manager_flux(),
                            options={"vae_dtype": "float32"})
    assert rt.model.components["vae"].dtype == torch.float32
    assert rt.model.components["transformer"].dtype == torch.bfloat16
    out = rt.generate(make_i2i(input_png, steps=2))
    assert out.status is Status.COMPLETED, out.error
    assert out.artifacts["image"].frames.shape == (1, 64, 64, 3)


@pytest.mark.parametrize("extra", [[], ["--stream"]])
def test_a_causal_rollout_in_a_flux_deploy_is_refused(make_manager_flux, flux_ckpt, tmp_path, monkeypatch, extra) -> None:
    """Issue 34: ``options.rollout: causal`` in a FLUX deploy (FLUX has one rollout) ran a plain
    image and exited 0; now one line naming the option and the family, exit 2, before loading."""
    import json as _json

    from click.testing import CliRunner as _Runner

    from omniloop_cli import cli as _cli

    monkeypatch.chdir(tmp_path)
    deploy = tmp_path / "deploy.json"
    deploy.write_text(_json.dumps({"model": {"path": str(flux_ckpt())}, "options": {"rollout": "causal"}}))
    res = _Runner().invoke(_cli, ["generate", "a fox", "--deploy", str(deploy), "--task", "t2i", "--out", "a.png", *extra],
                           obj=make_manager_flux())
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert lines == ["error: options.rollout: family 'flux' has a single rollout and takes no options.rollout "
                     "(got 'causal'); remove it"], lines
    assert not (tmp_path / "a.png").exists()
