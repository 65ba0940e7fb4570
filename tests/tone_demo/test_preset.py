"""The ``tone-demo`` preset: family ``stable-audio``; without its weights one clear error."""

from __future__ import annotations

import pytest
from click.testing import CliRunner


def test_preset_is_registered_for_the_stable_audio_family():
    from omniloop.plugins import default_manager

    preset = default_manager().registry().presets["tone-demo"]
    assert preset.family == "stable-audio"


def test_missing_weights_are_one_clear_error(monkeypatch, tmp_path):
    from omniloop.errors import DeployError
    from omniloop_tone_demo import checkpoint_path, plugin

    monkeypatch.setattr(checkpoint_path, "checkpoint_dir", lambda: tmp_path / "checkpoint")
    monkeypatch.setattr(plugin, "checkpoint_dir", lambda: tmp_path / "checkpoint")
    with pytest.raises(DeployError, match=r"tone-demo weights are not installed .*gpu_train\.sh"):
        plugin.preset_path()


def test_eval_adherence_refuses_a_folder_that_is_no_tone_checkpoint(tmp_path):
    from omniloop_tone_demo.cli import main

    res = CliRunner().invoke(main, ["adherence", "--model", str(tmp_path)])
    assert res.exit_code == 2 and "not a tone-demo checkpoint" in res.output
    res = CliRunner().invoke(main, ["adherence", "--model", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "not a checkpoint folder" in res.output


def test_wan_demo_options_are_refused_for_an_audio_model(tmp_path):
    import json

    from omniloop_wan_demo import cli as wan_cli

    (tmp_path / "omniloop.json").write_text(json.dumps({"adherence": {"kind": "audio"}}))
    res = CliRunner().invoke(wan_cli.main, ["eval", "adherence", "--model", str(tmp_path), "--rollout", "causal"])
    assert res.exit_code == 2 and "audio model" in res.output
    res = CliRunner().invoke(wan_cli.main, ["eval", "adherence", "--model", str(tmp_path)])
    assert res.exit_code == 2 and "not a tone-demo checkpoint" in res.output


def test_the_shipped_weights_generate_through_the_preset(tmp_path, monkeypatch):
    """The package ships tone-demo (compact VAE, float16 weights): ``--model tone-demo`` builds the
    complete folder in the cache, loads it in float32 and generates a clip the evaluator reads
    (4 steps here: a smoke test, not an adherence measurement)."""
    pytest.importorskip("torchsde")
    pytest.importorskip("omniloop_stable_audio")
    from omniloop.request import Status
    from omniloop.runtime import Runtime
    from omniloop_tone_demo.checkpoint_path import VAE_COMPACT, checkpoint_missing, shipped_dir
    from omniloop_tone_demo.evaluate import score
    from omniloop_tone_demo.grammar import CLIP_SAMPLES, SAMPLE_RATE

    assert checkpoint_missing() is None and (shipped_dir() / VAE_COMPACT).is_file()
    monkeypatch.setenv("OMNILOOP_TONE_DEMO_CACHE", str(tmp_path / "cache"))
    rt = Runtime.from_model("tone-demo")
    assert rt.family.name == "stable-audio" and rt.tasks == frozenset({"t2a"})
    assert str(rt.model.path).startswith(str(tmp_path / "cache"))
    prompt = "a square wave playing E4 three beats per second"
    out = rt.generate({"task": "t2a", "prompt": prompt, "diffusion": {"seed": 0, "steps": 4}})
    assert out.status is Status.COMPLETED, out.error
    audio = out.artifacts["audio"]
    assert audio.sample_rate == SAMPLE_RATE and tuple(audio.samples.shape) == (1, CLIP_SAMPLES)
    verdict = score(audio.samples.numpy(), prompt)
    assert verdict.prompt == prompt and verdict.reading.f0 > 0


def test_omniloop_generate_model_tone_demo_writes_a_wav(tmp_path, monkeypatch):
    """``omniloop generate "..." --model tone-demo --out x.wav`` (the task inferred: t2a), 3 steps."""
    pytest.importorskip("torchsde")
    pytest.importorskip("omniloop_stable_audio")
    av = pytest.importorskip("av")
    from omniloop_cli import cli

    monkeypatch.setenv("OMNILOOP_TONE_DEMO_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "tone.wav"
    res = CliRunner().invoke(cli, ["generate", "a noise drum playing two beats per second", "--model", "tone-demo",
                                   "--steps", "3", "--seed", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    with av.open(str(out)) as c:
        stream = c.streams.audio[0]
        assert stream.rate == 8000 and stream.channels == 1
        assert sum(f.samples for f in c.decode(audio=0)) == 16384


def test_a_tone_demo_run_prints_no_library_warnings(tmp_path):
    """A tone-demo run used to print five library warnings (diffusers' Oobleck VAE built with the
    deprecated ``torch.nn.utils.weight_norm``; torchsde's Brownian tree queried one float32 ulp
    outside its interval by diffusers' scheduler). Run with every warning shown (``-W default``), a
    CLI run prints none of them."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torchsde")
    pytest.importorskip("omniloop_stable_audio")
    env = {**os.environ, "OMNILOOP_TONE_DEMO_CACHE": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, "-W", "default", "-m", "omniloop_cli", "generate",
                          "a sine wave playing A4 two beats per second", "--model", "tone-demo", "--steps", "6",
                          "--seed", "1", "--out", str(tmp_path / "tone.wav")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "tone.wav").stat().st_size > 0
    for needle in ("weight_norm", "Should have t", "Warning"):
        assert needle not in res.stderr + res.stdout, (needle, res.stderr[-2000:])
