"""Tiny-checkpoint builders the families share (their tests build same-architecture checkpoints of
a few hundred kilobytes; nothing is downloaded)."""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: the ``tokenizer_config.json`` of a T5 tokenizer (``model_max_length`` 512)
T5_CONFIG: dict[str, Any] = {
    "tokenizer_class": "T5Tokenizer",
    "model_max_length": 512,
    "pad_token": "<pad>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "extra_ids": 0,
    "additional_special_tokens": [],
}


def t5_unigram_tokenizer(out: Path, words: Sequence[str], *, pair: bool = False) -> int:
    """Write a T5-style Unigram tokenizer (``... </s>``, ``<pad>``; ``words`` whole, every letter,
    digit and punctuation mark as a fallback) as ``tokenizer.json`` + ``tokenizer_config.json``;
    ``pair``: a template for sentence pairs too. Returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -3.0) for w in words]
    letters = string.ascii_letters + string.digits
    vocab += [("\u2581" + c, -8.0) for c in letters]
    vocab += [(c, -9.0) for c in letters + string.punctuation]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    template = {"pair": "$A </s> $B </s>"} if pair else {}
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)], **template)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(T5_CONFIG, indent=2))
    return len(vocab)


def write_omniloop_json(out: Path, variant: str, defaults: dict[str, Any], **extra: Any) -> None:
    """A tiny checkpoint's ``omniloop.json``: its variant name and the defaults a request gets."""
    (out / "omniloop.json").write_text(json.dumps({"variant": variant, "defaults": defaults, **extra}, indent=2))


__all__ = ["T5_CONFIG", "t5_unigram_tokenizer", "write_omniloop_json"]
