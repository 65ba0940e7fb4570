"""omniloop-flux-demo: the shipped trained checkpoint through the preset (Runtime, ``omniloop
generate`` without ``--task``, true CFG per request) and the one-line refusal without weights. How
the checkpoint was made (tokenizers, the smoke training session, ship) is tested in
tests/demos/flux_demo/."""

from __future__ import annotations

import torch

PROMPT = "a red star at the top left"

# prompts covering the 4 shapes, 4 colours and 4 positions; each drawn right at seed 0 on the CPU
SHIPPED_PROMPTS = ["a red star at the top left", "a blue circle at the center",
                   "a green triangle at the bottom right", "a yellow square at the bottom"]


def test_the_shipped_preset_draws_what_the_prompt_says():
    """The ``flux-demo`` preset at its defaults (20 steps, no CFG, 64x64) through the runtime on the
    CPU: wan-demo's detector reads back colour, shape and position (the GPU evaluation of the same
    weights: colour 100 %, shape 92.4 %, position 100 % on 432 images; these 4 are not failures)."""
    from omniloop import Runtime
    from omniloop_wan_demo.evaluate import detect_image

    rt = Runtime.from_model("flux-demo", device="cpu", dtype="float32")
    for prompt in SHIPPED_PROMPTS:
        px = rt.generate({"task": "t2i", "prompt": prompt, "diffusion": {"seed": 0}}).artifacts["image"].pixels
        assert tuple(px.shape) == (64, 64, 3)
        d = detect_image(px.numpy())
        assert f"a {d.color} {d.shape} at the {d.position}" == prompt


def test_true_cfg_per_request_on_the_shipped_preset():
    """True CFG (``node_params.denoise.cfg: classic``, scale 3.0, negative ``""``) runs on the preset
    from a plain request, as the README shows: "a green circle at the top" at seed 0 — a circle read
    as a square without CFG (one of the 33 misses) — is drawn as a circle with it."""
    from omniloop import Runtime
    from omniloop_wan_demo.evaluate import detect_image

    rt = Runtime.from_model("flux-demo", device="cpu", dtype="float32")
    prompt = "a green circle at the top"
    plain = rt.generate({"task": "t2i", "prompt": prompt, "diffusion": {"seed": 0}}).artifacts["image"].pixels
    cfg = rt.generate({"task": "t2i", "prompt": prompt, "diffusion": {"seed": 0, "guidance_scale": 3.0},
                       "node_params": {"denoise": {"cfg": "classic"}}}).artifacts["image"].pixels
    assert not torch.equal(plain, cfg)
    d = detect_image(cfg.numpy())
    assert (d.color, d.shape, d.position) == ("green", "circle", "top")


def test_cli_generate_on_the_preset_needs_no_task_flag(tmp_path):
    """``omniloop generate PROMPT --model flux-demo --out x.png``: an image-only model gets t2i
    (omniloop_cli.default_task); a video model keeps t2v; unresolvable deploys fall back to t2v."""
    from click.testing import CliRunner
    from PIL import Image

    from omniloop.plugins import default_manager
    from omniloop_cli import cli
    from omniloop_cli.default_task import default_task

    manager = default_manager()
    assert default_task(None, "flux-demo", None, None, manager) == "t2i"
    assert default_task(None, "wan-demo", None, None, manager) == "t2v"
    assert default_task(None, None, None, None, manager) == "t2v"
    assert default_task(None, str(tmp_path / "nothing-here"), None, None, manager) == "t2v"
    out = tmp_path / "star.png"
    res = CliRunner().invoke(cli, ["generate", PROMPT, "--model", "flux-demo", "--seed", "0", "--steps", "2",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert Image.open(out).size == (64, 64)


def test_preset_registered_and_refused_with_one_line_until_the_weights_exist(check_preset_not_installed):
    from omniloop.plugins import default_manager
    from omniloop_flux_demo import checkpoint_path, plugin

    presets = default_manager().registry().presets
    assert presets["flux-demo"].family == "flux"
    got: list = []
    plugin.omniloop_register_model_presets(got.append)
    assert [p.name for p in got] == ["flux-demo"]
    check_preset_not_installed("flux-demo", [(checkpoint_path, "checkpoint_dir"), (plugin, "checkpoint_dir")],
                               "training.ship")


def test_the_readme_fast_deploy_file_is_a_valid_flux_deployment(tmp_path):
    """The README's GPU deploy file (the exact-class fast path) parses as a deploy file and names only
    options the flux family reads; without CUDA its fused kernels are refused in one line, before loading."""
    import re
    import tomllib
    from pathlib import Path

    import pytest

    from omniloop import Runtime
    from omniloop.deploy import load_deploy
    from omniloop.errors import DeployError
    from omniloop_flux.family import KNOWN_OPTIONS

    readme = (Path(__file__).resolve().parents[2] / "families" / "flux-demo" / "README.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```toml\n(.*?)```", readme, re.S)
    f = tmp_path / "fast.toml"
    f.write_text(block)
    cfg = load_deploy(f)
    assert cfg.model.preset == "flux-demo" and cfg.device == "cuda" and cfg.compile
    assert set(cfg.options) <= KNOWN_OPTIONS
    if not torch.cuda.is_available():
        with pytest.raises(DeployError, match="options"):
            Runtime.from_deploy({**tomllib.loads(block), "device": "cpu"})
