"""cudnn-fp8: refused where it cannot run and for exact requests; its numerical model is sane; on a
Hopper GPU with the cudnn frontend the kernel matches that model and stays near bf16."""

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from omniloop.errors import DeployError
from omniloop.testing import make_manager
from omniloop_attention import plugin
from omniloop_attention.backends import BACKENDS
from omniloop_attention.fp8 import E4M3_MAX, cudnn_fp8, cudnn_fp8_available, quantize, reference_fp8_attention, smooth

SPEC = {b.name: b for b in BACKENDS}["cudnn-fp8"]


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def _hopper_with_frontend() -> bool:
    return cudnn_fp8_available() is None


def test_declared_distribution_altering():
    assert SPEC.distribution_altering is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_refused_without_cuda():
    assert SPEC.available() == "CUDA is not available on this machine"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] == 9,
                    reason="checks the refusal off Hopper")
def test_refused_off_hopper():
    assert "Hopper (sm90) only" in SPEC.available()


def test_refused_without_the_frontend(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cudnn" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert "nvidia-cudnn-frontend package (module 'cudnn') is not installed" in cudnn_fp8_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_unavailable_is_an_error_at_load(toy_checkpoint):
    from omniloop.runtime import Runtime

    with pytest.raises(DeployError, match="attention_backend: 'cudnn-fp8' cannot run here: CUDA is not available"):
        Runtime.from_model(toy_checkpoint, manager=make_manager(("attention", plugin)), attention_backend="cudnn-fp8")


def test_exact_requests_are_refused(toy_checkpoint, monkeypatch):
    """With the backend loadable (availability patched; the toy never reaches the kernel), an
    exact request is refused before any compute, naming the backend."""
    import attrs

    from omniloop.errors import RequestError
    from omniloop.runtime import Runtime
    from omniloop.testing import toy_request
    from omniloop_attention import backends

    patched = attrs.evolve(SPEC, available=lambda: None)

    monkeypatch.setattr(backends, "BACKENDS", [patched if b.name == "cudnn-fp8" else b for b in backends.BACKENDS])
    # the plugin reads backends.BACKENDS when its hook runs (it imports no torch before), so this one patch suffices
    rt = Runtime.from_model(toy_checkpoint, manager=make_manager(("attention", plugin)), attention_backend="cudnn-fp8")
    with pytest.raises(RequestError, match="attention backend 'cudnn-fp8' alters outputs; exact requests cannot use it"):
        rt.generate(toy_request(exact=True))


def test_plan_option_checked_at_load(toy_checkpoint, monkeypatch):
    """``attention_options: {plan: fastest}`` gives the runtime a backend callable that times cuDNN's
    plans; an unknown plan or key is one DeployError at load (availability patched: no GPU here)."""
    import attrs

    from omniloop.runtime import Runtime
    from omniloop_attention import backends

    patched = attrs.evolve(SPEC, available=lambda: None)
    monkeypatch.setattr(backends, "BACKENDS", [patched if b.name == "cudnn-fp8" else b for b in backends.BACKENDS])
    mgr = make_manager(("attention", plugin))
    rt = Runtime.from_model(toy_checkpoint, manager=mgr, attention_backend="cudnn-fp8",
                            attention_options={"plan": "fastest"})
    assert rt.attention.fn.plan == "fastest" and cudnn_fp8.plan == "heuristic"
    with pytest.raises(DeployError, match=r"^attention_options\.plan: must be one of heuristic, fastest, not 'best'$"):
        Runtime.from_model(toy_checkpoint, manager=mgr, attention_backend="cudnn-fp8", attention_options={"plan": "best"})
    with pytest.raises(DeployError, match="attention_options"):
        Runtime.from_model(toy_checkpoint, manager=mgr, attention_backend="cudnn-fp8", attention_options={"plans": "fastest"})


def test_mask_and_causal_are_errors():
    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="no attention mask"):
        cudnn_fp8(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="no causal flag"):
        cudnn_fp8(q, q, q, is_causal=True)


def test_quantize_uses_the_range_and_round_trips():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 50, 16) * 5
    x8, d = quantize(x)
    assert x8.dtype == torch.float8_e4m3fn and d.shape == (1, 1, 1, 1)
    assert float(x8.float().abs().max()) == E4M3_MAX
    assert _rel(x8.float() * d, x) < 0.03  # 3 mantissa bits: ~2^-4 / sqrt(3) relative RMS
    x8h, dh = quantize(x, "head")
    assert dh.shape == (2, 3, 1, 1)
    assert torch.all(x8h.float().abs().amax(dim=(-2, -1)) == E4M3_MAX)
    with pytest.raises(ValueError, match="granularity"):
        quantize(x, "block")


def test_quantize_all_zero_is_finite():
    x8, d = quantize(torch.zeros(1, 1, 4, 8))
    assert torch.all(x8.float() == 0) and torch.isfinite(d).all()


def test_reference_model_is_exact_without_rounding_and_close_with_it():
    """The FP8 numerical model: quantisation switched off it is plain softmax attention; on
    RMS-normed-like inputs the full FP8 arithmetic stays within 8% relative RMS of float32."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 64, 32) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v)
    full = reference_fp8_attention(q, k, v)
    assert 0.005 < _rel(full, ref) < 0.08
    assert _rel(reference_fp8_attention(q, k, v, quantize_p=False, quantize_o=False), ref) < 0.05


def test_smoothing_changes_no_output_in_exact_arithmetic_and_helps_a_shared_offset():
    """K's token mean shifts each query's logits by a constant (the softmax removes it); V's is added
    back to the output: with no rounding the model is plain attention whatever is smoothed, and an
    offset shared by every token stops costing V's rounding."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 80, 32)
    k = torch.randn(1, 2, 80, 32) + 3 * torch.randn(1, 2, 1, 32)
    v = torch.randn(1, 2, 80, 32) + 4 * torch.randn(1, 2, 1, 32)
    ref = F.scaled_dot_product_attention(q, k, v)
    centred, mean = smooth(k)
    assert torch.allclose(centred + mean, k, atol=1e-5) and torch.allclose(centred.mean(-2), torch.zeros(1, 2, 32), atol=1e-5)
    one = torch.ones(())
    exact = {"q8": (q, one), "quantize_p": False, "quantize_o": False}
    unrounded = reference_fp8_attention(q, k, v, **exact, k8=(smooth(k)[0], one), v8=(v, one))
    assert _rel(unrounded, ref) < 1e-5
    # the output's e4m3 scale follows v's own range when v is passed unrounded
    assert _rel(reference_fp8_attention(q, k, v, q8=(q, one), k8=(k, one), v8=(v, one), quantize_p=False), ref) < 0.05
    plain = _rel(reference_fp8_attention(q, k, v), ref)
    assert _rel(reference_fp8_attention(q, k, v, smooth_k=True, smooth_v=True), ref) < plain / 2


def test_wan_static_descale_bounds_normed_rotated_values():
    """omniloop_wan.fused.fp8_descale: sqrt(C) * max|w| bounds every element of rotary(norm(x))."""
    fused = pytest.importorskip("omniloop_wan.fused")
    torch.manual_seed(0)
    C, heads = 64, 4
    norm = torch.nn.RMSNorm(C, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.2, 2.0)
    x = torch.randn(2, 30, C)
    x[0, 3] = 0
    x[0, 4, 5] = 1e4  # one channel holding nearly all the mean square: the bound is reached
    L, D = 30, C // heads
    ang = torch.rand(L, D // 2) * 6.28
    cos = torch.cos(ang).repeat_interleave(2, -1).reshape(1, L, 1, D)
    sin = torch.sin(ang).repeat_interleave(2, -1).reshape(1, L, 1, D)
    with torch.no_grad():
        y = fused.reference(x, norm, cos, sin, heads)
        d = fused.fp8_descale(norm, C)
    assert float((y / d).abs().max()) <= E4M3_MAX * (1 + 1e-5)
    assert float((y / d).abs().max()) > 0.5 * E4M3_MAX


needs_fp8 = pytest.mark.skipif(not _hopper_with_frontend(), reason="needs a Hopper GPU and nvidia-cudnn-frontend")


@needs_fp8
@pytest.mark.parametrize("shape", [(1, 4, 256, 256, 128), (2, 5, 320, 320, 32), (1, 3, 1000, 512, 64)])
def test_kernel_matches_the_model_and_bf16(shape):
    b, h, lq, lk, d = shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for n in (lq, lk, lk))
    out = cudnn_fp8(q, k, v)
    assert out.shape == (b, h, lq, d) and out.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    model = reference_fp8_attention(q.float(), k.float(), v.float())
    # the kernel rounds probabilities against a running (per key tile) max, the model against
    # the row max: both are ~3-bit-mantissa arithmetic, so they agree to about that precision
    assert _rel(out, model) < 0.06
    assert _rel(out, ref) < 0.12


@needs_fp8
def test_fused_rope_kernel_writes_e4m3_with_its_descale():
    fused = pytest.importorskip("omniloop_wan.fused")
    torch.manual_seed(0)
    B, L, heads, D = 1, 300, 4, 64
    C = heads * D
    norm = torch.nn.RMSNorm(C, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(B, L, C, device="cuda", dtype=torch.bfloat16)
    ang = torch.rand(L, D // 2, device="cuda") * 6.28
    cos = torch.cos(ang).repeat_interleave(2, -1).reshape(1, L, 1, D)
    sin = torch.sin(ang).repeat_interleave(2, -1).reshape(1, L, 1, D)
    fused.prepare()
    x8, d = fused.qk_norm_rope_fp8(x, norm, cos, sin, heads)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == (B, L, heads, D)
    ref = fused.reference(x.float(), norm.float(), cos, sin, heads)
    assert _rel(x8.float() * d, ref) < 0.04
    assert math.isfinite(float(x8.float().abs().max()))


@needs_fp8
def test_fastest_plan_times_every_plan_once_and_matches_the_heuristic_pick():
    """``plan: fastest``: the first call of a shape times each of cuDNN's plans (recorded in
    PLAN_TIMINGS) and keeps the fastest; every plan computes the same graph, so the output is within
    FP8 rounding of the heuristic plan's."""
    from omniloop_attention.fp8 import PLAN_TIMINGS, CudnnFP8Attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 512, 4, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    before = len(PLAN_TIMINGS)
    fast = CudnnFP8Attention(plan="fastest")
    a = fast(q, k, v)
    assert len(PLAN_TIMINGS) == before + 1
    rows = list(PLAN_TIMINGS.values())[-1]
    assert any("ms" in r for r in rows)
    fast(q, k, v)
    assert len(PLAN_TIMINGS) == before + 1  # tuned once per shape
    assert _rel(a, cudnn_fp8(q, k, v)) < 0.05
