"""Tiny Qwen checkpoints: the real architectures at toy sizes, random weights, transformers format.

Used by the tests and the CPU bench; no download::

    python -m omniloop_qwen.tiny OUT_DIR --arch qwen3

Writes ``config.json`` + ``model.safetensors`` (``save_pretrained``), ``generation_config.json``,
and a byte-level BPE ``tokenizer.json`` trained here with the ``tokenizers`` library on a small
built-in corpus, with ``tokenizer_config.json`` carrying a Qwen-style (ChatML) chat template and
the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``.

* ``qwen2`` — Qwen2/Qwen2.5 layout: q/k/v biases, tied embeddings, GQA (4 query / 2 KV heads)
* ``qwen3`` — Qwen3 layout: q/k RMS norms on the head dim, explicit ``head_dim``, untied head, GQA
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from omniloop_kit.tiny import tiny_command

ARCHES = ("qwen2", "qwen3")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: ChatML, the template Qwen's instruct checkpoints ship (system / user / assistant turns)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = (
    "the quick brown fox jumps over the lazy dog. a red circle moves up, a blue square moves right. "
    "write a short story about a cat who sails across the sea at night under the bright stars. "
    "expand this prompt into a detailed video description with camera motion, light and colour. "
    "hello world! how are you today? i am fine, thank you. the answer is 42 and the sky is blue. "
    "system: you are a helpful assistant. user: describe a forest river in the morning mist. "
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 — café, naïve, über, 東京, 🙂."
)

#: the Qwen2.5-0.5B architecture (random weights are built from it by the GPU bench)
QWEN25_05B = {
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}


def build_tokenizer(path: Path, vocab_size: int = 384) -> Any:
    """Train a byte-level BPE tokenizer on the built-in corpus and write the tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "unk_token": None, "chat_template": CHAT_TEMPLATE, "model_max_length": 2048,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return tok


def tiny_config(arch: str, vocab_size: int, **overrides: Any) -> Any:
    """The transformers config of a tiny ``arch`` model."""
    from transformers import Qwen2Config, Qwen3Config

    common: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "initializer_range": 0.2, "bos_token_id": None,
    }
    if arch == "qwen2":
        cfg: Any = Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
    elif arch == "qwen3":
        cfg = Qwen3Config(**{**common, "head_dim": 16, "tie_word_embeddings": False, **overrides})
    else:
        raise ValueError(f"arch: expected one of {', '.join(ARCHES)}, got {arch!r}")
    return cfg


def build_tiny_checkpoint(path: str | Path, *, arch: str = "qwen2", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random ``arch`` checkpoint (weights, config, tokenizer, generation config) to ``path``."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    vocab = int(overrides.pop("vocab_size", tok.get_vocab_size()))  # a larger model vocab (the bench's presets) is fine
    if vocab < tok.get_vocab_size():
        raise ValueError(f"vocab_size: at least the tokenizer's {tok.get_vocab_size()} tokens, got {vocab}")
    endoftext, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    cfg = tiny_config(arch, vocab, eos_token_id=im_end, pad_token_id=endoftext, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path)  # config.json + model.safetensors (+ a generation_config.json we replace)
    gen = {"eos_token_id": [im_end, endoftext], "pad_token_id": endoftext, "max_new_tokens": 64}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=1))
    return path


main = tiny_command(build_tiny_checkpoint, module="omniloop_qwen.tiny", what="Qwen", doc=__doc__ or "",
                    variants=ARCHES, default="qwen2", choice="arch")


if __name__ == "__main__":
    sys.exit(main())
