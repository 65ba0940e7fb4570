"""The tone-demo model: configs and builders of each component of the diffusers
``StableAudioPipeline`` folder (word-level tokenizer, tiny T5 encoder, projection model,
``StableAudioDiTModel``, ``AutoencoderOobleck``, ``CosineDPMSolverMultistepScheduler``).

Choices: mono 8 kHz clips of 16 384 samples (2.048 s); the VAE downsamples 64x into 16 latent
channels (256 latent frames, so the DiT sees 256 + 1 tokens); the DiT has 6 layers of width 128.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omniloop_tone_demo.grammar import CLIP_SAMPLES, SAMPLE_RATE, WORDS

SPECIAL = ["<pad>", "</s>", "<unk>"]
VOCAB: list[str] = SPECIAL + list(WORDS)
MAX_TOKENS = 16

VAE_CONFIG: dict[str, Any] = {
    "encoder_hidden_size": 32,  # the encoder's last conv: 16 mean + 16 scale channels
    "downsampling_ratios": [2, 4, 8],
    "channel_multiples": [1, 2, 4],
    "decoder_channels": 32,
    "decoder_input_channels": 16,
    "audio_channels": 1,
    "sampling_rate": SAMPLE_RATE,
}
HOP = 2 * 4 * 8
LATENT_CHANNELS = 16
LATENT_FRAMES = CLIP_SAMPLES // HOP

TEXT_ENCODER_CONFIG: dict[str, Any] = {
    "vocab_size": len(VOCAB), "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4,
    "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16, "dropout_rate": 0.0,
    "feed_forward_proj": "relu", "is_encoder_decoder": False, "use_cache": False,
    "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
}
PROJECTION_CONFIG: dict[str, Any] = {"text_encoder_dim": 64, "conditioning_dim": 64, "min_value": 0, "max_value": 4}
TRANSFORMER_CONFIG: dict[str, Any] = {
    "sample_size": LATENT_FRAMES, "in_channels": LATENT_CHANNELS, "out_channels": LATENT_CHANNELS,
    "num_layers": 6, "attention_head_dim": 32, "num_attention_heads": 4, "num_key_value_attention_heads": 2,
    "cross_attention_dim": 128, "time_proj_dim": 64, "global_states_input_dim": 128, "cross_attention_input_dim": 64,
}
#: a toy size of every part for the CPU smoke test (same code paths)
TOY = {
    "vae": {**VAE_CONFIG, "encoder_hidden_size": 8, "decoder_channels": 8, "decoder_input_channels": 4},
    "text_encoder": {**TEXT_ENCODER_CONFIG, "d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2},
    "projection": {**PROJECTION_CONFIG, "text_encoder_dim": 16, "conditioning_dim": 16},
    "transformer": {**TRANSFORMER_CONFIG, "in_channels": 4, "out_channels": 4, "num_layers": 1, "attention_head_dim": 8,
                    "num_attention_heads": 2, "num_key_value_attention_heads": 1, "cross_attention_dim": 16,
                    "time_proj_dim": 16, "global_states_input_dim": 32, "cross_attention_input_dim": 16},
}
FULL = {"vae": VAE_CONFIG, "text_encoder": TEXT_ENCODER_CONFIG, "projection": PROJECTION_CONFIG,
        "transformer": TRANSFORMER_CONFIG}


def build_tokenizer(save_dir: str | Path | None = None):
    """A word-level tokenizer over :data:`VOCAB` (lower-cased, whitespace split, ``</s>``
    appended, padded to :data:`MAX_TOKENS`), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=MAX_TOKENS, padding_side="right")
    if save_dir is not None:
        fast.save_pretrained(str(save_dir))
        cfg_file = Path(save_dir) / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 4 and 5 both load it
        cfg_file.write_text(json.dumps(cfg, indent=2))
    return fast


def build_parts(configs: dict[str, dict[str, Any]] | None = None, seed: int = 0) -> dict[str, Any]:
    """Fresh (randomly initialised) components, keyed as ``StableAudioPipeline``'s arguments."""
    from diffusers import AutoencoderOobleck, CosineDPMSolverMultistepScheduler, StableAudioDiTModel
    from diffusers.pipelines.stable_audio.modeling_stable_audio import StableAudioProjectionModel
    from transformers import T5Config, T5EncoderModel

    c = configs or FULL
    torch.manual_seed(seed)
    return {
        "vae": AutoencoderOobleck(**c["vae"]),
        "text_encoder": T5EncoderModel(T5Config(**c["text_encoder"])),
        "projection_model": StableAudioProjectionModel(**c["projection"]),
        "tokenizer": build_tokenizer(),
        "transformer": StableAudioDiTModel(**c["transformer"]),
        "scheduler": CosineDPMSolverMultistepScheduler(),
    }


def load_parts(folder: str | Path) -> dict[str, Any]:
    """The components of a saved tone-demo checkpoint (float32; a compact linear VAE rebuilt), keyed
    as :func:`build_parts`'s."""
    from diffusers import AutoencoderOobleck, CosineDPMSolverMultistepScheduler, StableAudioDiTModel
    from diffusers.pipelines.stable_audio.modeling_stable_audio import StableAudioProjectionModel
    from transformers import T5EncoderModel

    from omniloop_tone_demo import linear_vae

    root = Path(folder)
    f32 = torch.float32
    vae = (linear_vae.load_compact(root / "vae") if (root / "vae" / linear_vae.COMPACT_FILE).exists()
           else AutoencoderOobleck.from_pretrained(str(root / "vae"), torch_dtype=f32))
    return {
        "vae": vae,
        "text_encoder": T5EncoderModel.from_pretrained(str(root / "text_encoder"), dtype=f32),
        "projection_model": StableAudioProjectionModel.from_pretrained(str(root / "projection_model"), torch_dtype=f32),
        "tokenizer": build_tokenizer(),
        "transformer": StableAudioDiTModel.from_pretrained(str(root / "transformer"), torch_dtype=f32),
        "scheduler": CosineDPMSolverMultistepScheduler.from_pretrained(str(root / "scheduler")),
    }


def assemble(parts: dict[str, Any]):
    from diffusers import StableAudioPipeline

    return StableAudioPipeline(**parts)


def save(pipe, out_dir: str | Path, meta: dict[str, Any] | None = None, *, store: torch.dtype = torch.float32,
         compact_vae: bool = False) -> Path:
    """Write the diffusers folder (safetensors; the transformer's, projection model's and text
    encoder's weights in ``store``, their configs still loading as float32), the tokenizer in the
    portable form and ``omniloop.json`` (``meta``). ``compact_vae``: a linear VAE is written as its
    two projections (``vae/linear_oobleck.safetensors``, :mod:`omniloop_tone_demo.linear_vae`);
    the package builds the full ``AutoencoderOobleck`` weights from them when it is first used."""
    out = Path(out_dir)
    pipe.save_pretrained(str(out), safe_serialization=True)
    build_tokenizer(out / "tokenizer")
    index = json.loads((out / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "PreTrainedTokenizerFast"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if store != torch.float32:
        for name in ("transformer", "projection_model", "text_encoder"):
            store_weights(out / name, store)
    if compact_vae:
        from omniloop_tone_demo import linear_vae

        (out / "vae" / linear_vae.WEIGHTS_FILE).unlink()
        linear_vae.save_compact(pipe.vae, out / "vae")
    if meta is not None:
        (out / "omniloop.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


def store_weights(folder: Path, dtype: torch.dtype) -> None:
    """Rewrite ``folder``'s safetensors with floating tensors in ``dtype``; a transformers config
    keeps saying float32 (transformers 5 loads a checkpoint in its config's dtype by default;
    diffusers loads float32 unless told otherwise)."""
    from safetensors.torch import load_file, save_file

    for f in sorted(folder.glob("*.safetensors")):
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in load_file(str(f)).items()}
        save_file(tensors, str(f), metadata={"format": "pt"})
    cfg_file = folder / "config.json"
    cfg = json.loads(cfg_file.read_text())
    if "_class_name" not in cfg:  # a transformers config
        for key in ("dtype", "torch_dtype"):
            if key in cfg or key == "dtype":
                cfg[key] = "float32"
        cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
