"""omniloop-flux-demo-training (demos/flux-demo): the shipped checkpoint is what ship installs,
the tokenizers, the smoke training session (through scripts/gpu_session.sh, every phase on the
CPU), ship, and the smoke folder running through the flux family (Runtime, ``omniloop generate``,
``omniloop eval adherence``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "demos" / "flux-demo" / "scripts" / "gpu_session.sh"
PROMPT = "a red star at the top left"


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> Path:
    """One smoke session through the shell script (CPU, tiny sizes, 3 steps per phase)."""
    out = tmp_path_factory.mktemp("flux-demo-session")
    env = {**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    res = subprocess.run(["bash", str(SCRIPT), "--smoke", "--device", "cpu"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def pipeline(session, tmp_path_factory) -> Path:
    into = tmp_path_factory.mktemp("flux-demo-pipeline")
    with tarfile.open(session / "pipeline.tar") as tar:
        tar.extractall(into)
    return into / "pipeline"


def test_the_trained_checkpoint_is_shipped_and_complete():
    """Session C's pipeline (3359 DiT steps), installed by training.ship: complete, accepted by the
    flux family's check and ship's own, small enough to be package data."""
    from omniloop_flux_demo import checkpoint_dir, checkpoint_missing
    from omniloop_flux_demo_training.ship import check_folder

    assert checkpoint_missing() is None
    meta = check_folder(checkpoint_dir())
    assert meta["training"]["dit_total_steps"] == 3359 and meta["defaults"]["steps"] == 20
    size = sum(f.stat().st_size for f in checkpoint_dir().rglob("*") if f.is_file())
    assert size < 10e6, size



def test_tokenizers_are_word_level_over_the_vocabulary():
    from omniloop_flux_demo_training.model import TEXT_LEN, build_tokenizer, vocabulary

    clip, t5 = build_tokenizer("clip"), build_tokenizer("t5")
    words = PROMPT.split()
    assert set(words) <= set(vocabulary())
    ids = clip(PROMPT, padding="max_length", max_length=TEXT_LEN).input_ids
    assert len(ids) == TEXT_LEN and ids[0] == clip.bos_token_id and ids[len(words) + 1] == clip.eos_token_id
    assert clip.unk_token_id not in ids
    t5_ids = t5("A RED star, at the top-left", padding="max_length", max_length=TEXT_LEN).input_ids
    assert t5_ids[:len(words) + 1] == t5(PROMPT).input_ids and t5_ids[-1] == t5.pad_token_id
    assert t5("a red fox").input_ids[2] == t5.unk_token_id
    with pytest.raises(ValueError, match="'clip' or 't5'"):
        build_tokenizer("bert")


def test_smoke_session_writes_every_file(session):
    names = sorted(p.name for p in session.iterdir())
    assert names == ["ema-dit.safetensors", "eval.json", "log.txt", "pipeline.tar", "raw-dit.safetensors",
                     "samples.png", "train.json", "vae.safetensors"] or (
        "samples.png" not in names and "error" in json.loads((session / "eval.json").read_text()))
    assert len(names) <= 8 and all(p.stat().st_size < 16 * 2**20 for p in session.iterdir())
    rec = json.loads((session / "train.json").read_text())
    assert rec["dit"]["steps"] == 3 and rec["vae"]["steps"] == 3 and rec["sessions"] == 1
    # the quick EMA evaluation during DiT training ran (every step in a smoke run)
    assert len(rec["dit"]["evals"]) == 3 and set(rec["dit"]["evals"][0]["accuracy"]) >= {"color", "shape", "position"}
    assert {"shift_factor", "scaling_factor"} <= set(rec["latent_stats"])
    assert "done in" in (session / "log.txt").read_text()


def test_eval_json_scores_colour_shape_position(session):
    report = json.loads((session / "eval.json").read_text())
    if "error" in report:
        pytest.skip(f"the detector is not available yet: {report['error']}")
    run = report["runs"][0]
    assert run["steps"] >= 1 and set(run["accuracy"]) >= {"color", "shape", "position"}
    assert report["runtime_check"].get("max_abs_uint8_diff") is not None, report["runtime_check"]


def test_pipeline_folder_loads_in_the_flux_family_and_carries_its_defaults(pipeline):
    from omniloop_flux.checkpoint import check_checkpoint
    from omniloop_flux.family import FluxFamily

    check_checkpoint(pipeline)
    meta = json.loads((pipeline / "omniloop.json").read_text())
    assert meta["adherence"] == {"kind": "image"} and "star" in meta["vocabulary"] and "left" in meta["vocabulary"]
    assert meta["defaults"]["height"] == meta["defaults"]["width"] == 64
    model = FluxFamily().load(pipeline, device=torch.device("cpu"), dtype=torch.float32, options={})
    assert model.config["variant"] == "flux-demo" and model.config["guidance_embeds"] is False
    assert model.components["transformer"].config.in_channels == 4 * model.components["vae"].config.latent_channels


def test_batched_sampler_matches_the_runtime(pipeline):
    """The evaluator's batched flow-Euler sampler is the family's denoise loop (same noise, sigmas, steps)."""
    from omniloop import Runtime
    from omniloop_flux_demo_training.evaluate import load_folder
    from omniloop_flux_demo_training.train import sample

    comps = load_folder(pipeline, torch.device("cpu"))
    prompts = [PROMPT, "a blue circle at the center"]
    ours = (sample(comps, prompts, [0, 3], steps=3) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    rt = Runtime.from_model(str(pipeline), device="cpu", dtype="float32")
    for i, (p, seed) in enumerate(zip(prompts, [0, 3], strict=True)):
        px = rt.generate({"task": "t2i", "prompt": p, "diffusion": {"steps": 3, "seed": seed}}).artifacts["image"].pixels
        assert (px.int() - ours[i].int()).abs().max() <= 1


def test_cli_generate_writes_a_png(pipeline, tmp_path):
    from click.testing import CliRunner

    from omniloop_cli import cli

    out = tmp_path / "star.png"
    res = CliRunner().invoke(cli, ["generate", PROMPT, "--model", str(pipeline), "--task", "t2i", "--seed", "0",
                                        "--out", str(out)])
    assert res.exit_code == 0, res.output
    from PIL import Image

    assert Image.open(out).size == (64, 64)


def test_ship_installs_and_the_preset_generates(session, tmp_path, monkeypatch):
    from omniloop import Runtime
    from omniloop_flux_demo import checkpoint_path, plugin
    from omniloop_flux_demo_training.ship import main as ship_main

    dest = tmp_path / "checkpoint"
    assert ship_main([str(session), "--dest", str(dest)]) == 0
    assert checkpoint_path.checkpoint_missing(dest) is None
    monkeypatch.setattr(checkpoint_path, "checkpoint_dir", lambda: dest)
    monkeypatch.setattr(plugin, "checkpoint_dir", lambda: dest)
    rt = Runtime.from_model("flux-demo", device="cpu", dtype="float32")
    out = rt.generate({"task": "t2i", "prompt": PROMPT, "diffusion": {"steps": 2, "seed": 0}})
    assert tuple(out.artifacts["image"].pixels.shape) == (64, 64, 3)
    assert rt.defaults("t2i")["steps"] == 20


def test_ship_refuses_what_is_not_a_pipeline(tmp_path, capsys):
    from omniloop_flux_demo_training.ship import main as ship_main

    assert ship_main([str(tmp_path), "--dest", str(tmp_path / "d")]) == 2
    assert "neither a gpu_run output folder" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model_index.json").write_text("{}")
    assert ship_main([str(bad), "--dest", str(tmp_path / "d")]) == 2
    assert "not a complete flux-demo pipeline" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--vae-seconds", "nan"], "--vae-seconds must be a finite number"),
    (["--dit-seconds", "-5"], "--dit-seconds must be a finite number"),
    (["--dit-batch", "0"], "--dit-batch must be >= 1"),
    (["--eval-every", "inf"], "--eval-every must be a finite number"),
    (["--resume", "/nonexistent-flux-demo"], "not a session folder"),
    (["--vae-seconds", "0"], "--vae-seconds 0 needs --resume"),
    (["--resume", "RESUME", "--vae-seconds", "5"], "--resume keeps the VAE"),
])
def test_gpu_run_refuses_bad_arguments_before_any_work(tmp_path, capsys, argv, message):
    from omniloop_flux_demo_training.gpu_run import RESUME_FILES, main

    if "RESUME" in argv:  # a complete (if empty) session folder
        for f in RESUME_FILES:
            (tmp_path / f).write_text("{}")
        argv = [str(tmp_path) if a == "RESUME" else a for a in argv]
    assert main(["--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_resume_continues_the_dit_and_keeps_the_vae_normalisation(session, tmp_path):
    from omniloop_flux_demo_training.gpu_run import main

    out = tmp_path / "second"
    assert main(["--out", str(out), "--smoke", "--device", "cpu", "--resume", str(session), "--vae-seconds", "0"]) == 0
    first, second = (json.loads((d / "train.json").read_text()) for d in (session, out))
    assert second["sessions"] == 2 and second["dit_total_steps"] == first["dit_total_steps"] + 3
    assert second["latent_stats"]["scaling_factor"] == first["latent_stats"]["scaling_factor"]
    assert (out / "vae.safetensors").read_bytes() == (session / "vae.safetensors").read_bytes()


def test_eval_adherence_scores_the_folder_as_an_image_model(pipeline, tmp_path):
    """``"adherence": {"kind": "image"}`` in omniloop.json: ``omniloop eval adherence`` scores
    colour, shape and position of t2i images (wan-demo's evaluator)."""
    from click.testing import CliRunner

    from omniloop_cli import cli

    out = tmp_path / "r.json"
    res = CliRunner().invoke(cli, ["eval", "adherence", "--model", str(pipeline), "--seeds", "0", "--steps", "1",
                                   "--json", str(out), "--no-table"])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert all(k in text for k in ('"color"', '"shape"', '"position"'))
