"""Shared fixtures for the attention backend tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """torch on one thread for the test (flex_attention's eager CPU path), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
