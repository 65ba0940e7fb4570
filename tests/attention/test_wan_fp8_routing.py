"""The Wan processor hands an FP8 backend its q/k already quantised (``attend_quantized``) when the
fused rope kernel runs, and only then: with ``qk_norm_rope: fused`` self-attention (norm + rotation)
goes through ``attend_quantized``, and cross-attention (the norm alone) too when ``FUSE_FP8_CROSS_QUANT``
is on (the default); with ``FUSE_FP8_QUANT`` off or the reference rope,
everything goes through the plain ``fn(q, k, v)``. CPU: the fused Triton kernel and the
cuDNN graph are replaced by their numerical models (``fused.reference`` rounded to e4m3 with
``fused.fp8_descale``; ``reference_fp8_attention``), so the routing and the block output (within
FP8 error of the bf16-class path) are checked without a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from omniloop.builtin import sdpa
from omniloop.family import AttentionBackendSpec
from omniloop_attention.fp8 import reference_fp8_attention


class FakeFP8:
    """Stands in for omniloop_attention.fp8.CudnnFP8Attention, recording which entry was used."""

    accepts_quantized_qk = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def __call__(self, q, k, v, **kw):
        self.calls.append(("fn", q.shape[-2], k.shape[-2]))
        return reference_fp8_attention(q, k, v)

    def attend_quantized(self, q8, dq, k8, dk, v, out_dtype):
        assert q8.dtype == torch.float8_e4m3fn and k8.dtype == torch.float8_e4m3fn and v.dtype == out_dtype
        self.calls.append(("quantized", q8.shape[-2], k8.shape[-2]))
        q, k = q8.float() * dq, k8.float() * dk
        return reference_fp8_attention(q, k, v.float(), q8=(q8, dq), k8=(k8, dk)).to(out_dtype)


def _model():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=8, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=32,
    ).eval()


@pytest.fixture
def cpu_fused_kernels(monkeypatch):
    """The fused-kernel entry points, on the CPU, as their numerical models."""
    from omniloop_wan import fused

    def fp8(x, norm, cos, sin, heads):
        d = fused.fp8_descale(norm, x.shape[-1])
        y = fused.reference(x.float(), norm.float(), cos, sin, heads)
        return (y / d).clamp(-448, 448).to(torch.float8_e4m3fn), d

    monkeypatch.setattr(fused, "supported", lambda *a: True)
    monkeypatch.setattr(fused, "triton_available", lambda: False)
    monkeypatch.setattr(fused, "qk_norm_rope", lambda x, norm, cos, sin, heads: fused.reference(x, norm, cos, sin, heads))
    monkeypatch.setattr(fused, "qk_norm_rope_fp8", fp8)


def _forward(model):
    from omniloop_wan.transformer import wan_forward

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 3, 8, 8, generator=g)
    text = torch.randn(1, 512, 8, generator=g)
    with torch.no_grad():
        return wan_forward(model, x, torch.tensor([500.0]), text, None, None)


@pytest.mark.parametrize(("fuse_quant", "fuse_cross"), [(True, True), (True, False), (False, True)])
def test_fused_rope_hands_quantized_qk_to_the_backend(cpu_fused_kernels, monkeypatch, fuse_quant, fuse_cross):
    from omniloop_wan import attention

    monkeypatch.setattr(attention, "FUSE_FP8_QUANT", fuse_quant)
    monkeypatch.setattr(attention, "FUSE_FP8_CROSS_QUANT", fuse_cross)
    model = _model()
    attention.install(model, AttentionBackendSpec(name="sdpa", fn=sdpa), qk_norm_rope="fused")
    ref = _forward(model)
    fake = FakeFP8()
    attention.install(model, AttentionBackendSpec(name="fake-fp8", fn=fake, distribution_altering=True),
                      qk_norm_rope="fused")
    out = _forward(model)
    tokens = 3 * 4 * 4
    self_calls = [c for c in fake.calls if c[1:] == (tokens, tokens)]
    cross_calls = [c for c in fake.calls if c[1:] == (tokens, 512)]
    assert len(self_calls) == 2 and len(cross_calls) == 2  # 2 layers
    assert {c[0] for c in cross_calls} == ({"quantized"} if fuse_quant and fuse_cross else {"fn"})
    assert {c[0] for c in self_calls} == ({"quantized"} if fuse_quant else {"fn"})
    assert out.dtype == ref.dtype and torch.isfinite(out).all()
    rel = float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    assert 1e-4 < rel < 0.1  # FP8 attention in 2 small blocks: a few % relative RMS


def _entries_used(fake, qk_norm_rope):
    """Install ``fake`` as the backend of a small Wan model, run one forward: the entries it was called by."""
    from omniloop_wan import attention

    model = _model()
    attention.install(model, AttentionBackendSpec(name="fake-fp8", fn=fake, distribution_altering=True),
                      qk_norm_rope=qk_norm_rope)
    _forward(model)
    assert fake.calls
    return {c[0] for c in fake.calls}


def test_reference_rope_never_hands_quantized():
    assert _entries_used(FakeFP8(), "reference") == {"fn"}


def test_only_a_declared_backend_gets_quantized_qk(cpu_fused_kernels):
    """Having an ``attend_quantized`` method is not enough: the callable must declare
    ``accepts_quantized_qk`` (nobody probes a backend for methods)."""

    class Undeclared(FakeFP8):
        accepts_quantized_qk = False

    assert _entries_used(Undeclared(), "fused") == {"fn"}
    # declared: self- and cross-attention get q/k in e4m3 (FUSE_FP8_CROSS_QUANT, the default)
    assert _entries_used(FakeFP8(), "fused") == {"quantized"}
