"""Bit-exact parity with diffusers' ``LTX2Pipeline`` (CPU float32, ``torch.equal``) on two tiny
checkpoints of different configurations: the video latents and audio latents (diffusers'
``output_type="latent"``: denormalised, unpacked), the decoded waveform (audio VAE + vocoder) and
the video frames (diffusers' frames in [0, 1] x 255, rounded, as its PIL/np output rounds them).

* ``a`` (perturbed attention, STG on block 1): diffusers' defaults — CFG 3 / audio 7, STG 1,
  modality 3, rescale 0.7 — with the empty negative prompt: three transformer calls per step;
  and every pass off (one call per step, the ``cond`` pass alone; audio rescale 0.5 on its own).
* ``b`` (no perturbed attention, 3 layers, 4x VAE): a negative prompt and non-default audio
  guidance (``audio: {guidance 4, stg 0.5, modality 2, rescale 0.3}``) and video knobs from
  ``node_params.denoise``, at 18 fps over 9 frames: 0.5 s x 25 audio latents per second = 12.5,
  which diffusers rounds half to even (12).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.request import Status

PROMPT = "a robot dancing in the rain"


def _reference(pipe: Any, seed: int = 0, **kw: Any) -> tuple[Any, Any]:
    """diffusers' latents (``output_type="latent"``) and decoded output (``"pt"``) for the same call."""
    kw = {"prompt": PROMPT, "height": 32, "width": 32, "num_inference_steps": 2, "max_sequence_length": 16, **kw}
    latents = pipe(**kw, generator=torch.Generator().manual_seed(seed), output_type="latent")
    decoded = pipe(**kw, generator=torch.Generator().manual_seed(seed), output_type="pt")
    return latents, decoded


def _assert_equal(out: Any, latents: Any, decoded: Any) -> None:
    assert out.status is Status.COMPLETED, out.error
    a = out.artifacts
    assert torch.equal(a["latents"].tensor, latents.frames), "video latents differ"
    assert torch.equal(a["audio_latents"].tensor, latents.audio), "audio latents differ"
    wave = a["audio"].samples
    assert wave.dtype == torch.float32 and wave.shape == decoded.audio[0].shape
    assert torch.equal(wave, decoded.audio[0]), "waveform differs"
    frames = (decoded.frames[0] * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(a["video"].frames, frames), "video frames differ"


def test_defaults_three_passes_bit_exact(runtime: Any, reference: Any, t2v: Any) -> None:
    out = runtime("a").generate(t2v(seed=0, frames=5, fps=25.0))
    latents, decoded = _reference(reference("a"), num_frames=5, frame_rate=25.0, spatio_temporal_guidance_blocks=[1])
    _assert_equal(out, latents, decoded)
    assert out.metrics["denoise"]["passes"] == ["cfg", "stg", "modality"]
    assert out.metrics["denoise"]["transformer_calls"] == 6  # 2 steps x (CFG pair, STG, modality)
    assert out.artifacts["audio"].sample_rate == 8000 and out.artifacts["audio"].samples.shape[0] == 2
    assert out.artifacts["video"].fps == 25.0 and tuple(out.artifacts["video"].frames.shape) == (5, 32, 32, 3)


def test_guidance_off_one_pass_bit_exact(runtime: Any, reference: Any, t2v: Any) -> None:
    """Every pass off (video STG 0, so audio STG 0 is unambiguous): one transformer call per step."""
    out = runtime("a").generate(t2v(seed=5, frames=7, fps=24.0, guidance_scale=1.0,
                                    audio={"guidance": 1.0, "stg": 0.0, "modality": 1.0, "rescale": 0.5},
                                    node_params={"denoise": {"stg": 0.0, "modality": 1.0, "rescale": 0.0}}))
    latents, decoded = _reference(reference("a"), seed=5, num_frames=7, frame_rate=24.0, guidance_scale=1.0,
                                  audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
                                  audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.5,
                                  spatio_temporal_guidance_blocks=[1])
    _assert_equal(out, latents, decoded)
    assert out.metrics["denoise"]["passes"] == ["cond"] and out.metrics["denoise"]["transformer_calls"] == 2


@pytest.mark.parametrize("fps", [18.0])
def test_negative_prompt_and_audio_guidance_bit_exact(runtime: Any, reference: Any, t2v: Any, fps: float) -> None:
    audio = {"guidance": 4.0, "stg": 0.5, "modality": 2.0, "rescale": 0.3}
    out = runtime("b").generate(t2v(seed=3, frames=9, fps=fps, negative="blurry low quality", guidance_scale=2.5,
                                    audio=audio, node_params={"denoise": {"stg": 0.7, "modality": 2.5, "rescale": 0.5}}))
    latents, decoded = _reference(
        reference("b"), seed=3, num_frames=9, frame_rate=fps, negative_prompt="blurry low quality", guidance_scale=2.5,
        stg_scale=0.7, modality_scale=2.5, guidance_rescale=0.5, audio_guidance_scale=4.0, audio_stg_scale=0.5,
        audio_modality_scale=2.0, audio_guidance_rescale=0.3, spatio_temporal_guidance_blocks=[2])
    _assert_equal(out, latents, decoded)
    assert out.artifacts["audio_latents"].tensor.shape[2] == 12  # round(12.5) half to even, as diffusers
    assert out.artifacts["audio"].samples.shape[0] == 1  # the mono vocoder
    assert any("perturbed attention" in w for w in out.metrics["warnings"])


def _image(path: Any) -> Any:
    import numpy as np
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(path)
    return Image.open(path)


@pytest.mark.parametrize(("variant", "crf", "negative"), [("a", None, None), ("b", 0, "blurry")])
def test_i2v_bit_exact(runtime: Any, tiny_ckpt: Any, t2v: Any, tmp_path: Any, variant: str, crf: Any,
                       negative: Any) -> None:
    """i2v against diffusers' ``LTX2ImageToVideoPipeline``: the first frame re-compressed at the
    default CRF (33 for a Gemma 3 encoder) or none (``node_params.denoise.image_crf: 0``), resized,
    encoded, kept clean at timestep 0 while the other latent frames denoise."""
    from diffusers import LTX2ImageToVideoPipeline

    image = _image(tmp_path / "first.png")
    frames = 5 if variant == "a" else 9
    req = t2v(seed=2, frames=frames, fps=25.0, negative=negative)
    req.update(task="i2v", inputs=[{"type": "image", "path": str(tmp_path / "first.png")}])
    if crf is not None:
        req["node_params"] = {"denoise": {"image_crf": crf}}
    out = runtime(variant).generate(req)
    pipe = LTX2ImageToVideoPipeline.from_pretrained(tiny_ckpt(variant), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    kw: dict[str, Any] = {"image": image, "num_frames": frames, "frame_rate": 25.0,
                          "spatio_temporal_guidance_blocks": [1 if variant == "a" else 2]}
    if crf is not None:
        kw["image_crf"] = crf
    if negative is not None:
        kw["negative_prompt"] = negative
    latents, decoded = _reference(pipe, seed=2, **kw)
    _assert_equal(out, latents, decoded)
