"""Deploy ``options.norm_quant`` on Wan: omniloop's block forward (omniloop_wan.blocks).

* Installed in place of diffusers' blocks, :class:`WanBlock` shares their modules (same state-dict
  keys) and, where the fused fronts do not apply (here: the CPU, bf16-only kernel), gives diffusers'
  transformer output bit for bit; ``restore`` undoes it.
* The fused path — residual add + norm + modulation + per-row e4m3 in one kernel, the rows handed to
  the FP8 GEMMs through the attention processor's ``quantized`` input and ``FP8FeedForward.forward_quantized``
  — is checked on the CPU with the kernel's torch reference standing in for the Triton kernel: the
  forward equals the unfused FP8 forward (the same quantisation of the same values).
* The option is refused without FP8 linears and off CUDA, before any weight loads.
* On CUDA the kernel's forward is within float32-rounding distance of the unfused FP8 forward (skipped here).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from omniloop.builtin import sdpa
from omniloop.errors import DeployError
from omniloop.family import AttentionBackendSpec
from omniloop_wan import blocks
from omniloop_wan.attention import install as install_processors
from omniloop_wan.transformer import wan_forward

from .conftest import wan_manager

pytest.importorskip("omniloop_quant")

#: dimensions an FP8 GEMM takes (multiples of 16)
CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16,
              text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32)


def _cpu_fp8() -> None:
    """Skip where this torch's CPU ``_scaled_mm`` takes no row-wise scales (torch < 2.13: the GPU machine's)."""
    from omniloop_quant import fp8

    why = fp8.unavailable_reason(torch.device("cpu"))
    if why:
        pytest.skip(why)


def _model(dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(**CONFIG).to(device=device, dtype=dtype).eval()


def _inputs(dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 3, 8, 8, generator=g).to(device=device, dtype=dtype)
    text = torch.randn(1, 512, 32, generator=g).to(device=device, dtype=dtype)
    return x, torch.tensor([700.0], device=device), text


def test_wan_block_is_bit_exact_and_shares_the_modules() -> None:
    ref = _model()
    ours = copy.deepcopy(ref)
    keys = list(ours.state_dict())
    first = ours.blocks[0]
    assert blocks.install(ours) == 2 and isinstance(ours.blocks[1], blocks.WanBlock)
    assert list(ours.state_dict()) == keys and ours.blocks[0].scale_shift_table is first.scale_shift_table
    install_processors(ours, AttentionBackendSpec(name="sdpa", fn=sdpa))
    with torch.no_grad():
        want = wan_forward(ref, *_inputs())
        assert torch.equal(wan_forward(ours, *_inputs()), want)
    assert blocks.restore(ours) == 2 and ours.blocks[0] is first and not blocks.installed(ours)


@pytest.mark.parametrize("qkv", ["separate", "fused"])
def test_the_fused_fronts_equal_the_unfused_fp8_forward_on_cpu(monkeypatch: pytest.MonkeyPatch, qkv: str) -> None:
    from omniloop_quant import fp8, kernels, norm_kernels

    _cpu_fp8()
    model = _model()
    if qkv == "fused":
        from omniloop_wan.attention import fuse_projections

        fuse_projections(model)
    blocks.install(model)
    install_processors(model, AttentionBackendSpec(name="sdpa", fn=sdpa))
    report = fp8.install(list(model.blocks))
    assert report["quantized"] > 0 and not report["skipped"], report
    calls: list[bool] = []

    def kernel(x: torch.Tensor, **kw: Any) -> Any:  # the Triton kernel's torch reference, counted
        calls.append(kw.get("delta") is not None)
        return norm_kernels.reference(x, **kw)

    out_rows: list[int] = []

    def row_kernel(h: torch.Tensor) -> Any:  # the attention outputs' row quantisation, as torch ops, counted
        out_rows.append(h.shape[0])
        return fp8.quantize_rows(h)

    with torch.no_grad():
        unfused = wan_forward(model, *_inputs())
        assert not model.blocks[0].fusable(torch.zeros(1, 4, 64), torch.zeros(1, 6, 64))  # CPU float32: not the kernel's
        monkeypatch.setattr(norm_kernels, "supported", lambda x: True)
        monkeypatch.setattr(norm_kernels, "residual_norm_quantize_rows", kernel)
        from omniloop_wan import attention

        monkeypatch.setattr(attention, "FUSE_OUT_QUANT", True)  # the default; set so the test holds either way
        monkeypatch.setattr(kernels, "supported", lambda h: True)
        monkeypatch.setattr(kernels, "quantize_rows", row_kernel)
        monkeypatch.setattr(kernels, "gelu_quantize_rows", kernels.reference)
        fused = wan_forward(model, *_inputs())
    assert calls == [False, True, True] * CONFIG["num_layers"]  # three fronts a block; two carry the residual
    assert out_rows == [3 * 4 * 4] * 2 * CONFIG["num_layers"]  # both attention outputs of every block
    assert torch.equal(fused, unfused)


def test_refused_without_fp8_linears_and_off_cuda(tiny_ckpt) -> None:
    import omniloop_quant.plugin as quant_plugin
    import omniloop_wan.plugin as wan_plugin
    from omniloop.runtime import Runtime
    from omniloop.testing import make_manager

    def manager() -> Any:
        return make_manager(("wan", wan_plugin), ("quant", quant_plugin), toy=False)

    _cpu_fp8()

    for deploy, msg in (({}, r"^options\.norm_quant: 'fused' hands e4m3 rows to FP8 linears"),
                        ({"linear_precision": "fp8"}, r"^options\.norm_quant: 'fused' cannot run here: it needs a CUDA")):
        with pytest.raises(DeployError, match=msg):
            Runtime.from_model(tiny_ckpt("t2v"), manager=manager(), options={"norm_quant": "fused"}, **deploy)
    with pytest.raises(DeployError, match=r"^options\.norm_quant: must be one of reference, fused"):
        Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), options={"norm_quant": "yes"})


def test_the_family_installs_the_blocks_before_compiling(tiny_ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    """The family's wiring, on the CPU: with the device check passed (as on CUDA), the loaded transformer's
    blocks are omniloop's, the deployment records it, and a request runs (here the unfused path)."""
    import omniloop_quant.plugin as quant_plugin
    import omniloop_wan.family as family
    import omniloop_wan.plugin as wan_plugin
    from omniloop.runtime import Runtime
    from omniloop.testing import make_manager

    _cpu_fp8()
    monkeypatch.setattr(family, "check_fused_options", lambda opts, device: None)
    rt = Runtime.from_model(tiny_ckpt("t2v"), manager=make_manager(("wan", wan_plugin), ("quant", quant_plugin), toy=False),
                            linear_precision="fp8", options={"norm_quant": "fused"})
    tf = rt.model.components["transformer"]
    assert blocks.installed(tf) and rt.model.config["norm_quant"] == "fused"
    out = rt.generate({"task": "t2v", "prompt": "a red fox", "diffusion": {"steps": 2, "seed": 1}})
    assert out.ok, out.error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the norm kernel needs a CUDA device and triton")
@pytest.mark.parametrize("fast", [False, True])
def test_the_kernel_forward_is_within_rounding_of_the_unfused_one_on_cuda(fast: bool) -> None:
    from omniloop_quant import fp8

    model = _model(torch.bfloat16, "cuda")
    blocks.install(model)
    install_processors(model, AttentionBackendSpec(name="sdpa", fn=sdpa))
    fp8.install(list(model.blocks), fast_accum=fast)
    x = _inputs(torch.bfloat16, "cuda")
    assert model.blocks[0].fusable(torch.zeros(1, 4, 64, device="cuda", dtype=torch.bfloat16),
                                   torch.zeros(1, 6, 64, device="cuda"))
    with torch.no_grad():
        fused = wan_forward(model, *x).float()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(blocks.WanBlock, "fusable", lambda self, h, t: False)
            unfused = wan_forward(model, *x).float()
    # the kernel's float32 mean/variance sums vs torch's Welford: an e4m3 step now and then
    assert (fused - unfused).norm() / unfused.norm() < 2e-2


def test_blocks_whose_gemms_are_not_all_fp8_are_reported_once() -> None:
    """``linear_precision_options.keep`` (or FP8 skipping a small layer) leaves a GEMM the fused fronts feed in
    the model dtype: :meth:`WanBlock.unquantized_fronts` names it, those blocks compute the unfused order, and the
    family says so once per loaded model when it builds a pipeline after the precision was applied."""
    import logging
    import types

    from omniloop_quant import fp8
    from omniloop_wan.family import _report_unfused_fronts

    model = _model()
    blocks.install(model)
    assert blocks.unfused_blocks(model) == {name: 2 for name in (
        "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q", "attn1.to_out.0", "attn2.to_out.0", "ffn")}
    fp8.install(list(model.blocks), exclude=lambda path: path == "attn1.to_v")
    assert blocks.unfused_blocks(model) == {"attn1.to_v": 2}
    assert model.blocks[0].unquantized_fronts() == ["attn1.to_v"]

    loaded = types.SimpleNamespace(components={"transformer": model}, config={"norm_quant": "fused"})
    _report_unfused_fronts(loaded)  # no precision applied yet (a bench converting after the build): nothing said
    assert "norm_quant_unfused" not in loaded.config
    loaded.config["linear_precision"] = {"mode": "fp8"}
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("omniloop.wan").addHandler(handler)
    try:
        _report_unfused_fronts(loaded)
        _report_unfused_fronts(loaded)
    finally:
        logging.getLogger("omniloop.wan").removeHandler(handler)
    assert loaded.config["norm_quant_unfused"] == {"transformer.attn1.to_v": 2}
    assert len(records) == 1 and "transformer.attn1.to_v x2" in records[0].getMessage()
    fp8.restore(list(model.blocks))
