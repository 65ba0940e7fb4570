"""tests/quant: every test runs torch on one thread (CI has 2 cores; the FP8 GEMMs on the CPU are
slow and gain nothing from threads that other test files would then contend for)."""

from __future__ import annotations

import pytest

from omniloop.testing import torch_threads


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield
