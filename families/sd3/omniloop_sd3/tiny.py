"""Tiny Stable Diffusion 3 / 3.5 checkpoints: same architecture, toy sizes, random weights.

Used by the tests (and by anyone who wants the whole code path without downloading weights)::

    python -m omniloop_sd3.tiny OUT_DIR --variant sd35-medium

Variants (the transformer's architecture switches):

* ``sd3``         — SD3-medium: joint blocks, no q/k norm, no dual attention
* ``sd35``        — SD3.5-large: joint blocks with RMS q/k norm
* ``sd35-medium`` — SD3.5-medium: RMS q/k norm and dual-attention (``attn2``) layers

Every component is written in diffusers format (``save_pretrained``): ``SD3Transformer2DModel``,
``AutoencoderKL`` (16 latent channels, SD3's shift/scaling factors), ``CLIPTextModelWithProjection``
twice (CLIP-L and CLIP-G stand-ins), ``T5EncoderModel`` and a ``FlowMatchEulerDiscreteScheduler``
config with ``shift=3.0``. The tokenizers are ``tokenizer.json`` files built here with the
``tokenizers`` library (nothing is downloaded): the two CLIP tokenizers are declared in
``model_index.json`` as the generic ``PreTrainedTokenizerFast`` (word-level vocabulary, CLIP's
start/end tokens, padded with the end token like CLIP-L or with ``!`` like CLIP-G), the T5 one as
``T5TokenizerFast`` (a small Unigram vocabulary). Defaults: 32x32 images (``sample_size`` 4 at
VAE scale 8), and an ``omniloop.json`` with a 2-step default so a default request is instant.
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path
from typing import Any

import torch

from omniloop_kit.tiny import (
    t5_unigram_tokenizer,
    tiny_command,
    write_model_index,
    write_omniloop_json,
    write_scheduler,
)

VARIANTS = ("sd3", "sd35", "sd35-medium")

_WORDS = (
    "a an the of in on at with and or to from over under fox cat dog bird fish horse "
    "runs jumps flies swims walks sits red blue green yellow black white small big lazy quick "
    "photo painting scene forest city river sky sea snow night day light dark portrait "
    "beautiful ugly blurry low quality worst watermark text"
).split()

CLIP_MAX_LENGTH = 77

#: written to ``omniloop.json``: a tiny default step count (sizes come from the model config)
TINY_DEFAULTS: dict[str, Any] = {"steps": 2}


def _clip_tokenizer(out: Path, pad: str) -> int:
    """A word-level CLIP-like tokenizer (``<|startoftext|> ... <|endoftext|>``); returns its vocab size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    specials = ["!", "<unk>", "<|startoftext|>", "<|endoftext|>"]  # end token id 3 (2 would be CLIP's legacy argmax)
    vocab = {t: i for i, t in enumerate(specials)}
    for w in _WORDS + list(string.ascii_lowercase + string.digits):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        special_tokens=[("<|startoftext|>", 2), ("<|endoftext|>", 3)],
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": CLIP_MAX_LENGTH,
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "pad_token": pad,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return len(vocab)


def _t5_tokenizer(out: Path) -> int:
    """A T5-style Unigram tokenizer (``... </s>``, padded with ``<pad>``); returns its vocab size."""
    return t5_unigram_tokenizer(out, _WORDS)


def transformer_kwargs(variant: str) -> dict[str, Any]:
    """The tiny ``SD3Transformer2DModel`` arguments of ``variant``."""
    kw: dict[str, Any] = dict(
        sample_size=4, patch_size=2, in_channels=16, out_channels=16, num_layers=3, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=40, caption_projection_dim=16, pooled_projection_dim=32,
        pos_embed_max_size=16,
    )
    if variant in ("sd35", "sd35-medium"):
        kw["qk_norm"] = "rms_norm"
    if variant == "sd35-medium":
        kw["dual_attention_layers"] = (0, 1)
    return kw


def build_tiny_checkpoint(path: str | Path, variant: str = "sd35-medium", seed: int = 0, t5: bool = True) -> Path:
    """Write a tiny SD3 checkpoint of ``variant`` to ``path`` and return the path.

    ``t5=False`` declares ``text_encoder_3``/``tokenizer_3`` as ``[null, null]`` (SD3 without T5:
    the T5 part of the context is zeros). Deterministic in ``seed``; the global RNG is untouched.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, not {variant!r}")
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    n_clip = _clip_tokenizer(out / "tokenizer", pad="<|endoftext|>")
    n_clip2 = _clip_tokenizer(out / "tokenizer_2", pad="!")
    n_t5 = _t5_tokenizer(out / "tokenizer_3") if t5 else 0
    tf_kw = transformer_kwargs(variant)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, vocab in (("text_encoder", n_clip), ("text_encoder_2", n_clip2)):
            cfg = CLIPTextConfig(
                vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=CLIP_MAX_LENGTH, projection_dim=16, hidden_act="gelu",
                bos_token_id=2, eos_token_id=3, pad_token_id=3 if name == "text_encoder" else 0,
            )
            CLIPTextModelWithProjection(cfg).eval().save_pretrained(out / name)
        if t5:
            t5_cfg = T5Config(
                vocab_size=n_t5, d_model=tf_kw["joint_attention_dim"], d_kv=8, d_ff=48, num_layers=2, num_heads=2,
                relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
                feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
            )
            T5EncoderModel(t5_cfg).eval().save_pretrained(out / "text_encoder_3")
        AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 8, 8, 8),
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1, norm_num_groups=4, sample_size=32, scaling_factor=1.5305, shift_factor=0.0609,
            use_quant_conv=False, use_post_quant_conv=False,
        ).eval().save_pretrained(out / "vae")
        SD3Transformer2DModel(**tf_kw).eval().save_pretrained(out / "transformer")

    write_scheduler(out, "FlowMatchEulerDiscreteScheduler", {"num_train_timesteps": 1000, "shift": 3.0})
    write_model_index(out, "StableDiffusion3Pipeline", {
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_3": ["transformers", "T5EncoderModel"] if t5 else [None, None],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "tokenizer_2": ["transformers", "PreTrainedTokenizerFast"],
        "tokenizer_3": ["transformers", "T5TokenizerFast"] if t5 else [None, None],
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "image_encoder": [None, None],
        "feature_extractor": [None, None],
    })
    write_omniloop_json(out, f"tiny-{variant}", TINY_DEFAULTS)
    return out


main = tiny_command(build_tiny_checkpoint, module="omniloop_sd3.tiny", what="SD3", doc=__doc__ or "",
                    variants=VARIANTS, default="sd35-medium",
                    options=[("--no-t5", {"action": "store_true", "help": "declare no T5 encoder (its context part is zeros)"})],
                    convert=lambda args: {"t5": not args.no_t5})


if __name__ == "__main__":
    sys.exit(main())
