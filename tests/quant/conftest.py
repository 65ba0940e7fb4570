"""tests/quant: every test runs torch on one thread (CI has 2 cores; the FP8 GEMMs on the CPU are
slow and gain nothing from threads that other test files would then contend for)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
