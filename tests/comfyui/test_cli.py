"""``omniloop comfy compile`` / ``omniloop comfy check`` (registered by the plugin's
``omniloop_register_commands``), in-process with click's CliRunner and an isolated manager."""

from __future__ import annotations

import json

from click.testing import CliRunner

import omniloop_comfyui.plugin as comfy_plugin
from omniloop.testing import make_manager
from omniloop_cli import cli


def invoke(args):
    return CliRunner().invoke(cli, args, obj=make_manager(("comfyui", comfy_plugin)))


def one_error_line(res):
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_compile_and_check_a_template(templates, tmp_path):
    path = tmp_path / "flux_schnell.json"
    path.write_text(json.dumps(templates("flux_schnell")))
    res = invoke(["comfy", "compile", str(path)])
    assert res.exit_code == 0, res.output
    (job,) = json.loads(res.stdout)
    assert job["request"]["task"] == "t2i" and job["request"]["diffusion"]["steps"] == 4
    assert job["saves"][0]["class_type"] == "SaveImage"
    res = invoke(["comfy", "check", str(path)])
    assert res.exit_code == 0 and "7 nodes: 7 mapped, 0 ignored, 0 unsupported" in res.stdout


def test_unsupported_graph_exits_2(templates, tmp_path):
    path = tmp_path / "wan.json"
    path.write_text(json.dumps(templates("text_to_video_wan")))
    res = invoke(["comfy", "check", str(path)])
    line = one_error_line(res)
    assert "uni_pc" in line
    assert "unsupported" in res.stdout and "KSampler" in res.stdout
    res = invoke(["comfy", "check", str(path), "--json"])
    report = json.loads(res.stdout)
    assert report["compiles"] is False and {n["status"] for n in report["nodes"]} >= {"mapped", "unsupported"}
    assert "uni_pc" in one_error_line(invoke(["comfy", "compile", str(path)]))


def test_bad_files_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert "cannot read the workflow" in one_error_line(invoke(["comfy", "compile", str(bad)]))
    bad.write_text(json.dumps({"1": {"class_type": "Mystery", "inputs": {}}}))
    assert "Mystery" in one_error_line(invoke(["comfy", "compile", str(bad)]))
    deploy = tmp_path / "d.json"
    deploy.write_text(json.dumps({"model": {"path": str(tmp_path)}, "comfyui": {"models": {"a": 1}}}))
    good = tmp_path / "g.json"
    good.write_text(json.dumps({"1": {"class_type": "SaveImage", "inputs": {}}}))
    assert "comfyui.models.a" in one_error_line(invoke(["comfy", "compile", str(good), "--deploy", str(deploy)]))


def test_deploy_aliases(tiny, templates, tmp_path):
    ckpt = tiny("flux", "schnell")
    deploy = tmp_path / "d.json"
    deploy.write_text(json.dumps({"model": {"path": str(ckpt), "family": "flux"},
                                  "comfyui": {"models": {"flux1-schnell-fp8.safetensors": ckpt.name}}}))
    path = tmp_path / "wf.json"
    path.write_text(json.dumps(templates("flux_schnell")))
    res = invoke(["comfy", "compile", str(path), "--deploy", str(deploy)])
    assert res.exit_code == 0, res.output
    deploy.write_text(json.dumps({"model": {"path": str(ckpt), "family": "flux"}}))
    line = one_error_line(invoke(["comfy", "compile", str(path), "--deploy", str(deploy)]))
    assert "ckpt_name" in line and "flux1-schnell-fp8.safetensors" in line


def test_input_dir_and_data_flow(tmp_path):
    from PIL import Image

    Image.new("RGB", (48, 32), (10, 20, 30)).save(tmp_path / "in.png")
    base = {"seed": 1, "steps": 4, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "model": ["1", 0],
            "positive": ["2", 0], "negative": ["2", 0]}
    g = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "flux1-schnell.safetensors"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["1", 1]}},
        "3": {"class_type": "LoadImage", "inputs": {"image": "in.png"}},
        "4": {"class_type": "VAEEncode", "inputs": {"pixels": ["3", 0], "vae": ["1", 2]}},
        "5": {"class_type": "KSampler", "inputs": {**base, "latent_image": ["4", 0], "denoise": 0.5}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "VAEEncode", "inputs": {"pixels": ["6", 0], "vae": ["1", 2]}},
        "8": {"class_type": "KSampler", "inputs": {**base, "latent_image": ["7", 0], "denoise": 0.25}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["1", 2]}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": "x"}},
    }
    path = tmp_path / "wf.json"
    path.write_text(json.dumps(g))
    res = invoke(["comfy", "compile", str(path), "--input-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    first, second = json.loads(res.stdout)
    assert first["request"]["diffusion"]["width"] == 48 and first["request"]["inputs"][1]["data_b64"].startswith("iVBOR")
    assert second["inputs_from"] == {"1": "5"} and second["request"]["inputs"][1]["data_b64"] == "@from-job:5"
    assert second["request"]["diffusion"]["steps"] == 16 and first["saves"] == []
    res = invoke(["comfy", "compile", str(path)])  # no input folder: the image is named, not read
    assert json.loads(res.stdout)[0]["request"]["inputs"][1]["data_b64"] == "@input:in.png"
