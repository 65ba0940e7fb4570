"""The text-embedding cache: omniloop-kit's :mod:`omniloop_kit.textcache` (the names this module had)."""

from omniloop_kit.textcache import DEFAULT_ENTRIES, TextEmbeddingCache, capacity_from_options

__all__ = ["DEFAULT_ENTRIES", "TextEmbeddingCache", "capacity_from_options"]
