"""A tiny checkpoint of the minimal family (a few hundred kilobytes, random weights):
``python -m omniloop_minimal.tiny OUT_DIR``. Same layout as a real diffusers pipeline folder."""

from __future__ import annotations

import sys
from pathlib import Path

from omniloop_kit.tiny import t5_unigram_tokenizer, tiny_main, write_model_index, write_omniloop_json, write_scheduler

WORDS = ("a", "red", "fox", "cat", "in", "the", "snow", "photo", "of")
DEFAULTS = {"steps": 4, "guidance_scale": 3.0, "height": 32, "width": 32, "max_sequence_length": 16,
            "negative_prompt": ""}


def build_tiny_checkpoint(out: str | Path, *, variant: str = "t2i", seed: int = 0) -> Path:
    import torch
    from diffusers import AutoencoderKL, SanaTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    vocab = t5_unigram_tokenizer(out / "tokenizer", WORDS)
    T5EncoderModel(T5Config(vocab_size=vocab, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                            decoder_start_token_id=0)).save_pretrained(out / "text_encoder")
    SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                           num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
                           caption_channels=16, mlp_ratio=2.0, sample_size=16).save_pretrained(out / "transformer")
    AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                  block_out_channels=(8, 16), latent_channels=4, norm_num_groups=8, sample_size=32,
                  shift_factor=0.0, scaling_factor=1.0).save_pretrained(out / "vae")
    write_scheduler(out, "FlowMatchEulerDiscreteScheduler", {"num_train_timesteps": 1000, "shift": 1.0})
    write_model_index(out, "MinimalPipeline", {
        "transformer": ["diffusers", "SanaTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "T5TokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]})
    write_omniloop_json(out, variant, DEFAULTS)
    return out


def main(argv: list[str] | None = None) -> int:
    return tiny_main(argv, build_tiny_checkpoint, module="omniloop_minimal.tiny", what="minimal", doc=__doc__ or "",
                     variants=("t2i",), default="t2i")


__all__ = ["build_tiny_checkpoint", "main"]

if __name__ == "__main__":
    sys.exit(main())
