"""omniloop_quant.fp8 on the CPU (torch's CPU ``_scaled_mm`` runs the real path).

Tolerances. Against the **numerical model** (float32 matmul of the dequantised activation and
weight, :func:`omniloop_quant.reference_output`) a float32-output layer agrees to 1e-5 relative
(only the float32 summation order differs). Against the **float32 linear** the difference is e4m3
rounding: 3 mantissa bits, so each operand element carries up to 2^-4 relative error (RMS about
2.5 % for Gaussian data); products of two rounded operands, summed over K with random signs, give
a relative RMS error near 3.5 % (measured 0.035 here) — the test allows 6 %. bf16 output adds
bf16's 2^-9 on top.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import omniloop_quant.fp8 as fp8
from omniloop_quant import (
    FP8GeluProjection,
    FP8Linear,
    install,
    installed,
    reference_output,
    restore,
    unavailable_reason,
)

REL_RMS_TOL = 0.06


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@torch.no_grad()
def test_output_vs_float32_reference_and_numerical_model():
    torch.manual_seed(0)
    lin = nn.Linear(160, 640)
    x = torch.randn(2, 37, 160)  # 74 tokens: M needs no alignment
    layer = FP8Linear(lin)
    out = layer(x)
    assert out.shape == (2, 37, 640) and out.dtype == torch.float32
    model = reference_output(layer, x)
    assert float((out - model).abs().max()) <= 1e-5 * float(model.abs().max())
    err = rel_rms(out, lin(x))
    assert 0.005 < err < REL_RMS_TOL  # really quantised, and within e4m3's rounding


@torch.no_grad()
def test_a_gemm_split_over_its_reduction_sums_to_the_whole():
    """``forward_quantized_split`` (the ``SPLIT_DOWN_K`` experiment): GEMMs over equal slices of K, summed,
    the bias once -- in float32 the same product up to float32 summation order; a K that does not split into
    slices of a multiple of 16 falls back to one GEMM."""
    if not fp8._cpu_rowwise_scales():
        pytest.skip("this torch's CPU _scaled_mm takes one scale per tensor")
    torch.manual_seed(3)
    lin = nn.Linear(128, 64)
    layer = FP8Linear(lin)
    xq, sx = fp8.quantize_rows(torch.randn(9, 128))
    whole = layer.forward_quantized(xq, sx, torch.float32)
    for parts in (2, 4, 8):
        split = layer.forward_quantized_split(xq, sx, torch.float32, parts)
        assert float((split - whole).abs().max()) <= 1e-5 * float(whole.abs().max()), parts
    assert torch.equal(layer.forward_quantized_split(xq, sx, torch.float32, 3), whole)  # 128 / 3: one GEMM
    assert torch.equal(layer.forward_quantized_split(xq, sx, torch.float32, 16), whole)  # slices of 8: one GEMM


@torch.no_grad()
def test_bf16_output_and_bias_in_the_gemm():
    torch.manual_seed(1)
    lin = nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    layer = FP8Linear(lin)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert layer.bias is lin.bias or layer.bias.data_ptr() == lin.bias.data_ptr()  # shared, not copied
    ref = x.float() @ lin.weight.float().t() + lin.bias.float()
    assert rel_rms(out, ref) < REL_RMS_TOL
    zero = layer(torch.zeros(2, 64, dtype=torch.bfloat16))  # an all-zero token: scale clamped, output = bias
    assert torch.equal(zero, lin.bias.expand(2, -1))


@torch.no_grad()
def test_weight_is_quantised_once(monkeypatch):
    calls = []
    real = fp8.quantize_weight

    def counting(w):
        calls.append(tuple(w.shape))
        return real(w)

    monkeypatch.setattr(fp8, "quantize_weight", counting)
    layer = FP8Linear(nn.Linear(32, 16))
    ptr = layer.qweight.data_ptr()
    for _ in range(3):
        layer(torch.randn(4, 32))
    assert calls == [(16, 32)]
    assert layer.qweight.dtype == torch.float8_e4m3fn and layer.qweight.data_ptr() == ptr
    assert layer.weight_scale.shape == (1, 16) and layer.weight_scale.dtype == torch.float32
    assert not hasattr(layer, "weight")  # no bf16/fp32 copy kept by the layer


def test_per_channel_and_per_token_scales():
    w = torch.tensor([[1.0, -2.0], [0.0, 0.0], [448.0, 1.0]]).repeat(1, 8)  # [3, 16]
    q, s = fp8.quantize_weight(w)
    assert torch.allclose(s.flatten(), torch.tensor([2.0, 1e-12, 448.0]) / 448.0)
    assert float(q.float().abs().amax(dim=1)[0]) == 448.0 and torch.equal(q[1].float(), torch.zeros(16))
    a = torch.tensor([[3.0] * 16, [-0.5] * 16])
    qa, sa = fp8.quantize_rows(a)
    assert torch.equal(qa.float(), torch.tensor([[448.0] * 16, [-448.0] * 16]))
    assert sa.shape == (2, 1) and torch.allclose(sa.flatten(), torch.tensor([3.0, 0.5]) / 448.0)


class _Block(nn.Module):
    """A stand-in transformer block: aligned and misaligned linears, a nested list, a GELU proj."""

    def __init__(self) -> None:
        super().__init__()
        self.to_q = nn.Linear(32, 32)
        self.odd = nn.Linear(24, 32)  # in_features not a multiple of 16: stays as it is
        self.to_out = nn.ModuleList([nn.Linear(32, 48, bias=False), nn.Dropout(0.0)])
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.to_out[1](self.to_out[0](self.to_q(self.norm(x))))
        return h + self.odd(x[..., :24]).repeat(1, 1, 2)[..., :48]


@torch.no_grad()
def test_install_skips_misaligned_and_restore_is_exact():
    torch.manual_seed(2)
    blocks = nn.ModuleList([_Block(), _Block()])
    x = torch.randn(1, 9, 32)
    before = [b(x) for b in blocks]
    report = install(list(blocks), names=["blocks.0", "blocks.1"])
    assert report["quantized"] == 4
    assert report["skipped"] == ["blocks.0.odd 24->32", "blocks.1.odd 24->32"]
    assert isinstance(blocks[0].to_q, FP8Linear) and isinstance(blocks[0].to_out[0], FP8Linear)
    assert type(blocks[0].odd) is nn.Linear and all(installed(b) for b in blocks)
    assert install(list(blocks))["quantized"] == 4  # installing again changes nothing
    after = [b(x) for b in blocks]
    assert all(0 < rel_rms(a, b) < REL_RMS_TOL for a, b in zip(after, before, strict=True))
    assert restore(list(blocks)) == 4
    assert all(torch.equal(b(x), ref) for b, ref in zip(blocks, before, strict=True))


class FusedGeluProjection(nn.Module):
    """Same name and shape as omniloop-wan's: reads ``proj.weight`` itself."""

    def __init__(self, proj: nn.Linear) -> None:
        super().__init__()
        self.proj, self.approximate = proj, "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x @ self.proj.weight.t() + self.proj.bias, approximate="tanh")


@torch.no_grad()
def test_fused_gelu_projection_is_replaced_whole():
    torch.manual_seed(3)
    net = nn.ModuleList([FusedGeluProjection(nn.Linear(32, 64)), nn.Linear(64, 32)])
    block = nn.Sequential()
    block.net = net
    x = torch.randn(7, 32)
    ref = net[1](net[0](x))
    assert install([block])["quantized"] == 2
    assert isinstance(net[0], FP8GeluProjection) and isinstance(net[1], FP8Linear)
    assert rel_rms(net[1](net[0](x)), ref) < REL_RMS_TOL
    restore([block])
    assert type(net[0]) is FusedGeluProjection and torch.equal(net[1](net[0](x)), ref)


def test_compiles_without_graph_breaks():
    torch._dynamo.reset()
    layer = nn.Sequential(nn.LayerNorm(64), FP8Linear(nn.Linear(64, 32)))
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        explained = torch._dynamo.explain(layer)(x)
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=False)
        assert torch.allclose(compiled(x), layer(x), rtol=0, atol=1e-6)
    torch._dynamo.reset()


def test_misaligned_layer_is_refused_by_the_class():
    with pytest.raises(ValueError, match="multiples of 16"):
        FP8Linear(nn.Linear(24, 32))


def test_device_checks(monkeypatch):
    assert unavailable_reason("cpu") is None
    assert unavailable_reason("cpu", torch.float32) is None
    assert "CUDA" in unavailable_reason("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert unavailable_reason("cuda", torch.bfloat16) == (
        "FP8 GEMMs need CUDA compute capability >= 8.9 (Ada/Hopper); NVIDIA A100 is 8.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert unavailable_reason("cuda", torch.bfloat16) is None
    assert "must be bfloat16, not float32" in unavailable_reason("cuda", torch.float32)


def test_a_torch_whose_cpu_gemm_takes_one_scale_per_tensor_is_refused_on_the_cpu(monkeypatch):
    """torch 2.11's CPU _scaled_mm asserts per-tensor scales (an internal assert at the first GEMM);
    the load-time check says so instead. This torch's answer is probed once and cached."""
    import omniloop_quant.fp8 as fp8

    assert isinstance(fp8._cpu_rowwise_scales(), bool)  # (True on torch 2.13, CI's; False on 2.11)
    monkeypatch.setattr(fp8, "_CPU_ROWWISE", False)
    reason = unavailable_reason("cpu")
    assert reason is not None and "CPU _scaled_mm takes one scale per tensor" in reason


def test_denoiser_blocks_from_family_declarations():
    """Which blocks: ``quant_blocks`` when declared, else the LoRA components with their offload
    block lists (a tuple for FLUX's two stacks, ``|`` alternatives), text encoders never."""
    from omniloop.capabilities import AdapterSupport, FamilyCapabilities, OffloadSupport
    from omniloop_quant import denoiser_blocks

    class Tf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer_blocks = nn.ModuleList([nn.Linear(16, 16)])
            self.single_transformer_blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
            self.proj_out = nn.Linear(16, 16)

    class FluxLike:
        capabilities = FamilyCapabilities(
            adapters=AdapterSupport(components=("transformer",)),
            offload=OffloadSupport(components={"transformer": ("transformer_blocks", "single_transformer_blocks"),
                                               "text_encoder": "encoder.layers", "vae": None}))

    class Declared:
        capabilities = FamilyCapabilities(quant_blocks={"transformer": "single_transformer_blocks|missing"})

    class Bare:  # declares nothing
        capabilities = FamilyCapabilities()

    comps = {"transformer": Tf(), "text_encoder": nn.Module(), "vae": nn.Module()}
    assert [n for n, _ in denoiser_blocks(comps, FluxLike())] == [
        "transformer.transformer_blocks.0", "transformer.single_transformer_blocks.0",
        "transformer.single_transformer_blocks.1"]
    assert [n for n, _ in denoiser_blocks(comps, Declared())] == [
        "transformer.single_transformer_blocks.0", "transformer.single_transformer_blocks.1"]
    assert [n for n, _ in denoiser_blocks(comps, Bare())] == [  # nothing declared: the default lists
        "transformer.transformer_blocks.0", "transformer.single_transformer_blocks.0",
        "transformer.single_transformer_blocks.1"]
    assert denoiser_blocks({"unet": Tf()}, Bare()) == []


def test_stray_weight_buffers_are_reported():
    """A block that multiplies by a copy of its linears' weights (SD3's fused q/k/v buffer) bypasses
    the FP8 modules: the copy is named in the report, the FP8 layers' own buffers are not."""
    from omniloop_quant import stray_weights

    block = _Block()
    block.register_buffer("omniloop_qkv_weight", torch.cat([block.to_q.weight] * 3), persistent=False)
    install([block])
    assert stray_weights([("blocks.0", block)]) == ["blocks.0.omniloop_qkv_weight"]
    restore([block])
