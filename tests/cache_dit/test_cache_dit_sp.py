"""The cache decision reduces over the pool's sequence-parallel group, not WORLD (gloo on CPU,
3 processes; see omniloop.testing.sequence_parallel for the set-up)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniloop.testing import sequence_parallel
from omniloop_cache_dit import CacheDiTInterceptor

SETTINGS = {"Fn": 1, "Bn": 1, "residual_diff_threshold": 0.1, "max_warmup_steps": 3}

pytestmark = pytest.mark.skipif(bool(sequence_parallel.available()), reason=str(sequence_parallel.available()))


def test_sp_ranks_decide_as_one_unsharded_run(tmp_path: Path) -> None:
    sequence_parallel.check_sequence_parallel(lambda: CacheDiTInterceptor(SETTINGS), tmp_path)
