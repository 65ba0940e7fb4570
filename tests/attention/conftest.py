"""Shared fixtures for the attention backend tests."""

from __future__ import annotations

import pytest

from omniloop.testing import torch_threads


@pytest.fixture
def one_thread():
    """torch on one thread for the test (flex_attention's eager CPU path), restored afterwards."""
    with torch_threads(1):
        yield


def _cuda_views(B, H, L, D, seed):
    """bf16 ``[B, H, L, D]`` views of a random ``[B, L, H, D]`` CUDA tensor (how the Wan blocks hand q/k/v over)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)


@pytest.fixture
def cuda_views():
    return _cuda_views


def _rel_to_float32(fn, q, k, v):
    """``fn(q, k, v)``'s relative RMS difference from float32 SDPA, after checking its shape and bf16 dtype."""
    import torch
    import torch.nn.functional as F

    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    out = fn(q, k, v)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    return float((out.float() - ref).norm() / ref.norm())


@pytest.fixture
def rel_to_float32():
    return _rel_to_float32


def _compiled_equals_eager(fn, emulate_precision_casts: bool = False):
    """``torch.compile(fullgraph=True)`` of a small graph around ``fn`` equals it run eagerly.

    ``emulate_precision_casts``: for a backend whose quantisation is traced (``fa3-fp8``), inductor
    fuses the ``q * 1.5`` before it into the quantising kernel and by default keeps that product in
    float32 where eager rounds it to bf16 first, so a few e4m3 codes differ (seen on an H200,
    2026-12-06); with the flag inductor rounds as eager does and the outputs must be equal."""
    import torch
    import torch._inductor.config as inductor_config

    q, k, v = (_cuda_views(1, 4, 1000, 128, s) for s in range(3))

    def f(q, k, v):
        return fn(q * 1.5, k, v) + 1.0

    torch._dynamo.reset()
    with inductor_config.patch(emulate_precision_casts=emulate_precision_casts):
        compiled = torch.compile(f, fullgraph=True, dynamic=False)
        out = compiled(q, k, v)
    return torch.equal(out, f(q, k, v))


@pytest.fixture
def compiled_equals_eager():
    return _compiled_equals_eager


def _bad_call(case):
    """``(q, k, v, kw)`` of a call a kernel backend refuses before its kernel (CPU tensors): ``case`` is
    mask, float32, mixed (v in fp16), head_dim (12) or dropout."""
    import torch

    q = torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16)
    k = v = q
    kw = {}
    if case == "mask":
        kw["attn_mask"] = torch.ones(16, 16, dtype=torch.bool)
    elif case == "float32":
        q = k = v = q.float()
    elif case == "mixed":
        v = v.half()
    elif case == "head_dim":
        q = k = v = torch.zeros(1, 2, 16, 12, dtype=torch.bfloat16)
    elif case == "dropout":
        kw["dropout_p"] = 0.1
    return q, k, v, kw


@pytest.fixture
def bad_call():
    return _bad_call


def _reason_when_import_breaks(monkeypatch, found, broken, cache, available):
    """``available()`` on a faked Hopper machine where ``found`` is found by ``find_spec`` but importing
    ``broken`` raises ImportError (``cache``: the backend's lru-cached import check, cleared around the call)."""
    import importlib.util
    import sys

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    real = importlib.util.find_spec
    sentinel = importlib.util.spec_from_loader(found, loader=None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: sentinel if name == found else real(name, *a))
    monkeypatch.setitem(sys.modules, broken, None)
    cache.cache_clear()
    try:
        return available()
    finally:
        cache.cache_clear()


@pytest.fixture
def reason_when_import_breaks():
    return _reason_when_import_breaks
