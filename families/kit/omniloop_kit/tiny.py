"""Tiny-checkpoint builders the families share (their tests build same-architecture checkpoints of
a few hundred kilobytes; nothing is downloaded)."""

from __future__ import annotations

import argparse
import json
import string
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

_T = TypeVar("_T")

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


def t5_encoder_config(vocab_size: int, d_model: int, *, d_kv: int, d_ff: int, max_distance: int,
                      pad_token_id: int = 0, eos_token_id: int = 1, **extra: Any) -> dict[str, Any]:
    """A tiny T5 / UMT5 text encoder's config keywords: 2 layers of 4 heads, 8 relative-attention
    buckets up to ``max_distance``, gated GELU, no dropout, decoding starting at the pad token;
    ``extra`` adds keys (e.g. ``use_cache=False``)."""
    return dict(vocab_size=vocab_size, d_model=d_model, d_kv=d_kv, d_ff=d_ff, num_layers=2, num_heads=4,
                relative_attention_num_buckets=8, relative_attention_max_distance=max_distance, dropout_rate=0.0,
                feed_forward_proj="gated-gelu", pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                decoder_start_token_id=pad_token_id, **extra)


def write_omniloop_json(out: Path, variant: str, defaults: dict[str, Any], **extra: Any) -> None:
    """A tiny checkpoint's ``omniloop.json``: its variant name and the defaults a request gets."""
    (out / "omniloop.json").write_text(json.dumps({"variant": variant, "defaults": defaults, **extra}, indent=2))


def write_model_index(out: Path, pipeline: str, components: dict[str, Any], **extra: Any) -> None:
    """A diffusers ``model_index.json``: the pipeline class, diffusers' version, each component as
    ``[library, class]`` (``[None, None]``: declared absent) and ``extra`` keys (``boundary_ratio``)."""
    import diffusers

    index = {"_class_name": pipeline, "_diffusers_version": diffusers.__version__, **components, **extra}
    (out / "model_index.json").write_text(json.dumps(index, indent=2))


def write_scheduler(out: Path, class_name: str, config: dict[str, Any]) -> None:
    """``scheduler/scheduler_config.json`` of the diffusers scheduler ``class_name``."""
    import diffusers

    (out / "scheduler").mkdir(parents=True, exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": class_name, "_diffusers_version": diffusers.__version__, **config}, indent=2))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP's reversible byte → printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def clip_bpe_tokenizer(out: Path, words: Sequence[str], max_length: int = 77) -> int:
    """Write a CLIP byte-level BPE tokenizer (every byte, ``words`` whole: each merged left to
    right, ``"f o" -> "fo"``, ``"fo x</w>" -> "fox</w>"``) with transformers' ``CLIPTokenizer``;
    returns its vocabulary size."""
    from transformers import CLIPTokenizer

    chars = list(bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    for c in chars:
        vocab.setdefault(c + "</w>", len(vocab))
    merges: list[tuple[str, str]] = []
    for w in words:
        parts = [*w[:-1], w[-1] + "</w>"]
        while len(parts) > 1:
            a, b = parts[0], parts[1]
            if (a, b) not in merges:
                merges.append((a, b))
            vocab.setdefault(a + b, len(vocab))
            parts = [a + b, *parts[2:]]
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab.setdefault(special, len(vocab))
    CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length).save_pretrained(str(out))
    return len(vocab)


def variant_config(configs: Mapping[str, _T], variant: str) -> _T:
    """``configs[variant]``, or a ValueError naming the known variants."""
    if variant not in configs:
        raise ValueError(f"unknown variant {variant!r} (one of {', '.join(configs)})")
    return configs[variant]


def tiny_main(argv: list[str] | None, build: Callable[..., Path], *, module: str, what: str, doc: str,
              variants: Sequence[str], default: str, options: Sequence[tuple[str, dict[str, Any]]] = (),
              convert: Callable[[argparse.Namespace], dict[str, Any]] | None = None, choice: str = "variant") -> int:
    """``python -m <module> OUT_DIR --variant V --seed N`` (plus the family's ``options``, mapped to
    ``build``'s keywords by ``convert``): build a tiny checkpoint and say where and how large.
    ``choice`` names the option that picks among ``variants`` (and ``build``'s keyword for it),
    e.g. ``arch``."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(f"--{choice}", choices=tuple(variants), default=default)
    parser.add_argument("--seed", type=int, default=0)
    for flag, kw in options:
        parser.add_argument(flag, **kw)
    args = parser.parse_args(argv)
    picked = getattr(args, choice)
    path = build(args.out_dir, **{choice: picked}, seed=args.seed, **(convert(args) if convert else {}))
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"wrote tiny {what} checkpoint ({picked}, {size / 1024:.0f} KB) to {path}")
    return 0


def tiny_command(build: Callable[..., Path], **options: Any) -> Callable[[list[str] | None], int]:
    """A family tiny module's ``main(argv=None)``: :func:`tiny_main` over ``build`` with
    ``options`` (``module``, ``what``, ``doc``, ``variants``, ``default``, ...)."""

    def main(argv: list[str] | None = None) -> int:
        return tiny_main(argv, build, **options)

    return main


__all__ = ["T5_CONFIG", "bytes_to_unicode", "clip_bpe_tokenizer", "t5_encoder_config", "t5_unigram_tokenizer", "tiny_command", "tiny_main", "variant_config",
           "write_model_index", "write_omniloop_json", "write_scheduler"]
