"""A bounded LRU cache of text-encoder outputs, one per loaded model (a family's ``text_cache``
option; Wan's ``text_encode`` node uses it).

A large text encoder (UMT5-XXL over 512 tokens) is a sizeable forward; repeated prompts and the
negative prompt most requests share (often the same long "bad quality, ..." string) are encoded
once. The key is
``(sha256 of the text, encoder identity, weight version, dtype, device)``: the encoder identity
is its class and object id, the weight version ``LoadedModel.weight_version`` (a hash of the
weight files' names, sizes and modification times, taken at load), so re-loaded or changed
weights never hit stale entries.

Entries are the ``(embeddings, mask)`` tensors the ``text_encode`` node writes, kept on the
device (Wan: ``512 x text_dim`` in the transformer dtype, 4 MiB per entry for UMT5-XXL in bf16,
so the default 64 entries hold at most 256 MiB). Cached tensors are shared between requests and
must be treated as read-only, as every artifact is.

Deploy option ``options: {text_cache: N}`` (entries; ``0`` or ``false`` turns it off; default
64). Per request, ``metrics["text_cache"]`` says ``hits`` / ``misses`` of its encodes
(:func:`encode_texts`); the cache keeps running totals (:meth:`TextEmbeddingCache.stats`).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from omniloop.errors import DeployError

DEFAULT_ENTRIES = 64

Entry = tuple[torch.Tensor, torch.Tensor]


class TextEmbeddingCache:
    """LRU of ``key -> (embeddings, mask)``; thread-safe."""

    def __init__(self, capacity: int = DEFAULT_ENTRIES, weight_version: str = "") -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.weight_version = weight_version
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def key(self, text: str, encoder: Any, dtype: torch.dtype, device: torch.device) -> Hashable:
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        identity = f"{type(encoder).__module__}.{type(encoder).__qualname__}@{id(encoder):x}"
        return (digest, identity, self.weight_version, str(dtype), str(device))

    def get_or_encode(self, key: Hashable, encode: Callable[[], Entry]) -> tuple[Entry, bool]:
        """The cached entry (``True``) or ``encode()``'s result, stored (``False``)."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit, True
        value = encode()  # outside the lock: a slow encode must not block other lookups
        with self._lock:
            self.misses += 1
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
                self.evictions += 1
        return value, False

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "capacity": self.capacity, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions}


def capacity_from_options(options: dict[str, Any]) -> int:
    """``options.text_cache``: entries (int), ``true`` (the default size) or ``false``/``0`` (off)."""
    value = options.get("text_cache", DEFAULT_ENTRIES)
    if value is True:
        return DEFAULT_ENTRIES
    if value is False or value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DeployError(f"options.text_cache: expected a number of entries >= 0 or true/false, got {value!r}")
    return value


def encode_texts(cache: TextEmbeddingCache | None, texts: Sequence[str], encoder: Any, dtype: torch.dtype,
                 device: torch.device, encode: Callable[[str], Entry]) -> tuple[list[Entry], dict[str, int] | None]:
    """``encode(text)`` of each text, through ``cache`` when there is one (keyed by ``encoder``,
    ``dtype`` and ``device``); returns the entries and the request's ``metrics["text_cache"]``
    (None without a cache)."""
    if cache is None:
        return [encode(text) for text in texts], None
    out, hits = [], 0
    for text in texts:
        value, hit = cache.get_or_encode(cache.key(text, encoder, dtype, device), lambda text=text: encode(text))
        hits += hit
        out.append(value)
    return out, {"hits": hits, "misses": len(texts) - hits, "entries": len(cache)}


__all__ = ["DEFAULT_ENTRIES", "TextEmbeddingCache", "capacity_from_options", "encode_texts"]
