"""Attention backends: explicit kernels match SDPA; unavailable ones fail at load, clearly."""

import pytest
import torch
import torch.nn.functional as F

from omniloop.errors import DeployError
from omniloop.testing import make_manager, toy_runtime
from omniloop_attention import plugin
from omniloop_attention.backends import BACKENDS

BY_NAME = {b.name: b for b in BACKENDS}


def test_math_backend_matches_sdpa_on_cpu():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 17, 8) for _ in range(3))
    out = BY_NAME["sdpa-math"].fn(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("name", ["sdpa-cudnn", "sdpa-flash", "sdpa-efficient"])
def test_gpu_kernels_say_why_they_cannot_run_on_cpu(name):
    assert "CUDA is not available" in BY_NAME[name].available()


def test_flash_attn_says_it_is_missing():
    reason = BY_NAME["flash-attn"].available()
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        assert "flash-attn package is not installed" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_unavailable_backend_is_an_error_at_load(toy_checkpoint):
    from omniloop.runtime import Runtime

    with pytest.raises(DeployError, match="attention_backend: 'sdpa-cudnn' cannot run here: CUDA is not available"):
        Runtime.from_model(toy_checkpoint, manager=make_manager(("attention", plugin)), attention_backend="sdpa-cudnn")


def test_unknown_backend_lists_the_available(toy_checkpoint):
    with pytest.raises(DeployError, match=r"unknown backend 'fa9' \(available: .*sdpa-cudnn"):
        toy_runtime(toy_checkpoint, ("attention", plugin), attention_backend="fa9")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["sdpa-cudnn", "sdpa-flash", "sdpa-efficient"])
def test_gpu_kernels_match_math_in_bf16(name):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = BY_NAME["sdpa-math"].fn(q.float(), k.float(), v.float())
    out = BY_NAME[name].fn(q, k, v).float()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)  # bf16 inputs: ~3 significant digits
