"""The Stable Audio family through the runtime: discovery, declaration, defaults, the request's
window, refusals before compute, block interceptors (fbcache, cache-dit) and block taps on the
DiT, the conformance kit, checkpoint errors and the tiny-checkpoint builder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from omniloop.errors import CheckpointError, DeployError, RequestError
from omniloop.request import Status
from omniloop.runtime import Deployment, Runtime
from omniloop.testing import build_toy_checkpoint, check_first_block_cache, completed_latents, make_manager
from omniloop.testing.conformance import check_family


def test_discovered_declared_and_defaults(tiny_ckpt, t2a):
    rt = Runtime.from_model(tiny_ckpt())  # entry-point discovery, as a user's runtime does
    assert rt.family.name == "stable-audio" and rt.tasks == frozenset({"t2a"})
    caps = rt.capabilities
    assert caps.audio and caps.block_interceptors and caps.returns_latents and caps.rollout_support is None
    out = rt.generate({"task": "t2a", "prompt": "a drum", "outputs": {"return_latents": True}})
    assert out.status is Status.COMPLETED, out.error
    audio = out.artifacts["audio"]
    assert audio.samples.dtype == torch.float32 and tuple(audio.samples.shape) == (2, 128) and audio.sample_rate == 400
    assert tuple(out.artifacts["latents"].tensor.shape) == (1, 8, 16)
    # the tiny checkpoint's omniloop.json default (4 denoise steps), plus the decode: a one-step loop
    assert out.metrics["steps"] == 4 + 1
    assert "latents" not in rt.generate(t2a(steps=1, outputs={})).artifacts


def test_diffusers_defaults_without_omniloop_json(tiny_ckpt, tmp_path, make_runtime):
    ckpt = tmp_path / "plain"
    shutil.copytree(tiny_ckpt(), ckpt)
    (ckpt / "omniloop.json").unlink()
    rt = make_runtime(ckpt)
    r = rt.prepare({"task": "t2a", "prompt": "a drum"}).resolved
    assert (r.steps, r.guidance_scale, r.negative_prompt, r.start, r.end) == (100, 7.0, None, 0.0, 0.32)
    assert (r.sample_start, r.sample_end) == (0, 128)
    assert rt.defaults("t2a")["seconds"] == pytest.approx(0.32)
    w = r.workload()
    assert (w.steps, w.branches) == (100, 2)


@pytest.mark.parametrize(("audio", "path", "words"), [
    ({"seconds": 0.5}, "audio.seconds", "longer than this checkpoint makes"),
    ({"start": 0.2, "seconds": 0.2}, "audio.seconds", "ends beyond"),
    ({"start": 0.4}, "audio.start", "at or after the window's end"),
    ({"start": 0.32}, "audio.start", "at or after the window's end"),
    ({"seconds": 0.001}, "audio.seconds", "holds no sample"),
    ({"seconds": 0.0}, "audio.seconds", ""),
    ({"seconds": float("nan")}, "audio.seconds", ""),
    ({"seconds": -1}, "audio.seconds", ""),
])
def test_bad_windows_refused_before_compute(runtime, t2a, audio, path, words):
    with pytest.raises(RequestError) as err:
        runtime().prepare(t2a(audio=audio))
    assert err.value.path == path and words in str(err.value), str(err.value)


def test_bad_windows_refused_by_the_deployment_without_weights(tiny_ckpt, t2a):
    import omniloop_stable_audio.plugin as sa_plugin

    dep = Deployment({"model": {"path": str(tiny_ckpt())}}, manager=make_manager(("stable-audio", sa_plugin), toy=False))
    dep.check(t2a(audio={"seconds": 0.3}))
    with pytest.raises(RequestError) as err:
        dep.check(t2a(audio={"seconds": 1.0}))
    assert err.value.path == "audio.seconds"


@pytest.mark.parametrize(("change", "path"), [
    ({"diffusion": {"height": 64}}, "diffusion.height"),
    ({"diffusion": {"frames": 3}}, "diffusion.frames"),
    ({"task": "t2v"}, "task"),
    ({"sampling": {"temperature": 0.5}}, "sampling.temperature"),
    ({"rollout": {"kind": "sde"}}, "rollout"),
    ({"inputs": [{"type": "text", "text": "a drum"}, {"type": "image", "path": "x.png"}]}, "inputs[1]"),
])
def test_bad_requests_refused(runtime, t2a, change, path):
    req = t2a()
    for key, value in change.items():
        req[key] = {**req[key], **value} if isinstance(value, dict) and isinstance(req.get(key), dict) else value
    if "inputs" in change:
        req.pop("prompt")
    with pytest.raises(RequestError) as err:
        runtime().prepare(req)
    assert err.value.path == path, str(err.value)


def test_audio_refused_by_a_family_that_makes_none(tmp_path):
    rt = Runtime.from_model(build_toy_checkpoint(tmp_path / "toy"), manager=make_manager())
    with pytest.raises(RequestError) as err:
        rt.prepare({"task": "t2v", "prompt": "a red fox", "audio": {"seconds": 2}})
    assert err.value.path == "audio" and "does not make audio" in str(err.value)
    with pytest.raises(RequestError) as err:  # t2a on a video model
        rt.prepare({"task": "t2a", "prompt": "a red fox"})
    assert err.value.path == "task" and "'t2a' is not supported by family 'toy'" in str(err.value)


def test_unknown_deploy_options_and_policies_refused(tiny_ckpt, make_runtime):
    with pytest.raises(DeployError, match=r"options\.qkv"):
        make_runtime(tiny_ckpt(), options={"qkv": "fused"})
    with pytest.raises(DeployError, match=r"options\.rollout"):
        make_runtime(tiny_ckpt(), options={"rollout": "causal"})


def test_fbcache_on_the_dit_blocks(tiny_ckpt, make_runtime, t2a):
    import omniloop_fbcache.plugin as fbcache_plugin

    out = check_first_block_cache(lambda *p, **d: make_runtime(tiny_ckpt(), *p, **d), fbcache_plugin, t2a(steps=8))
    assert list(out.metrics["plugins"]["fbcache"]) == ["uncond+cond"]  # one forward computes both CFG rows


def test_cache_dit_on_the_dit_blocks(tiny_ckpt, make_runtime, t2a):
    pytest.importorskip("cache_dit")
    import omniloop_cache_dit.plugin as cache_dit_plugin
    from omniloop.testing import check_block_cache

    check_block_cache(lambda *p, **d: make_runtime(tiny_ckpt(), *p, **d), "cache-dit", cache_dit_plugin,
                      {"Fn": 1, "Bn": 0, "residual_diff_threshold": 0.5, "max_warmup_steps": 2}, t2a(steps=8))


def test_block_taps_see_every_dit_block(tiny_ckpt, make_runtime, t2a):
    from omniloop.testing import block_taps

    seen = block_taps(lambda *p, **d: make_runtime(tiny_ckpt(), *p, **d), t2a(steps=1))
    blocks = sorted({n for n, _ in seen if "transformer_blocks" in n})
    assert blocks == [f"transformer.transformer_blocks.{i}" for i in range(2)], blocks
    # [uncond + cond rows, the global token + 16 latent frames, 4 heads x 8]
    assert all(s == (2, 1 + 16, 32) for n, s in seen if "transformer_blocks" in n)
    assert ("audio", (2, 128)) in seen


def test_conformance_kit(runtime):
    check_family(lambda: runtime(), {"task": "t2a", "prompt": "a drum", "diffusion": {"steps": 2}}, output="audio")


@pytest.mark.slow
def test_compiled_blocks_equal_eager(tiny_ckpt, make_runtime, t2a):
    eager = make_runtime(tiny_ckpt())
    comp = make_runtime(tiny_ckpt(), compile=True, options={"compile_backend": "eager"})
    out = comp.generate(t2a(steps=2))
    assert out.metrics["denoise"]["compiled_blocks"] is True
    assert torch.equal(completed_latents(out), completed_latents(eager.generate(t2a(steps=2))))


def test_bad_checkpoints_named(tiny_ckpt, tmp_path, make_runtime):
    def broken(name: str, edit: Any) -> Path:
        ckpt = tmp_path / name
        shutil.copytree(tiny_ckpt(), ckpt)
        edit(ckpt)
        return ckpt

    def set_json(path: Path, **values: Any) -> None:
        path.write_text(json.dumps({**json.loads(path.read_text()), **values}))

    cases = [
        (lambda c: set_json(c / "vae" / "config.json", decoder_input_channels=5), "decoder_input_channels=5"),
        (lambda c: set_json(c / "projection_model" / "config.json", conditioning_dim=7), "cross_attention_input_dim"),
        (lambda c: set_json(c / "scheduler" / "scheduler_config.json", _class_name="DDIMScheduler"), "not supported"),
        (lambda c: (c / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00" * 4), "transformer"),
        (lambda c: set_json(c / "model_index.json", projection_model=[None, None]), "'projection_model' is not declared"),
        (lambda c: set_json(c / "omniloop.json", defaults={"height": 3}), "defaults.height"),
    ]
    for i, (edit, words) in enumerate(cases):
        with pytest.raises(CheckpointError) as err:
            make_runtime(broken(f"bad{i}", edit))
        assert words in str(err.value), str(err.value)


@pytest.mark.slow
def test_tiny_builder_cli(tmp_path):
    out = tmp_path / "mono"
    res = subprocess.run([sys.executable, "-m", "omniloop_stable_audio.tiny", str(out), "--variant", "mono"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    from omniloop_stable_audio.checkpoint import looks_like_stable_audio

    assert looks_like_stable_audio(out)
    assert json.loads((out / "vae" / "config.json").read_text())["audio_channels"] == 1
