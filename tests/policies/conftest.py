"""Fixtures for the omniloop-policies tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """The policy tests run tiny tensors, where intra-op threads only add contention on a shared
    2-core machine; restore the caller's setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
