"""The whole tone-demo recipe at toy size on the CPU: one VAE step, one DiT step, the saved folder
loads as diffusers' StableAudioPipeline and samples; ``omniloop eval adherence`` scores it."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("torchsde")


def test_one_iteration_trains_and_ships_a_stable_audio_folder(toy_run):
    from diffusers import StableAudioPipeline

    from omniloop_tone_demo.checkpoint_path import checkpoint_missing
    from omniloop_tone_demo.grammar import CLIP_SAMPLES, SAMPLE_RATE

    out, report = toy_run
    assert [h["phase"] for h in report["history"]] == ["vae", "dit"]
    assert report["history"][0]["steps"] == 1 and report["history"][1]["steps"] == 1
    folder = out / "checkpoint"
    assert checkpoint_missing(folder) is None
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableAudioPipeline"
    assert index["scheduler"] == ["diffusers", "CosineDPMSolverMultistepScheduler"]
    assert index["transformer"] == ["diffusers", "StableAudioDiTModel"]
    assert index["vae"] == ["diffusers", "AutoencoderOobleck"]
    meta = json.loads((folder / "omniloop.json").read_text())
    assert meta["adherence"] == {"kind": "audio"} and meta["tasks"] == ["t2a"]
    pipe = StableAudioPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    assert pipe.vae.sampling_rate == SAMPLE_RATE
    audio = pipe("a sine wave playing A4 two beats per second", num_inference_steps=2, guidance_scale=3.0,
                 generator=torch.Generator().manual_seed(0), output_type="pt").audios
    assert audio.shape == (1, 1, CLIP_SAMPLES) and torch.isfinite(audio).all()


def test_latent_normalisation_keeps_the_decoder_consistent(toy_run):
    """Folding the latent scale into the VAE changes the latents' scale, not what they decode to."""
    from diffusers import AutoencoderOobleck

    from omniloop_tone_demo.grammar import Spec, synthesize
    from omniloop_tone_demo_training.build import TOY
    from omniloop_tone_demo_training.train import normalize_latents

    torch.manual_seed(0)
    vae = AutoencoderOobleck(**TOY["vae"]).eval()
    x = synthesize([Spec("square", "C4", 2)])
    with torch.no_grad():
        z0 = vae.encode(x).latent_dist.mode()
        y0 = vae.decode(z0).sample
        scale = torch.linspace(0.5, 3.0, z0.shape[1])
        normalize_latents(vae, scale)
        z1 = vae.encode(x).latent_dist.mode()
        y1 = vae.decode(z1).sample
    torch.testing.assert_close(z1, z0 / scale.view(1, -1, 1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-5)


def test_eval_adherence_scores_a_checkpoint_folder(toy_run, tmp_path):
    from click.testing import CliRunner

    from omniloop_tone_demo.cli import main

    out, _ = toy_run
    report = tmp_path / "adherence.json"
    res = CliRunner().invoke(main, ["adherence", "--model", str(out / "checkpoint"), "--steps", "2", "--seeds", "0",
                                    "--guidance", "3", "--prompts", "8", "--batch-size", "4", "--json", str(report)])
    assert res.exit_code == 0, res.output
    got = json.loads(report.read_text())
    assert got["kind"] == "audio"
    rep = got["reports"][0]
    assert rep["n"] == 8 and set(rep["accuracy"]) == {"timbre", "pitch", "rhythm", "all"}
    assert rep["counts"]["pitch"][1] == 6 and rep["seconds_per_clip"] > 0 and rep["cpu_seconds_per_clip"] > 0
    assert rep["backend"] == "runtime"  # auto: omniloop's stable-audio family is installed
    assert len(rep["clips"]) == 8


def test_eval_adherence_backends_agree(toy_run, tmp_path):
    """The runtime and diffusers read the same clips: each clip has its own seed
    (``evaluate.clip_seed``) and the runtime equals diffusers (one clip per diffusers call: a batched
    call draws one Brownian tree for the whole batch)."""
    from click.testing import CliRunner

    from omniloop_tone_demo.cli import main

    out, _ = toy_run
    reports = {}
    for backend in ("runtime", "diffusers"):
        path = tmp_path / f"{backend}.json"
        res = CliRunner().invoke(main, ["adherence", "--model", str(out / "checkpoint"), "--steps", "2", "--guidance",
                                        "3", "--prompts", "4", "--backend", backend, "--batch-size", "1", "--json", str(path)])
        assert res.exit_code == 0, res.output
        reports[backend] = json.loads(path.read_text())["reports"][0]
    assert [c["reading"] for c in reports["runtime"]["clips"]] == [c["reading"] for c in reports["diffusers"]["clips"]]


@pytest.fixture(scope="module")
def linear_run(tmp_path_factory):
    """``--vae linear`` at toy size (a 2-layer DiT): the PCA Oobleck instead of VAE training, then the DiT."""
    from omniloop_tone_demo_training.train import run

    out = tmp_path_factory.mktemp("linear")
    report = run(out, device="cpu", toy=True, vae_seconds=1e9, dit_seconds=1e9, vae_steps=None, dit_steps=1,
                 n_clips=4, vae_batch=2, dit_batch=2, sweeps=[], eval_seeds=[0], bf16=False, eval_prompts=4,
                 vae_kind="linear", transformer={"num_layers": 2})
    return out, report


def test_the_linear_vae_recipe_runs(linear_run):
    """The PCA Oobleck (32 latent channels) instead of VAE training, then the DiT."""
    out, report = linear_run
    vae = report["history"][0]
    assert vae["kind"] == "linear (PCA)" and vae["latent_channels"] == 32 and vae["kept_energy"] > 0.9
    cfg = json.loads((out / "checkpoint" / "transformer" / "config.json").read_text())
    assert cfg["in_channels"] == cfg["out_channels"] == 32


def test_the_linear_recipe_ships_the_compact_float16_form(linear_run, tmp_path):
    """A linear-VAE run ships ``vae/linear_oobleck.safetensors`` (no full VAE weights) and float16
    DiT / T5 / projection weights; the package builds the complete folder in its cache, which loads
    as float32 and samples exactly as the model the run scored (weights rounded to float16)."""
    from diffusers import StableAudioPipeline
    from safetensors import safe_open

    from omniloop_tone_demo.checkpoint_path import VAE_COMPACT, VAE_WEIGHTS, checkpoint_missing, materialize
    from omniloop_tone_demo_training.build import load_parts

    folder = linear_run[0] / "checkpoint"
    assert (folder / VAE_COMPACT).is_file() and not (folder / VAE_WEIGHTS).exists()
    assert checkpoint_missing(folder) is None
    assert (folder / VAE_COMPACT).stat().st_size < 20_000
    for f in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
              "projection_model/diffusion_pytorch_model.safetensors"):
        with safe_open(str(folder / f), "pt") as sf:
            assert {sf.get_slice(k).get_dtype() for k in sf.keys()} == {"F16"}, f
    assert json.loads((folder / "transformer" / "config.json").read_text())["num_layers"] == 2
    full = materialize(folder, tmp_path / "cache")
    assert full.parent == tmp_path / "cache" and (full / VAE_WEIGHTS).is_file() and checkpoint_missing(full) is None
    pipe = StableAudioPipeline.from_pretrained(str(full))
    assert {m.dtype for m in (pipe.transformer, pipe.text_encoder, pipe.projection_model, pipe.vae)} == {torch.float32}
    parts = load_parts(folder)  # the compact VAE rebuilt in memory: what the run scored with
    z = torch.randn(1, 32, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(pipe.vae.decode(z).sample, parts["vae"].decode(z).sample)
    for name in ("transformer", "text_encoder", "projection_model"):
        got, ref = pipe.components[name].state_dict(), parts[name].state_dict()
        assert all(torch.equal(got[k], ref[k]) for k in ref), name


def test_the_bank_takes_a_drum_share():
    from omniloop_tone_demo_training.train import make_bank

    clips, specs = make_bank(40, "cpu", seed=3, drum_share=0.5)
    assert clips.shape == (40, 1, 16384) and sum(s.timbre == "noise" for s in specs) == 20
    assert {s.timbre for s in specs} == {"sine", "square", "sawtooth", "noise"}


def test_shrink_drops_a_block_and_distills(linear_run, tmp_path):
    """``shrink``: one DiT block dropped (the cheapest by probe loss), the next one distilled locally
    and the whole DiT end to end; written in the shipped form with the drop recorded."""
    from omniloop_tone_demo.checkpoint_path import VAE_COMPACT, checkpoint_missing
    from omniloop_tone_demo_training.build import load_parts
    from omniloop_tone_demo_training.shrink import main

    out = tmp_path / "cut"
    main(["--src", str(linear_run[0] / "checkpoint"), "--out", str(out), "--layers", "1", "--probe", "4",
          "--distill-steps", "2", "--distill-clips", "4", "--distill-model-steps", "1"])
    assert checkpoint_missing(out) is None and (out / VAE_COMPACT).is_file()
    assert json.loads((out / "transformer" / "config.json").read_text())["num_layers"] == 1
    assert len(load_parts(out)["transformer"].transformer_blocks) == 1
    shrink = json.loads((out / "omniloop.json").read_text())["training"]["history"][-1]
    assert shrink["phase"] == "shrink" and shrink["log"][1]["of"] == 2
    assert [k for k in ("distilled_steps", "distilled_model_steps") if any(k in e for e in shrink["log"])] == [
        "distilled_steps", "distilled_model_steps"]
