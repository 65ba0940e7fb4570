"""flash-attn-4: registered as an exact-class backend, refused (with the reason) where it cannot run,
its arguments checked before any kernel; on a Hopper GPU with the package it matches float32
attention within bf16 rounding, also inside ``torch.compile(fullgraph=True)``."""

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from omniloop.errors import DeployError
from omniloop.testing import make_manager
from omniloop_attention import flash4, plugin
from omniloop_attention.backends import BACKENDS
from omniloop_attention.flash4 import flash_attn4, flash_attn4_available

SPEC = {b.name: b for b in BACKENDS}["flash-attn-4"]


def _fake_installed(monkeypatch):
    """``flash_attn.cute`` found by find_spec (whatever is really installed)."""
    real = importlib.util.find_spec
    sentinel = importlib.util.spec_from_loader("flash_attn.cute", loader=None)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: sentinel if name == "flash_attn.cute" else real(name, *a))


def test_registered_exact_class():
    registered = {}
    plugin.omniloop_register_attention_backends(lambda spec: registered.setdefault(spec.name, spec))
    assert registered["flash-attn-4"] is SPEC
    assert SPEC.distribution_altering is False
    assert SPEC.fn is flash_attn4


def test_refused_when_not_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn.cute" else real(name, *a))
    reason = flash_attn4_available()
    assert "flash-attn-4 package (module 'flash_attn.cute') is not installed" in reason
    assert "omniloop-attention[flash-attn-4]" in reason


def test_refused_without_cuda(monkeypatch):
    _fake_installed(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flash_attn4_available() == "CUDA is not available on this machine"


def test_refused_off_hopper(monkeypatch):
    _fake_installed(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "Hopper (sm90) only" in flash_attn4_available()
    assert "sm80" in flash_attn4_available()


def test_a_broken_install_says_what_failed(monkeypatch, reason_when_import_breaks):
    """Found but not importable (the 2026-12-03 failure: no nvidia-cutlass-dsl-libs-core, so no
    ``cutlass.cute``): the reason carries the import error, at load, not at the first call."""
    reason = reason_when_import_breaks(monkeypatch, "flash_attn.cute", "flash_attn.cute", flash4._import_error,
                                       flash_attn4_available)
    assert reason.startswith("flash-attn-4 is installed but does not import: ModuleNotFoundError")
    assert "nvidia-cutlass-dsl-libs-core" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_unavailable_is_an_error_at_load(toy_checkpoint):
    from omniloop.runtime import Runtime

    with pytest.raises(DeployError, match="attention_backend: 'flash-attn-4' cannot run here: "):
        Runtime.from_model(toy_checkpoint, manager=make_manager(("attention", plugin)), attention_backend="flash-attn-4")


@pytest.mark.parametrize("case, match", [
    ("mask", "takes no attention mask"),
    ("float32", "needs bf16 or fp16"),
    ("mixed", "needs bf16 or fp16"),
    ("head_dim", "head dim in \\[8, 256\\]"),
    ("dropout", "does not take dropout_p"),
])
def test_bad_calls_are_refused_before_the_kernel(case, match, bad_call):
    q, k, v, kw = bad_call(case)
    with pytest.raises(ValueError, match=match):
        flash_attn4(q, k, v, **kw)


def test_the_op_has_a_fake_for_compile():
    """The custom op's fake (meta) function gives the kernel's ``[B, Lq, H, Dv]`` output, so
    torch.compile can trace it without the package."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 100, 3, 128, dtype=torch.bfloat16)
        k = torch.empty(2, 40, 3, 128, dtype=torch.bfloat16)
        out = torch.ops.omniloop_attention.flash_attn4_fwd(q, k, k, 0.1, False)
    assert tuple(out.shape) == (2, 100, 3, 128) and out.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------
# GPU: Hopper with flash-attn-4 installed
# ------------------------------------------------------------------------------------------------

needs_fa4 = pytest.mark.skipif(not torch.cuda.is_available() or flash_attn4_available() is not None,
                               reason="needs a Hopper GPU with flash-attn-4 installed")


@needs_fa4
@pytest.mark.parametrize("lq, lk, d, layout", [(1000, 1000, 128, "blhd"), (777, 512, 128, "blhd"), (256, 300, 64, "blhd"),
                                               (4429, 4429, 64, "bhld")])
def test_matches_float32_attention(lq, lk, d, layout, cuda_views, rel_to_float32):
    """``blhd``: views of ``[B, L, H, D]`` tensors (Wan); ``bhld``: contiguous ``[B, H, L, D]``
    (SD3's joint attention after its concatenation)."""
    q, k, v = cuda_views(2, 4, lq, d, 0), cuda_views(2, 4, lk, d, 1), cuda_views(2, 4, lk, d, 2)
    if layout == "bhld":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    assert rel_to_float32(flash_attn4, q, k, v) < 1e-2  # bf16 output rounding: ~4e-3


@needs_fa4
def test_compiled_fullgraph_equals_eager(compiled_equals_eager):
    assert compiled_equals_eager(flash_attn4)


def _bench_module():
    import importlib.util as iu
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "attention_flash4.py"
    spec = iu.spec_from_file_location("attention_flash4_bench", path)
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_reference_rows_are_float32_attention():
    """bench/attention_flash4.py's float32 reference on a subset of query rows is attention itself."""
    bench = _bench_module()
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 33, 16), torch.randn(1, 2, 33, 16)
    rows = torch.tensor([0, 5, 39])
    ref = bench.reference_rows(q, k, v, rows)
    torch.testing.assert_close(ref, F.scaled_dot_product_attention(q, k, v)[:, :, rows], rtol=1e-5, atol=1e-6)
    e = bench.err(ref + 1e-3, ref)
    assert abs(e["max_abs"] - 1e-3) < 1e-6 and e["rel_rms"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_bench_needs_a_gpu(monkeypatch):
    bench = _bench_module()
    monkeypatch.setattr(sys, "argv", ["attention_flash4.py"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main()
