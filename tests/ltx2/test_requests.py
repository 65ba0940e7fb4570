"""Bad input to the ltx2 family: one ``RequestError`` naming the field, before any compute
(``Runtime.check``: resolve only); a block interceptor refused at load with one line."""

from __future__ import annotations

from typing import Any

import pytest

from omniloop.errors import DeployError, RequestError


@pytest.mark.parametrize(("extra", "field", "words"), [
    ({"diffusion": {"frames": 6}}, "diffusion.frames", "temporal factor 2 plus 1, got 6 (try 5 or 7)"),
    ({"diffusion": {"height": 40}}, "diffusion.height", "multiple of 32"),
    ({"audio": {"guidance": 0.0}}, "audio.guidance", "ambiguous"),
    ({"audio": {"stg": 0.0}}, "audio.stg", "audio_x or x"),
    ({"audio": {"guidance": float("nan")}}, "audio.guidance", ""),
    ({"audio": {"rescale": float("inf")}}, "audio.rescale", ""),
    ({"audio": {"rescale": 1.5}}, "audio.rescale", ""),
    ({"audio": {"seconds": 1.0}}, "audio.seconds", "lasts what the video lasts"),
    ({"node_params": {"denoise": {"stg": float("inf")}}}, "node_params.denoise.stg", ""),
    ({"node_params": {"denoise": {"modality": float("nan")}}}, "node_params.denoise.modality", ""),
    ({"node_params": {"denoise": {"stg_blocks": [7]}}}, "node_params.denoise.stg_blocks", "block 7 does not exist"),
    ({"node_params": {"denoise": {"stg": 1.0, "stg_blocks": []}}}, "node_params.denoise.stg_blocks", "names no block"),
    ({"diffusion": {"shift": 3.0}}, "diffusion.shift", "checkpoint's"),
    ({"task": "i2v"}, "inputs", "an i2v request needs an image part"),
    ({"task": "t2a"}, "task", "'t2a' is not supported by family 'ltx2'"),
    ({"inputs": [{"type": "image", "path": "x.png"}]}, "inputs[0]", "image conditioning is task i2v"),
    ({"node_params": {"denoise": {"image_crf": 52}}}, "node_params.denoise.image_crf", ""),
])
def test_bad_request_is_one_error_naming_the_field(runtime: Any, extra: dict[str, Any], field: str, words: str) -> None:
    req: dict[str, Any] = {"task": "t2v", "prompt": "a cat", "diffusion": {"frames": 5, "steps": 2}}
    for key, value in extra.items():
        req[key] = {**req[key], **value} if isinstance(value, dict) and key in req else value
    with pytest.raises(RequestError) as err:
        runtime("a").check(req)
    assert err.value.path == field, err.value
    assert words in str(err.value)


def test_audio_zero_is_taken_when_the_video_value_is_zero_too(runtime: Any) -> None:
    req = runtime("a").check({"task": "t2v", "prompt": "a cat", "diffusion": {"frames": 5},
                              "audio": {"stg": 0.0}, "node_params": {"denoise": {"stg": 0.0}}})
    assert req.audio is not None and req.audio.stg == 0.0


def test_frames_fit_the_other_checkpoints_factor(runtime: Any) -> None:
    with pytest.raises(RequestError, match="temporal factor 4 plus 1, got 7 \\(try 5 or 9\\)"):
        runtime("b").check({"task": "t2v", "prompt": "a cat", "diffusion": {"frames": 7}})


def test_audio_knobs_on_families_without_them_are_refused(tmp_path: Any) -> None:
    """A model that makes no audio refuses the audio object; one that makes audio but has no
    separate audio guidance (toy-audio, like Stable Audio) refuses the knob by name."""
    from omniloop.runtime import Runtime
    from omniloop.testing import build_toy_audio_checkpoint, build_toy_checkpoint, make_manager

    video = Runtime.from_model(build_toy_checkpoint(tmp_path / "toy"), manager=make_manager())
    with pytest.raises(RequestError) as err:
        video.check({"task": "t2v", "prompt": "a cat", "audio": {"guidance": 4.0}})
    assert err.value.path == "audio"
    sound = Runtime.from_model(build_toy_audio_checkpoint(tmp_path / "ta"), manager=make_manager(toy_audio=True))
    with pytest.raises(RequestError) as err:
        sound.check({"task": "t2a", "prompt": "a bell", "audio": {"seconds": 1.0, "modality": 2.0}})
    assert err.value.path == "audio.modality" and "no separate audio guidance" in str(err.value)


def test_block_interceptors_are_refused_at_load(tiny_ckpt: Any, make_runtime: Any) -> None:
    """cache-dit / fbcache need the blocks through run_blocks; diffusers' LTX-2 transformer runs
    its own joint block loop, so the deploy is refused, one line, before any weight is read."""
    import omniloop_fbcache.plugin as fbcache

    with pytest.raises(DeployError, match="needs a family that runs its blocks through run_blocks") as err:
        make_runtime(tiny_ckpt("a"), ("fbcache", fbcache), plugins={"fbcache": {}})
    assert "\n" not in str(err.value)
