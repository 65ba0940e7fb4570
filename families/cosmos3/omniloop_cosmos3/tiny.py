"""Tiny Cosmos 3 omni checkpoints: the ``Cosmos3OmniPipeline`` architecture at toy sizes, random weights.

Used by the tests (and by anyone who wants the whole code path without downloading weights)::

    python -m omniloop_cosmos3.tiny OUT_DIR --variant qwen

The folder is written by diffusers' own ``Cosmos3OmniPipeline.save_pretrained`` (safety checker
off: it needs ``cosmos_guardrail`` and weights this project cannot ship), with a byte-level BPE
chat tokenizer built here (ChatML template, ``<|vision_start|>``; nothing downloaded). Variants:

* ``qwen``     — the Qwen3 backbone (SiLU MLPs, q/k norms on the text pathway), fps-modulated
  mRoPE, a Wan 2.2 VAE (48 channels, 16x spatial, patchified), a sound tokenizer (sound_gen) and
  an action head (action_gen, 12 wide), UniPC on the pipeline's shifted flow schedule
* ``nemotron`` — the Nemotron backbone (relu² MLPs, no text q/k norm, a separate und-key norm for
  the generation pathway), integer mRoPE without fps modulation or spatial reset, a Wan 2.1 VAE
  (16 channels, 8x spatial), no sound, no action, ``use_native_flow_schedule``

Both write an ``omniloop.json`` with a 3-step default so a default request is instant.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from omniloop_kit.tiny import tiny_command, variant_config, write_omniloop_json

VARIANTS = ("qwen", "nemotron")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>")

#: ChatML (the template Qwen-style checkpoints ship)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = ("You are a helpful assistant who will generate videos from a give prompt. This video is of 32x48 "
           "resolution. The video is not 0.2 seconds long and is not of 24 FPS. a red ball rolls over the green "
           "grass while a robot arm picks up a cup. 0 1 2 3 4 5 6 7 8 9 x . , { } : \" [ ]")

#: per variant: transformer config, VAE config, sound tokenizer config (None: no sound), scheduler
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen": {
        "transformer": dict(head_dim=16, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=2, latent_channel=48, latent_patch_size=2,
                            patch_latent_dim=192, rope_axes_dim=[4, 2, 2], rope_theta=10000.0,
                            unified_3d_mrope_temporal_modality_margin=40, enable_fps_modulation=True,
                            unified_3d_mrope_reset_spatial_ids=True, sound_gen=True, sound_dim=8,
                            sound_latent_fps=25.0, action_gen=True, action_dim=12, num_embodiment_domains=24,
                            hidden_act="silu", qk_norm_for_text=True),
        "vae": dict(base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                    temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                    patch_size=2, scale_factor_spatial=16),
        "sound": dict(sampling_rate=800, vocoder_input_dim=8, dec_dim=8, dec_c_mults=(1, 2), dec_strides=(2, 2),
                      dec_out_channels=2, enc_dim=8, enc_latent_dim=16, enc_c_mults=(1, 2), enc_strides=(2, 2),
                      enc_n_fft=16, enc_hop_length=4, enc_num_blocks=1),
        "scheduler": dict(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=5.0),
        "pipeline": dict(use_native_flow_schedule=False),
    },
    "nemotron": {
        "transformer": dict(head_dim=8, hidden_size=24, intermediate_size=40, num_attention_heads=3,
                            num_key_value_heads=1, num_hidden_layers=3, latent_channel=16, latent_patch_size=2,
                            patch_latent_dim=64, rope_axes_dim=[2, 1, 1], rope_theta=5000.0,
                            unified_3d_mrope_temporal_modality_margin=25, enable_fps_modulation=False,
                            unified_3d_mrope_reset_spatial_ids=False, hidden_act="relu2", qk_norm_for_text=False,
                            use_und_k_norm_for_gen=True),
        "vae": dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                    temperal_downsample=[False, True, True]),
        "sound": None,
        "scheduler": dict(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0),
        "pipeline": dict(use_native_flow_schedule=True),
    },
}

TINY_DEFAULTS: dict[str, Any] = {"steps": 3, "num_frames": 5, "height": 32, "width": 48}


def build_tokenizer(path: Path, vocab_size: int = 320) -> Any:
    """Train a byte-level BPE chat tokenizer on the built-in corpus and load it (transformers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "bos_token": None, "unk_token": None, "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
           "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|vision_start|>"]}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def build_pipeline(variant: str = "qwen", seed: int = 0, tokenizer_dir: Path | None = None) -> Any:
    """diffusers' ``Cosmos3OmniPipeline`` over random tiny components (safety checker off)."""
    import tempfile

    from diffusers import (
        AutoencoderKLWan,
        Cosmos3AVAEAudioTokenizer,
        Cosmos3OmniPipeline,
        Cosmos3OmniTransformer,
        UniPCMultistepScheduler,
    )

    c = variant_config(CONFIGS, variant)
    tok_dir = tokenizer_dir or Path(tempfile.mkdtemp(prefix="cosmos3-tok-"))
    tokenizer = build_tokenizer(tok_dir)
    torch.manual_seed(seed)
    tf = Cosmos3OmniTransformer(vocab_size=len(tokenizer), **c["transformer"]).eval()
    with torch.no_grad():  # the zero-initialised modality embeddings made visible
        for name in ("audio_modality_embed", "action_modality_embed"):
            if hasattr(tf, name):
                getattr(tf, name).normal_(0.0, 0.5)
    z = c["vae"]["z_dim"]
    gen = torch.Generator().manual_seed(seed + 1)
    mean = (torch.rand(z, generator=gen) * 0.2 - 0.1).tolist()
    std = (torch.rand(z, generator=gen) * 0.5 + 0.75).tolist()
    vae = AutoencoderKLWan(**c["vae"], latents_mean=mean, latents_std=std).eval()
    sound = Cosmos3AVAEAudioTokenizer(**c["sound"]).eval() if c["sound"] is not None else None
    scheduler = UniPCMultistepScheduler(**c["scheduler"])
    return Cosmos3OmniPipeline(transformer=tf, text_tokenizer=tokenizer, vae=vae, scheduler=scheduler,
                               sound_tokenizer=sound, safety_checker=None, enable_safety_checker=False,
                               **c["pipeline"])


def build_tiny_checkpoint(path: str | Path, *, variant: str = "qwen", seed: int = 0) -> Path:
    """Write a tiny ``Cosmos3OmniPipeline`` folder (diffusers' ``save_pretrained``) plus ``omniloop.json``."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    pipe = build_pipeline(variant, seed, tokenizer_dir=out / "text_tokenizer")
    pipe.save_pretrained(str(out), safe_serialization=True)
    write_omniloop_json(out, variant, TINY_DEFAULTS)
    return out


main = tiny_command(build_tiny_checkpoint, module="omniloop_cosmos3.tiny", what="Cosmos 3 omni",
                    doc=__doc__ or "", variants=VARIANTS, default="qwen")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

__all__ = ["CONFIGS", "TINY_DEFAULTS", "VARIANTS", "build_pipeline", "build_tiny_checkpoint", "build_tokenizer"]
