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

Stable Audio 3 (``StableAudio3Pipeline``: a ``T5GemmaEncoderModel`` with a Gemma tokenizer built
locally, a ``StableAudio3DurationEmbedder``, a ``StableAudio3DiTModel``, an ``AutoencoderSAME``, a
``FlowMatchEulerDiscreteScheduler``):

* ``sa3``      — stereo at 256 Hz, hop 8 (SAME patch 4, stride 2), differential attention, 4 memory
  tokens, the distilled checkpoint's stochastic (ping-pong) scheduler, durations up to 2 s
* ``sa3-base`` — mono at 200 Hz, hop 4, plain attention, no memory tokens, DiT patch size 2, the
  base checkpoint's deterministic Euler scheduler, durations 0.1..1 s

All write an ``omniloop.json`` with a 4-step default so a default request is instant (the SA3 ones
also a 0.25 s default clip).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from omniloop_kit.tiny import T5_CONFIG, t5_unigram_tokenizer, tiny_command, variant_config, write_omniloop_json

VARIANTS = ("stereo", "mono", "sa3", "sa3-base")

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

#: Stable Audio 3 variants: text width, DiT width / heads / depth, latent channels, SAME patch and
#: stride, audio channels, rate, differential attention, memory tokens, DiT patch, stochastic
#: sampling, duration range
CONFIGS_3: dict[str, dict[str, Any]] = {
    "sa3": {"text": 16, "dim": 32, "heads": 2, "depth": 2, "latent": 8, "patch": 4, "stride": 2, "channels": 2,
            "rate": 256, "diff": True, "memory": 4, "dit_patch": 1, "stochastic": True, "min_s": 0.0, "max_s": 2.0},
    "sa3-base": {"text": 16, "dim": 16, "heads": 2, "depth": 3, "latent": 4, "patch": 2, "stride": 2,
                 "channels": 1, "rate": 200, "diff": False, "memory": 0, "dit_patch": 2, "stochastic": False,
                 "min_s": 0.1, "max_s": 1.0},
}

TINY_DEFAULTS: dict[str, Any] = {"steps": 4}
TINY_DEFAULTS_3: dict[str, Any] = {"steps": 4, "seconds": 0.25}
MAX_TOKENS = 16
#: transformers' GemmaTokenizer splits the tiny vocabulary's words into letters: room for a prompt
MAX_TOKENS_3 = 64


def build_components(variant: str = "stereo", seed: int = 0, tokenizer_dir: Path | None = None) -> dict[str, Any]:
    """The pipeline's components in memory (random weights from ``seed``; the tokenizer is written
    to ``tokenizer_dir`` and loaded from there)."""
    from diffusers import AutoencoderOobleck, CosineDPMSolverMultistepScheduler, StableAudioDiTModel
    from diffusers.pipelines.stable_audio import StableAudioProjectionModel
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    c = variant_config(CONFIGS, variant)
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


def build_components_3(variant: str = "sa3", seed: int = 0, tokenizer_dir: Path | None = None) -> dict[str, Any]:
    """Stable Audio 3's components in memory (random weights from ``seed``, the zero-initialised
    convolutions and padding embedding made random too, so that every path carries signal)."""
    from diffusers import AutoencoderSAME, FlowMatchEulerDiscreteScheduler, StableAudio3DiTModel
    from diffusers.pipelines.stable_audio_3 import StableAudio3DurationEmbedder
    from transformers import GemmaTokenizerFast, T5GemmaConfig, T5GemmaEncoderModel
    from transformers.models.t5gemma.configuration_t5gemma import T5GemmaModuleConfig

    c = CONFIGS_3[variant]
    assert tokenizer_dir is not None
    vocab = t5_unigram_tokenizer(tokenizer_dir, _WORDS)
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GemmaTokenizer", "model_max_length": MAX_TOKENS_3, "pad_token": "<pad>",
         "eos_token": "</s>", "bos_token": "</s>", "unk_token": "<unk>"}))
    tokenizer = GemmaTokenizerFast.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(seed)
    enc = T5GemmaModuleConfig(vocab_size=vocab, hidden_size=c["text"], intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=0,
                              query_pre_attn_scalar=8, sliding_window=8).to_dict()
    text_encoder = T5GemmaEncoderModel(T5GemmaConfig(encoder=enc, decoder=enc, is_encoder_decoder=False,
                                                     vocab_size=vocab))
    duration = StableAudio3DurationEmbedder(output_dim=c["text"], fourier_dim=8, min_val=c["min_s"],
                                            max_val=c["max_s"])
    transformer = StableAudio3DiTModel(
        io_channels=c["latent"], patch_size=c["dit_patch"], embed_dim=c["dim"], depth=c["depth"],
        num_heads=c["heads"], cond_token_dim=c["text"], global_cond_dim=c["text"], local_add_cond_dim=3,
        timestep_features_dim=16, num_memory_tokens=c["memory"], use_differential_attention=c["diff"])
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if name.endswith(("preprocess_conv.weight", "postprocess_conv.weight", "prompt_padding_embedding")):
                p.normal_(0.0, 0.2)
    vae = AutoencoderSAME(audio_channels=c["channels"], patch_size=c["patch"], encoder_channels=8,
                          encoder_c_mults=[2], encoder_strides=[c["stride"]], encoder_transformer_depths=[1],
                          latent_dim=c["latent"], use_differential_attention=c["diff"], dim_heads=8, ff_mult=2,
                          sampling_rate=c["rate"])
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, shift=1.0,
                                                stochastic_sampling=c["stochastic"])
    return {"vae": vae.eval(), "text_encoder": text_encoder.eval(), "duration_embedder": duration.eval(),
            "tokenizer": tokenizer, "transformer": transformer.eval(), "scheduler": scheduler}


def build_tiny_checkpoint(out: str | Path, variant: str = "stereo", seed: int = 0,
                          defaults: dict[str, Any] | None = None) -> Path:
    """Write a tiny diffusers-format Stable Audio checkpoint to ``out``; returns its path."""
    import tempfile

    from diffusers import StableAudio3Pipeline, StableAudioPipeline

    out = Path(out)
    sa3 = variant in CONFIGS_3
    with tempfile.TemporaryDirectory() as tmp:
        if sa3:
            StableAudio3Pipeline(**build_components_3(variant, seed, Path(tmp) / "tokenizer")).save_pretrained(
                str(out), safe_serialization=True)
        else:
            comps = build_components(variant, seed, Path(tmp) / "tokenizer")
            StableAudioPipeline(**comps).save_pretrained(str(out), safe_serialization=True)
    write_omniloop_json(out, variant, (TINY_DEFAULTS_3 if sa3 else TINY_DEFAULTS) if defaults is None else defaults)
    return out


main = tiny_command(build_tiny_checkpoint, module="omniloop_stable_audio.tiny", what="Stable Audio",
                    doc=__doc__ or "", variants=VARIANTS, default="stereo")


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CONFIGS", "CONFIGS_3", "TINY_DEFAULTS", "TINY_DEFAULTS_3", "VARIANTS", "build_components",
           "build_components_3", "build_tiny_checkpoint", "main"]
