"""A tone-demo-shaped checkpoint (mono, 8 kHz, word-level tokenizer, trained by the recipe at toy
size) under the ``stable-audio`` family: the runtime's waveform equals diffusers'
``StableAudioPipeline`` bit for bit, and the ``tone-demo`` preset resolves to the shipped folder."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchsde")
pytest.importorskip("omniloop_stable_audio")

PROMPT = "a sine wave playing A4 two beats per second"


def test_runtime_equals_diffusers_on_a_tone_checkpoint(toy_run):
    from diffusers import StableAudioPipeline

    from omniloop.request import Status
    from omniloop.runtime import Runtime
    from omniloop_tone_demo.grammar import CLIP_SAMPLES, SAMPLE_RATE

    folder = toy_run[0] / "checkpoint"
    rt = Runtime.from_model(folder)
    assert rt.family.name == "stable-audio" and rt.tasks == frozenset({"t2a"})
    out = rt.generate({"task": "t2a", "prompt": PROMPT, "diffusion": {"seed": 3, "steps": 4, "guidance_scale": 3.0}})
    assert out.status is Status.COMPLETED, out.error
    audio = out.artifacts["audio"]
    assert audio.sample_rate == SAMPLE_RATE and tuple(audio.samples.shape) == (1, CLIP_SAMPLES)
    pipe = StableAudioPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(PROMPT, num_inference_steps=4, guidance_scale=3.0, generator=torch.Generator().manual_seed(3),
               output_type="pt").audios[0]
    assert torch.equal(audio.samples, ref)


def test_the_preset_resolves_to_the_package_folder(toy_run, monkeypatch):
    from omniloop.errors import DeployError
    from omniloop.runtime import Runtime
    from omniloop_tone_demo import checkpoint_path, plugin

    folder = toy_run[0] / "checkpoint"
    missing = folder.parent / "absent"
    monkeypatch.setattr(plugin, "checkpoint_dir", lambda: missing)
    monkeypatch.setattr(checkpoint_path, "checkpoint_dir", lambda: missing)
    with pytest.raises(DeployError, match="preset 'tone-demo': the tone-demo weights are not installed"):
        Runtime.from_model("tone-demo")
    monkeypatch.setattr(plugin, "checkpoint_dir", lambda: folder)
    monkeypatch.setattr(checkpoint_path, "checkpoint_dir", lambda: folder)
    rt = Runtime.from_model("tone-demo")
    out = rt.generate({"task": "t2a", "prompt": PROMPT, "diffusion": {"seed": 0, "steps": 2}})
    assert out.artifacts["audio"].sample_rate == 8000
