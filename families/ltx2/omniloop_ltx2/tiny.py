"""Tiny LTX-2 checkpoints: the ``LTX2Pipeline`` architecture at toy sizes, random weights.

Used by the tests (and by anyone who wants the whole code path without downloading weights)::

    python -m omniloop_ltx2.tiny OUT_DIR --variant a

The folder is written by diffusers' own ``LTX2Pipeline.save_pretrained`` (so its
``model_index.json`` is what a released checkpoint has): a ``Gemma3ForConditionalGeneration``
built from a tiny ``Gemma3Config`` (text and vision towers of a few hundred parameters) with a
Gemma tokenizer built locally (nothing downloaded; ``model_max_length`` 16), the
``LTX2TextConnectors``, an ``LTX2VideoTransformer3DModel``, an ``AutoencoderKLLTX2Video``, an
``AutoencoderKLLTX2Audio``, an ``LTX2Vocoder`` and a ``FlowMatchEulerDiscreteScheduler``. The
audio side is consistent, so a clip lasts what the video lasts: 25 audio latents per second
(8000 Hz, mel hop 80, the audio VAE's 4x), a vocoder upsampling by 80 to 8000 Hz. Variants:

* ``a`` — video VAE 2x spatial / 2x temporal (frames ``2k + 1``), 4 latent channels, a stereo
  vocoder, 2 layers with perturbed attention (STG acts: ``omniloop.json`` names block 1), split rope
* ``b`` — video VAE 4x / 4x (frames ``4k + 1``), 8 latent channels, a mono vocoder, 3 layers
  without perturbed attention (the STG pass perturbs nothing), interleaved rope, wider audio stream

Both write an ``omniloop.json`` with a 2-step default, 32x32 pixels and 25 fps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from omniloop_kit.tiny import tiny_command, variant_config, write_omniloop_json

VARIANTS = ("a", "b")
MAX_TOKENS = 16
_WORDS = ("a an the of in with and robot dancing cat dog city night rain music drum bell sea waves "
          "slow fast bright dark loud quiet blurry low quality").split()

#: per variant: the video VAE, the transformer, the audio VAE / vocoder sizes and the STG blocks
CONFIGS: dict[str, dict[str, Any]] = {
    "a": {"vae_blocks": 1, "latent": 4, "heads": 2, "head_dim": 8, "cross": 16, "audio_heads": 2, "audio_head_dim": 4,
          "audio_cross": 8, "layers": 2, "perturbed": True, "rope": "split", "audio_latent": 2, "mel": 8,
          "voc_out": 2, "stg_blocks": [1], "gemma_layers": 2},
    "b": {"vae_blocks": 2, "latent": 8, "heads": 2, "head_dim": 8, "cross": 16, "audio_heads": 2, "audio_head_dim": 8,
          "audio_cross": 16, "layers": 3, "perturbed": False, "rope": "interleaved", "audio_latent": 4, "mel": 16,
          "voc_out": 1, "stg_blocks": [2], "gemma_layers": 3},
}
TINY_DEFAULTS: dict[str, Any] = {"steps": 2, "height": 32, "width": 32, "fps": 25.0, "max_sequence_length": MAX_TOKENS}
RATE, HOP = 8000, 80


def gemma_tokenizer(out: Path) -> Any:
    """A Gemma tokenizer (BPE with byte fallback; the prompt words whole, letters as fallback), saved to ``out``."""
    import string

    from transformers import GemmaTokenizer

    vocab: dict[str, int] = {}
    for tok in ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "\u2581"]:
        vocab[tok] = len(vocab)
    for w in _WORDS:
        vocab.setdefault("\u2581" + w, len(vocab))
    for c in string.ascii_letters + string.digits + string.punctuation:
        vocab.setdefault(c, len(vocab))
        vocab.setdefault("\u2581" + c, len(vocab))
    tok = GemmaTokenizer(vocab=vocab, merges=[], model_max_length=MAX_TOKENS)
    tok.save_pretrained(str(out))
    return GemmaTokenizer.from_pretrained(str(out))


def text_encoder(vocab: int, layers: int) -> Any:
    """A tiny ``Gemma3ForConditionalGeneration`` (hidden 16, ``layers`` text layers, a 1-layer vision tower)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(
        text_config={"vocab_size": vocab, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": layers,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 8,
                     "max_position_embeddings": 64, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 8, "patch_size": 4},
        mm_tokens_per_image=4, boi_token_index=vocab - 3, eoi_token_index=vocab - 2, image_token_index=vocab - 1)
    return Gemma3ForConditionalGeneration(cfg).eval()


def video_vae(c: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKLLTX2Video

    n = c["vae_blocks"]
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=c["latent"], block_out_channels=(8,) * n,
        decoder_block_out_channels=(8,) * n, layers_per_block=(1,) * (n + 1), decoder_layers_per_block=(1,) * (n + 1),
        spatio_temporal_scaling=(True,) * n, decoder_spatio_temporal_scaling=(True,) * n,
        decoder_inject_noise=(False,) * (n + 1), downsample_type=("spatiotemporal",) * n, upsample_residual=(False,) * n,
        upsample_factor=(1,) * n, timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True,
        decoder_causal=False)
    return vae.eval()


def build_components(variant: str = "a", seed: int = 0, tokenizer_dir: Path | None = None) -> dict[str, Any]:
    """The pipeline's components in memory (random weights from ``seed``; the tokenizer is written
    to ``tokenizer_dir`` and loaded from there)."""
    from diffusers import AutoencoderKLLTX2Audio, FlowMatchEulerDiscreteScheduler, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    c = variant_config(CONFIGS, variant)
    assert tokenizer_dir is not None
    tokenizer = gemma_tokenizer(tokenizer_dir)
    torch.manual_seed(seed)
    te = text_encoder(len(tokenizer) + 3, c["gemma_layers"])
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=c["gemma_layers"] + 1, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_double_precision=False,
        rope_type=c["rope"])
    vae = video_vae(c)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=c["latent"], out_channels=c["latent"], num_attention_heads=c["heads"],
        attention_head_dim=c["head_dim"], cross_attention_dim=c["cross"],
        vae_scale_factors=(vae.temporal_compression_ratio, vae.spatial_compression_ratio, vae.spatial_compression_ratio),
        audio_in_channels=c["audio_latent"] * c["mel"] // 4, audio_out_channels=c["audio_latent"] * c["mel"] // 4,
        audio_num_attention_heads=c["audio_heads"], audio_attention_head_dim=c["audio_head_dim"],
        audio_cross_attention_dim=c["audio_cross"], audio_sampling_rate=RATE, audio_hop_length=HOP,
        num_layers=c["layers"], caption_channels=16, rope_double_precision=False, rope_type=c["rope"],
        perturbed_attn=c["perturbed"])
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=c["audio_latent"] * c["mel"] // 4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=c["audio_latent"], norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=RATE, mel_hop_length=HOP, is_causal=True, mel_bins=c["mel"])
    vocoder = LTX2Vocoder(
        in_channels=2 * c["mel"], hidden_channels=32, out_channels=c["voc_out"], upsample_kernel_sizes=[8, 8, 10],
        upsample_factors=[4, 4, 5], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3]], output_sampling_rate=RATE)
    # non-trivial latent statistics, so that (de)normalisation is exercised
    for module in (vae, audio_vae):
        n = module.latents_mean.shape[0]
        module.latents_mean.copy_(0.1 * torch.randn(n))
        module.latents_std.copy_(1.0 + 0.2 * torch.rand(n))
    return {"transformer": transformer.eval(), "vae": vae, "audio_vae": audio_vae.eval(), "vocoder": vocoder.eval(),
            "text_encoder": te, "tokenizer": tokenizer, "connectors": connectors.eval(),
            "scheduler": FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                                  shift_terminal=0.1)}


def build_tiny_checkpoint(out: str | Path, variant: str = "a", seed: int = 0,
                          defaults: dict[str, Any] | None = None) -> Path:
    """Write a tiny diffusers-format LTX-2 checkpoint to ``out``; returns its path."""
    import tempfile

    from diffusers import LTX2Pipeline

    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        comps = build_components(variant, seed, Path(tmp) / "tokenizer")
        LTX2Pipeline(**comps).save_pretrained(str(out), safe_serialization=True)
    write_omniloop_json(out, variant, {**TINY_DEFAULTS, "stg_blocks": CONFIGS[variant]["stg_blocks"],
                                       **(defaults or {})})
    return out


main = tiny_command(build_tiny_checkpoint, module="omniloop_ltx2.tiny", what="LTX-2", doc=__doc__ or "",
                    variants=VARIANTS, default="a")


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CONFIGS", "TINY_DEFAULTS", "VARIANTS", "build_components", "build_tiny_checkpoint", "main"]
