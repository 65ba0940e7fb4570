"""A checkpoint's declared vocabulary: ``omniloop generate`` warns once when a prompt uses words
the model never saw.

Any checkpoint may declare the words its prompts were made of in its ``omniloop.json``::

    {"vocabulary": ["a", "blue", "circle", "moving", "right", ...]}

(the demo models do: ``omniloop_wan_demo.prompts.vocabulary_words``). The prompt's lower-cased
words (runs of letters and digits; punctuation is ignored) are compared against it; words outside
it give ONE warning line on stderr before the model loads. A checkpoint without the key is not
checked. This is advice, never a refusal: the request runs as given.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

_WORD = re.compile(r"[^\W_]+")
#: at most this many unknown words are named in the warning
SHOWN = 5


def prompt_words(prompt: str) -> list[str]:
    """Lower-cased words of ``prompt`` in order, each once."""
    return list(dict.fromkeys(_WORD.findall(prompt.lower())))


def declared_vocabulary(model_path: Path | str | None) -> tuple[frozenset[str] | None, str | None]:
    """``(words, problem)`` from ``model_path/omniloop.json``'s ``vocabulary``: ``(None, None)``
    when nothing is declared; ``(None, why)`` when the key is malformed."""
    if model_path is None:
        return None, None
    f = Path(model_path) / "omniloop.json"
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, None  # no omniloop.json (or the family reports a bad one when it loads)
    if not isinstance(meta, dict) or "vocabulary" not in meta:
        return None, None
    vocab = meta["vocabulary"]
    if not isinstance(vocab, list) or not vocab or not all(isinstance(w, str) and w for w in vocab):
        return None, "omniloop.json vocabulary: expected a non-empty list of words; the prompt is not checked"
    return frozenset(w.lower() for w in vocab), None


def unknown_words(prompt: str, vocabulary: frozenset[str] | set[str]) -> list[str]:
    """The prompt's words outside ``vocabulary`` (lower-cased, in order, each once)."""
    return [w for w in prompt_words(prompt) if w not in vocabulary]


def vocabulary_warning(model_path: Path | str | None, prompt: str, model_name: str) -> str | None:
    """The one-line warning for ``prompt`` against the checkpoint's vocabulary (``None``: nothing to say)."""
    vocab, problem = declared_vocabulary(model_path)
    if problem:
        return f"{model_name}: {problem}"
    if vocab is None:
        return None
    unknown = unknown_words(prompt, vocab)
    if not unknown:
        return None
    named = ", ".join(repr(w) for w in unknown[:SHOWN]) + (f" and {len(unknown) - SHOWN} more" if len(unknown) > SHOWN else "")
    return (f"{model_name} never saw {named} in training (its vocabulary: {len(vocab)} words, "
            f"in omniloop.json); the output will likely ignore {'it' if len(unknown) == 1 else 'them'}")


def warn_vocabulary(console: Any, model_path: Path | str | None, prompt: str, model_name: str) -> None:
    """Print :func:`vocabulary_warning` (if any) as one ``warning:`` line on ``console`` (stderr)."""
    from rich.markup import escape

    msg = vocabulary_warning(model_path, prompt, model_name)
    if msg:
        console.print(f"[yellow]warning:[/] {escape(msg)}", highlight=False, soft_wrap=True)
