"""omniloop-kit's joint (MMDiT) attention processor against diffusers' own processors.

* Declared as FLUX (context first, ``[B, L, H, D]``, contiguous split) it equals diffusers'
  ``FluxAttnProcessor`` bit for bit with the core ``sdpa`` backend on CPU float32: double-stream
  (separate and diffusers-fused projections) and single-stream (``pre_only``) modules, rotary on.
* Declared as SD3 (context last, ``[B, H, L, D]``) it equals ``JointAttnProcessor2_0`` bit for bit:
  with and without RMS q/k norms, ``context_pre_only``, the image-only ``attn2``.
* ``fused_qkv`` (one GEMM over the buffers ``fuse_projections`` registers) is the same math with
  another GEMM shape: compared within 1e-5 (CPU float32), the buffers non-persistent and dropped by
  ``uninstall``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.builtin import sdpa
from omniloop.errors import DeployError
from omniloop.family import AttentionBackendSpec
from omniloop_kit import attention as kit

DIM, HEADS, HEAD_DIM, N_IMG, N_CTX = 32, 2, 16, 12, 5


class FluxLayout(kit.JointAttnProcessor):
    context_first = True
    heads_first = False
    contiguous_split = True


class SD3Layout(kit.JointAttnProcessor):
    context_first = False
    heads_first = True


def _tokens(seed: int, n: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, n, DIM, generator=torch.Generator().manual_seed(seed))


def _flux_attention(double: bool) -> Any:
    from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor

    torch.manual_seed(1)
    kw: dict[str, Any] = (dict(added_kv_proj_dim=DIM, context_pre_only=False, bias=True) if double
                          else dict(pre_only=True, bias=True))
    attn = FluxAttention(query_dim=DIM, heads=HEADS, dim_head=HEAD_DIM, out_dim=DIM, eps=1e-6,
                         processor=FluxAttnProcessor(), **kw).eval()
    for p in attn.parameters():  # RMS norm weights off their ones
        torch.nn.init.normal_(p, std=0.3)
    return attn


def _rotary(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    ids = torch.stack([torch.zeros(n), torch.arange(float(n)), torch.arange(float(n)) % 3], dim=-1)
    return FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])(ids)


def _sd3_attention(qk_norm: str | None, context: bool, context_pre_only: bool = False) -> Any:
    from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0

    torch.manual_seed(2)
    kw: dict[str, Any] = dict(added_kv_proj_dim=DIM, context_pre_only=context_pre_only) if context else {}
    attn = Attention(query_dim=DIM, cross_attention_dim=None, dim_head=HEAD_DIM, heads=HEADS, out_dim=DIM, bias=True,
                     processor=JointAttnProcessor2_0(), qk_norm=qk_norm, eps=1e-6, **kw).eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return attn


def _run(attn: Any, proc: Any, **kw: Any) -> Any:
    saved = attn.processor
    attn.set_processor(proc)
    try:
        with torch.no_grad():
            return attn(**kw)
    finally:
        attn.set_processor(saved)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b)


@pytest.mark.parametrize("fused", [False, True])
def test_flux_layout_equals_flux_attn_processor(fused: bool) -> None:
    double = _flux_attention(double=True)
    if fused:
        double.fuse_projections()  # diffusers' own to_qkv / to_added_qkv
    x, ctx = _tokens(0, N_IMG), _tokens(1, N_CTX)
    kw = dict(hidden_states=x, encoder_hidden_states=ctx, image_rotary_emb=_rotary(N_CTX + N_IMG))
    with torch.no_grad():
        want = double(**kw)
    got = _run(double, FluxLayout(sdpa, "sdpa"), **kw)
    assert isinstance(got, tuple) and got[0].shape == x.shape and got[1].shape == ctx.shape
    assert _equal(got, want)

    single = _flux_attention(double=False)  # pre_only: no output projection, no context
    joint = torch.cat([ctx, x], dim=1)
    kw = dict(hidden_states=joint, image_rotary_emb=_rotary(N_CTX + N_IMG))
    with torch.no_grad():
        want = single(**kw)
    assert _equal(_run(single, FluxLayout(sdpa, "sdpa"), **kw), want)


@pytest.mark.parametrize(("qk_norm", "context", "context_pre_only"),
                         [(None, True, False), ("rms_norm", True, False), ("rms_norm", True, True),
                          ("rms_norm", False, False)])
def test_sd3_layout_equals_joint_attn_processor(qk_norm: str | None, context: bool, context_pre_only: bool) -> None:
    attn = _sd3_attention(qk_norm, context, context_pre_only)
    kw: dict[str, Any] = dict(hidden_states=_tokens(0, N_IMG))
    if context:
        kw["encoder_hidden_states"] = _tokens(1, N_CTX)
    with torch.no_grad():
        want = attn(**kw)
    assert _equal(_run(attn, SD3Layout(sdpa, "sdpa"), **kw), want)


def test_the_backend_sees_the_joint_sequence_heads_first() -> None:
    shapes: list[tuple[int, ...]] = []

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        shapes.append(tuple(q.shape))
        return sdpa(q, k, v, **kw)

    x, ctx = _tokens(0, N_IMG), _tokens(1, N_CTX)
    _run(_sd3_attention("rms_norm", True), SD3Layout(fn), hidden_states=x, encoder_hidden_states=ctx)
    _run(_flux_attention(True), FluxLayout(fn), hidden_states=x, encoder_hidden_states=ctx,
         image_rotary_emb=_rotary(N_CTX + N_IMG))
    assert shapes == [(2, HEADS, N_IMG + N_CTX, HEAD_DIM)] * 2


@pytest.mark.parametrize("layout", [FluxLayout, SD3Layout])
def test_fused_qkv_buffers_are_close_to_separate_projections(layout: type[kit.JointAttnProcessor]) -> None:
    attn = _flux_attention(True) if layout is FluxLayout else _sd3_attention("rms_norm", True)
    x, ctx = _tokens(0, N_IMG), _tokens(1, N_CTX)
    kw: dict[str, Any] = dict(hidden_states=x, encoder_hidden_states=ctx)
    if layout is FluxLayout:
        kw["image_rotary_emb"] = _rotary(N_CTX + N_IMG)
    want = _run(attn, layout(sdpa), **kw)

    holder = torch.nn.Module()
    holder.attn = attn
    keys = set(attn.state_dict())
    assert kit.install_joint(holder, [attn], layout, AttentionBackendSpec(name="sdpa-test", fn=sdpa),
                             fused_qkv=True) == 1
    weight = attn.omniloop_qkv_weight
    assert weight.shape == (3 * DIM, DIM) and attn.omniloop_add_qkv_weight.shape == (3 * DIM, DIM)
    assert set(attn.state_dict()) == keys  # non-persistent: checkpoints and weight updates never see them
    kit.fuse_projections(attn)
    assert attn.omniloop_qkv_weight is weight  # registered once
    assert kit.installed(holder) == "sdpa-test" and attn.processor.fused_qkv
    with torch.no_grad():
        got = attn(**kw)
    # one GEMM over [Wq; Wk; Wv]: same math, another GEMM shape (CPU float32: ~1e-7 relative)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)

    from diffusers.models.attention_processor import JointAttnProcessor2_0

    kit.uninstall(holder, [attn], JointAttnProcessor2_0)
    assert kit.installed(holder) is None and isinstance(attn.processor, JointAttnProcessor2_0)
    assert not any(name.startswith("omniloop_") for name in attn._buffers)


def test_a_two_dimensional_mask_is_broadcast_over_heads_and_queries() -> None:
    attn = _sd3_attention(None, False)
    x = _tokens(0, N_IMG)
    mask = torch.ones(2, N_IMG, dtype=torch.bool)
    mask[:, -3:] = False
    seen: list[torch.Tensor] = []

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        seen.append(kw["attn_mask"])
        return sdpa(q, k, v, **kw)

    _run(attn, SD3Layout(fn), hidden_states=x, attention_mask=mask)
    assert seen[0].shape == (2, 1, 1, N_IMG)


def test_qkv_option_and_the_adapters_check() -> None:
    assert kit.qkv_option({}) == "separate" and kit.qkv_option({"qkv": "fused"}) == "fused"
    with pytest.raises(DeployError, match=r"^options\.qkv: must be one of separate, fused, not 'both'$"):
        kit.qkv_option({"qkv": "both"})
    kit.refuse_fused_qkv(None, {"qkv": "separate"})
    with pytest.raises(DeployError, match=r"^adapters: options\.qkv 'fused' computes Q/K/V without"):
        kit.refuse_fused_qkv(None, {"qkv": "fused"})
