"""Shared fixtures for the attention backend tests."""

from __future__ import annotations

import pytest

from omniloop.testing import torch_threads


@pytest.fixture
def one_thread():
    """torch on one thread for the test (flex_attention's eager CPU path), restored afterwards."""
    with torch_threads(1):
        yield
