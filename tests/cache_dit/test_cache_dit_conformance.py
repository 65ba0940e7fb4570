"""The block-interceptor conformance kit (omniloop.testing.conformance), when the core ships it.

Until then the same contract is checked by test_cache_dit_toy.py (baseline / enabled /
disabled-after-enabled, interleaving, per-branch state, close) and test_cache_dit_runtime.py.
"""

from __future__ import annotations

import pytest

from omniloop_cache_dit import CacheDiTInterceptor

conformance = pytest.importorskip("omniloop.testing.conformance")


def test_passes_the_block_interceptor_conformance_kit() -> None:
    conformance.check_block_interceptor(
        lambda: CacheDiTInterceptor({"Fn": 1, "Bn": 1, "residual_diff_threshold": 0.2, "max_warmup_steps": 2})
    )
