"""The shipped checkpoint: size, diffusers-format loading on CPU, generation, registration."""

import json
import time

import numpy as np
import pytest
import torch

from omniloop_wan_demo import checkpoint_dir, tokenizer_dir

torch.set_num_threads(2)

CKPT = checkpoint_dir()
pytestmark = pytest.mark.skipif(not (CKPT / "model_index.json").exists(), reason="checkpoint not built yet")


def test_layout_and_size():
    index = json.loads((CKPT / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    for comp in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (CKPT / comp).is_dir(), comp
    total = sum(f.stat().st_size for f in CKPT.rglob("*") if f.is_file())
    assert total < 15 * 2**20, total
    vae = json.loads((CKPT / "vae" / "config.json").read_text())
    assert vae["scale_factor_spatial"] == 4 and vae["scale_factor_temporal"] == 4
    # latent statistics of the training latents, not the Wan2.1 defaults or identity
    assert any(abs(m) > 1e-3 for m in vae["latents_mean"]) and any(abs(s - 1) > 1e-3 for s in vae["latents_std"])
    sched = json.loads((CKPT / "scheduler" / "scheduler_config.json").read_text())
    assert sched["prediction_type"] == "flow_prediction" and sched["use_flow_sigmas"] and sched["flow_shift"] > 1
    defaults = json.loads((CKPT / "omniloop.json").read_text())["defaults"]
    assert defaults["frames"] == 17 and defaults["height"] == 64


def test_tokenizer_loads_with_autotokenizer():
    from transformers import AutoTokenizer

    for path in (CKPT / "tokenizer", tokenizer_dir()):
        tok = AutoTokenizer.from_pretrained(str(path))
        ids = tok("a red circle moving left", add_special_tokens=True).input_ids
        assert tok.unk_token_id not in ids and ids[-1] == tok.eos_token_id and len(ids) == 6


def test_diffusers_wanpipeline_generates_on_cpu():
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(CKPT), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    t0 = time.perf_counter()
    out = pipe("a blue square moving right", num_frames=17, height=64, width=64, num_inference_steps=4,
               generator=torch.Generator().manual_seed(0), output_type="np")
    seconds = time.perf_counter() - t0
    frames = np.asarray(out.frames)
    assert frames.shape == (1, 17, 64, 64, 3) and np.isfinite(frames).all()
    assert frames.std() > 0.02  # not a flat image
    assert seconds < 120  # a few seconds on an idle laptop; generous for a busy 2-core CI box


def test_preset_and_commands_registered():
    import click

    from omniloop_wan_demo import plugin

    got = []
    plugin.omniloop_register_model_presets(got.append)
    assert got[0].name == "wan-demo" and got[0].family == "wan" and got[0].path() == CKPT

    @click.group()
    def cli():
        pass

    plugin.omniloop_register_commands(cli)
    assert "adherence" in cli.commands["eval"].commands


def test_runtime_generates_from_preset():
    runtime = pytest.importorskip("omniloop.runtime")
    pytest.importorskip("omniloop_wan")
    rt = runtime.Runtime.from_model("wan-demo")
    out = rt.generate({"task": "t2v", "inputs": [{"type": "text", "text": "a yellow circle moving up"}],
                       "diffusion": {"steps": 2, "seed": 0}})
    assert out.ok, out.error
    frames = out.artifacts["video"].frames
    assert tuple(frames.shape) == (17, 64, 64, 3)


def test_preset_options_apply_under_the_deploy_options():
    """The preset carries ``vae_cpu_kernels: fast``; a deployment's own options win key by key."""
    runtime = pytest.importorskip("omniloop.runtime")
    pytest.importorskip("omniloop_wan")
    rt = runtime.Runtime.from_model("wan-demo")
    assert rt.preset_options == {"vae_cpu_kernels": "fast"}
    assert rt.model.config["vae_cpu_kernels"] == "fast"
    ref = runtime.Runtime.from_model("wan-demo", options={"vae_cpu_kernels": "reference"})
    assert ref.model.config["vae_cpu_kernels"] == "reference"
    from omniloop_wan_demo.checkpoint_path import checkpoint_dir

    by_path = runtime.Runtime.from_model(str(checkpoint_dir()))  # a path is not the preset
    assert by_path.preset_options == {} and by_path.model.config["vae_cpu_kernels"] == "reference"


def test_make_demo_prompt_is_drawn_as_asked():
    """``make demo`` generates "a yellow triangle moving right" with seed 0 at the preset's defaults
    (20 steps, guidance 5): the shipped v2 must draw what the Makefile promises. The detector's
    verdict is robust to float noise here (16 of 17 frames vote triangle; 37 px of travel)."""
    runtime = pytest.importorskip("omniloop.runtime")
    pytest.importorskip("omniloop_wan")
    import re
    from pathlib import Path

    from omniloop_wan_demo.evaluate import detect

    make = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    prompt = re.search(r"^DEMO_PROMPT \?= (.+)$", make, re.M).group(1).strip()
    seed = int(re.search(r"^DEMO_SEED \?= (\d+)$", make, re.M).group(1))
    assert (prompt, seed) == ("a yellow triangle moving right", 0)  # if the Makefile changes, re-check the new pair
    out = runtime.Runtime.from_model("wan-demo").generate({"task": "t2v", "prompt": prompt, "diffusion": {"seed": seed}})
    assert out.ok, out.error
    d = detect(np.asarray(out.artifacts["video"].frames))
    assert (d.color, d.direction, d.shape) == ("yellow", "right", "triangle"), d


def test_shipped_training_record_and_the_causal_variant_shares_v2s_parts():
    """omniloop.json records the shipped v2's history (object-weighted DiT sessions on top of the
    decoder fine-tunes, then a trail-weighted decoder fine-tune, then two against the students'
    specks, the second weighted to red clips); checkpoint_causal/ (retrained from v2 with Self-Forcing
    DMD2, issue 41) links v2's parts, the decoder included (run 4 was measured with the current one)."""
    import os

    from omniloop_wan_demo.checkpoint_path import CAUSAL_SHARED, causal_checkpoint_dir

    training = json.loads((CKPT / "omniloop.json").read_text())["training"]
    phases = [h["phase"] for h in training["history"]]
    assert phases.count("vae_decoder") == 3 and phases[-4] == "dit"
    last_dit = [h for h in training["history"] if h["phase"] == "dit"][-1]
    assert training["trained_steps"] == last_dit["total_steps"] >= 2731  # 2026-12-01b: 2731
    # 2026-12-02: the decoder re-tuned with the trail weight (the DiT's latents unchanged: encoder frozen)
    assert training["history"][-3]["trail_weight"] == 60.0 and training["history"][-3]["recon_clean"] >= 0.95
    # 2026-12-05: then against the specks it drew from the students' latents (decoder_specks --ship);
    # 2026-12-06: again with half the rendered clips red (--focus red), the shape the VAE lost most
    assert phases[-2:] == ["decoder_specks", "decoder_specks"] and training["history"][-2]["speck_clips"] > 0
    assert training["history"][-1]["focus"] == "red"
    assert training["recipe"]["object_weight"] == 4.0
    causal = causal_checkpoint_dir()
    if not (causal / "transformer").is_dir():
        pytest.skip("wan-demo-causal not installed")
    for name in CAUSAL_SHARED:  # relative links into checkpoint/, committed as links
        assert (causal / name).is_symlink() and os.readlink(causal / name) == f"../checkpoint/{name}", name
        assert (causal / name).resolve() == (CKPT / name).resolve(), name
    meta = json.loads((causal / "omniloop.json").read_text())
    assert meta["rollout"] == "causal" and meta["rollout_options"]["guidance_scale"] == 1.0  # no CFG: distilled in
    assert meta["training"]["recipe"]["method"].startswith("Self-Forcing DMD2")
    assert not {"sampler", "sampler_options", "shift"} & set(meta["defaults"])
