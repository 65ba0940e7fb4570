"""Tiny Stable Audio checkpoints: the ``StableAudioPipeline`` architecture at toy sizes, random weights.

Used by the tests (and by anyone who wants the whole code path without downloading weights)::

    python -m omniloop_stable_audio.tiny OUT_DIR --variant stereo

The folder is written by diffusers' own ``StableAudioPipeline.save_pretrained`` (so its
``model_index.json`` is what a released checkpoint has): a ``T5EncoderModel`` with a T5 tokenizer
built locally (omniloop-kit, nothing downloaded; ``model_max_length`` 16), a
``StableAudioProjectionModel``, a ``StableAudioDiTModel``, an ``AutoencoderOobleck`` and a
``CosineDPMSolverMultistepScheduler`` config (Stable Audio Open's). Variants:

* ``stereo`` — two audio channels at 400 Hz, 16 latent frames of hop 8 (0.32 s), a linear text
  projection (T5 width 16 → conditioning 24), 4 heads over 2 key/value heads (GQA cross attention)
* ``mono``   — one audio channel at 256 Hz, 24 latent frames of hop 4 (0.375 s), an identity text
  projection (widths equal), 2 heads, no GQA, seconds conditioning over 0..8 s

Both write an ``omniloop.json`` with a 4-step default so a default request is instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from omniloop_kit.tiny import T5_CONFIG, t5_unigram_tokenizer, write_omniloop_json

VARIANTS = ("stereo", "mono")

_WORDS = ("a an the of in with and low quality noise drum sine square saw wave tone beat fast slow loud soft "
          "hammer wood metal rain bird piano guitar playing per second three two one").split()

#: per variant: T5 width, conditioning width, DiT heads / kv heads / head dim, latent channels and
#: length, VAE hop (downsampling ratios), audio channels, sampling rate, seconds range
CONFIGS: dict[str, dict[str, Any]] = {
    "stereo": {"t5": 16, "cond": 24, "heads": 4, "kv_heads": 2, "head_dim": 8, "latent": 8, "length": 16,
               "ratios": [2, 4], "channels": 2, "rate": 400, "min_s": 0, "max_s": 16, "layers": 2},
    "mono": {"t5": 16, "cond": 16, "heads": 2, "kv_heads": 2, "head_dim": 8, "latent": 4, "length": 24,
             "ratios": [2, 2], "channels": 1, "rate": 256, "min_s": 0, "max_s": 8, "layers": 3},
}

TINY_DEFAULTS: dict[str, Any] = {"steps": 4}
MAX_TOKENS = 16


def build_components(variant: str = "stereo", seed: int = 0, tokenizer_dir: Path | None = None) -> dict[str, Any]:
    """The pipeline's components in memory (random weights from ``seed``; the tokenizer is written
    to ``tokenizer_dir`` and loaded from there)."""
    from diffusers import AutoencoderOobleck, CosineDPMSolverMultistepScheduler, StableAudioDiTModel
    from diffusers.pipelines.stable_audio import StableAudioProjectionModel
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    if variant not in CONFIGS:
        raise ValueError(f"unknown variant {variant!r} (one of {', '.join(VARIANTS)})")
    c = CONFIGS[variant]
    assert tokenizer_dir is not None
    vocab = t5_unigram_tokenizer(tokenizer_dir, _WORDS)
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({**T5_CONFIG, "model_max_length": MAX_TOKENS}))
    tokenizer = T5TokenizerFast.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(seed)
    text_encoder = T5EncoderModel(T5Config(
        vocab_size=vocab, d_model=c["t5"], d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="relu",
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    projection = StableAudioProjectionModel(text_encoder_dim=c["t5"], conditioning_dim=c["cond"],
                                            min_value=c["min_s"], max_value=c["max_s"])
    transformer = StableAudioDiTModel(
        sample_size=c["length"], in_channels=c["latent"], num_layers=c["layers"], attention_head_dim=c["head_dim"],
        num_attention_heads=c["heads"], num_key_value_attention_heads=c["kv_heads"], out_channels=c["latent"],
        cross_attention_dim=c["heads"] * c["head_dim"], time_proj_dim=16, global_states_input_dim=2 * c["cond"],
        cross_attention_input_dim=c["cond"])
    vae = AutoencoderOobleck(encoder_hidden_size=2 * c["latent"], downsampling_ratios=c["ratios"],
                             channel_multiples=[1, 2][: len(c["ratios"])], decoder_channels=8,
                             decoder_input_channels=c["latent"], audio_channels=c["channels"], sampling_rate=c["rate"])
    scheduler = CosineDPMSolverMultistepScheduler(sigma_min=0.3, sigma_max=500, sigma_data=1.0,
                                                  sigma_schedule="exponential", solver_order=2,
                                                  prediction_type="v_prediction", rho=7.0, solver_type="midpoint",
                                                  final_sigmas_type="zero")
    return {"vae": vae.eval(), "text_encoder": text_encoder.eval(), "projection_model": projection.eval(),
            "tokenizer": tokenizer, "transformer": transformer.eval(), "scheduler": scheduler}


def build_tiny_checkpoint(out: str | Path, variant: str = "stereo", seed: int = 0,
                          defaults: dict[str, Any] | None = None) -> Path:
    """Write a tiny diffusers-format Stable Audio checkpoint to ``out``; returns its path."""
    import tempfile

    from diffusers import StableAudioPipeline

    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        comps = build_components(variant, seed, Path(tmp) / "tokenizer")
        StableAudioPipeline(**comps).save_pretrained(str(out), safe_serialization=True)
    write_omniloop_json(out, variant, TINY_DEFAULTS if defaults is None else defaults)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m omniloop_stable_audio.tiny", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--variant", choices=VARIANTS, default="stereo")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = build_tiny_checkpoint(args.out, args.variant, args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CONFIGS", "TINY_DEFAULTS", "VARIANTS", "build_components", "build_tiny_checkpoint", "main"]
