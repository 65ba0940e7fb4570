"""Block-interceptor test harness: the toy block stack lives in ``omniloop.testing.blocks``
(shared with every interceptor package's tests); this file only exposes it as the ``toy`` fixture."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest
import torch

from omniloop.testing.blocks import DIM, TOKENS, ToyModel, ToyRun, blocks_namespace, interleave, run_alone

__all__ = ["DIM", "TOKENS", "ToyModel", "ToyRun", "interleave", "run_alone"]


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    """These tensors are tiny: one thread is fastest, and does not spin on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def toy() -> types.SimpleNamespace:
    return blocks_namespace()
