"""omniloop's Qwen family: Qwen2 / Qwen2.5 / Qwen3 causal LMs through the loop contract.

One ``step()`` of the ``decode`` node is one prefill chunk or one new token; the step scheduler
co-batches the decode steps of every running sequence (continuous batching). Attention reads the
KV of each sequence from an :class:`omniloop_kvcache.CacheManager` through its block table.
"""

from __future__ import annotations

__all__ = ["FAMILY_NAME"]

FAMILY_NAME = "qwen"
