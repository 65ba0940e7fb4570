"""``options.qk_norm_rope: fused`` — QK RMS norm + rotary embedding in one Triton kernel.

On CPU: the option is checked at load (bad value, no CUDA → one ``DeployError`` naming it) and the
reference path is untouched. On a GPU (``gpu`` mark): the kernel against the eager math on
realistic Wan shapes, inside ``torch.compile(fullgraph=True)``, and a whole tiny-Wan generation
against the reference path, each with its tolerance stated.
"""

from __future__ import annotations

import pytest
import torch

from omniloop.errors import DeployError
from omniloop.runtime import Runtime
from omniloop_wan import fused

from .conftest import wan_manager


@pytest.mark.parametrize("value", ["triton", True, 1])
def test_bad_value_is_refused_at_load(tiny_ckpt, value):
    with pytest.raises(DeployError, match=r"options\.qk_norm_rope: must be one of reference, fused"):
        Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), options={"qk_norm_rope": value})


def test_fused_on_a_cpu_deployment_is_refused_before_loading(tiny_ckpt):
    with pytest.raises(DeployError, match=r"options\.qk_norm_rope: 'fused' cannot run here: it needs a CUDA device"):
        Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), options={"qk_norm_rope": "fused"})


def test_reference_is_the_default_and_recorded(wan_runtime):
    rt = wan_runtime("t2v")
    assert rt.model.config["qk_norm_rope"] == "reference"
    procs = {repr(m.processor) for m in rt.model.components["transformer"].modules() if hasattr(m, "processor")}
    assert procs == {"WanBackendAttnProcessor(backend='sdpa', qk_norm_rope='reference')"}


def test_supported_only_takes_cuda_rows_with_an_across_heads_norm():
    x = torch.zeros(1, 8, 12)
    cos = torch.zeros(1, 8, 1, 4)
    assert not fused.supported(x, torch.nn.RMSNorm(12), cos, heads=3)  # CPU tensor
    assert fused.unavailable_reason("cpu") is not None


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim,tokens", [(12, 128, 4680), (40, 128, 1560)])  # 1.3B and 14B widths
def test_kernel_matches_the_eager_math_in_bf16_and_fp32(heads, head_dim, tokens):
    """bf16: the kernel rounds once (after the rotation); eager also rounds the normed values (and
    the products when the angles are bf16), so the two differ by bf16 rounding: relative RMS
    <= 1e-2 (measured 4.1-4.6e-3 with Triton's interpreter; one bf16 ulp is 2^-8). fp32: <= 1e-6."""
    if fused.unavailable_reason("cuda"):
        pytest.skip(fused.unavailable_reason("cuda"))
    torch.manual_seed(0)
    C = heads * head_dim
    angles = torch.randn(1, tokens, 1, head_dim // 2, device="cuda").repeat_interleave(2, dim=-1)
    cos, sin = angles.cos(), angles.sin()
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-6)):
        norm = torch.nn.RMSNorm(C, eps=1e-6, device="cuda", dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(C))
        qkv = torch.randn(2, tokens, 3 * C, device="cuda", dtype=dtype)
        q = qkv.chunk(3, dim=-1)[0]  # a fused-QKV chunk: rows are strided
        assert fused.supported(q, norm, cos, heads)
        out = fused.qk_norm_rope(q, norm, cos, sin, heads)
        ref = fused.reference(q, norm, cos.to(dtype), sin.to(dtype), heads)
        assert out.shape == ref.shape == (2, tokens, heads, head_dim) and out.dtype == dtype
        assert _rel_rms(out, ref) <= tol, (dtype, _rel_rms(out, ref))
        compiled = torch.compile(lambda x, n=norm: fused.qk_norm_rope(x, n, cos, sin, heads), fullgraph=True)
        got = compiled(q)  # the launch is captured into the graph (fullgraph: no break)
        assert _rel_rms(got, ref) <= tol and _rel_rms(got, out) <= tol, (dtype, _rel_rms(got, ref), _rel_rms(got, out))


def test_reference_without_freqs_is_the_norm_alone():
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(12, eps=1e-6)
    x = torch.randn(2, 5, 12)
    assert torch.equal(fused.reference(x, norm, None, None, heads=3), norm(x).unflatten(2, (3, 4)))


@pytest.mark.parametrize("rope", [True, False])
def test_the_kernel_compiles_for_hopper_with_and_without_the_rotation(compile_for_sm90, rope):
    """The kernel writing e4m3 at Wan 14B's width builds to a cubin for sm_90 (no GPU needed): with the
    rotation (self-attention) and without (cross-attention's norm alone)."""
    table = "*fp32" if rope else "*bf16"  # without the rotation the tables are placeholders (x itself)
    sig = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "w_ptr": "*bf16", "cos_ptr": table, "sin_ptr": table,
           "scale_ptr": "*fp32", "x_row_stride": "i32", "seq_len": "i32", "eps": "fp32",
           **dict.fromkeys(("C", "HALF_D", "BLOCK", "SCALED", "ROPE"), "constexpr")}
    asm = compile_for_sm90(fused.KERNEL.get(), sig, {"C": 5120, "HALF_D": 64, "BLOCK": 4096, "SCALED": True, "ROPE": rope},
                           num_warps=8)
    assert asm.get("cubin")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32760, 512])  # Wan 14B cross-attention: the video query, the text key
def test_the_kernel_without_freqs_is_the_norm_in_bf16_and_in_e4m3(tokens):
    """Cross-attention (no rotation): ``qk_norm_rope`` with no freqs is ``norm(x)`` (bf16: rounding once,
    relative RMS <= 1e-2 as above) and ``qk_norm_rope_fp8`` writes it in e4m3 with the static descale
    (relative RMS <= 0.04, e4m3's 3 mantissa bits), eagerly and inside ``torch.compile(fullgraph=True)``."""
    if fused.unavailable_reason("cuda"):
        pytest.skip(fused.unavailable_reason("cuda"))
    torch.manual_seed(0)
    heads, C = 40, 5120
    norm = torch.nn.RMSNorm(C, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(C))
    kv = torch.randn(1, tokens, 2 * C, device="cuda", dtype=torch.bfloat16)
    k = kv.chunk(2, dim=-1)[0]  # a fused-KV chunk: rows are strided
    assert fused.supported(k, norm, None, heads)
    ref = fused.reference(k.float(), norm.float(), None, None, heads)
    out = fused.qk_norm_rope(k, norm, None, None, heads)
    assert out.shape == ref.shape and _rel_rms(out, ref) <= 1e-2
    fused.prepare()
    k8, d = fused.qk_norm_rope_fp8(k, norm, None, None, heads)
    assert k8.dtype == torch.float8_e4m3fn and k8.shape == (1, tokens, heads, C // heads)
    assert _rel_rms(k8.float() * d, ref) <= 0.04
    compiled = torch.compile(lambda x: fused.qk_norm_rope_fp8(x, norm, None, None, heads), fullgraph=True)
    with torch.no_grad():  # inference, as the model runs it: the e4m3 op has no autograd formula
        c8, cd = compiled(k)
    assert torch.equal(c8.view(torch.uint8), k8.view(torch.uint8)) and torch.equal(cd, d)


@pytest.mark.gpu
def test_tiny_wan_with_the_fused_kernel_matches_the_reference_path(tiny_ckpt, t2v_request):
    """Whole generation, bf16 on CUDA, eager and compiled: final latents within relative RMS 2e-2 of
    the reference path (the per-call rounding difference above, carried through 4 steps)."""
    if fused.unavailable_reason("cuda"):
        pytest.skip(fused.unavailable_reason("cuda"))
    deploy = {"device": "cuda", "dtype": "bfloat16"}
    ref = Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), **deploy).generate(t2v_request(steps=4))
    for compile_ in (False, True):
        rt = Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), compile=compile_,
                                options={"qk_norm_rope": "fused"}, **deploy)
        assert rt.model.config["qk_norm_rope"] == "fused"
        out = rt.generate(t2v_request(steps=4))
        assert out.ok, out.error
        err = _rel_rms(out.artifacts["latents"].tensor, ref.artifacts["latents"].tensor)
        assert err <= 2e-2, (compile_, err)


# -- options.ffn_gelu: fused ------------------------------------------------------------------------


def test_ffn_gelu_fused_on_a_cpu_deployment_is_refused(tiny_ckpt):
    with pytest.raises(DeployError, match=r"options\.ffn_gelu: 'fused' cannot run here: it needs a CUDA device"):
        Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), options={"ffn_gelu": "fused"})
    with pytest.raises(DeployError, match=r"options\.ffn_gelu: must be one of reference, fused"):
        Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), options={"ffn_gelu": "yes"})


def test_ffn_swap_keeps_the_parameters_and_restores(wan_runtime):
    from omniloop_wan import ffn

    tf = wan_runtime("t2v").model.components["transformer"]
    keys = list(tf.state_dict())
    before = [b.ffn.net[0] for b in tf.blocks]
    x = torch.randn(1, 5, tf.blocks[0].ffn.net[0].proj.in_features)
    ref = tf.blocks[0].ffn(x)
    try:
        assert ffn.install(tf) == len(tf.blocks) and ffn.installed(tf)
        assert ffn.install(tf) == len(tf.blocks)  # idempotent
        assert all(isinstance(b.ffn.net[0], ffn.FusedGeluProjection) for b in tf.blocks)
        assert list(tf.state_dict()) == keys  # same parameters under the same names
        assert torch.equal(tf.blocks[0].ffn(x), ref)  # off CUDA it runs the reference ops
    finally:
        assert ffn.restore(tf) == len(tf.blocks)
    assert [b.ffn.net[0] for b in tf.blocks] == before and not ffn.installed(tf)


@pytest.mark.gpu
def test_fused_gelu_projection_matches_diffusers_within_bf16_rounding():
    """The epilogue applies GELU to the float32 accumulator; diffusers rounds to bf16 first:
    relative RMS <= 1e-2 in bf16 (one bf16 ulp is 2^-8), <= 1e-5 in float32 (TF32 off)."""
    from diffusers.models.activations import GELU

    from omniloop_wan.ffn import FusedGeluProjection

    torch.manual_seed(0)
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        ref_mod = GELU(1536, 8960, approximate="tanh").to("cuda", dtype)
        x = torch.randn(2, 4680, 1536, device="cuda", dtype=dtype)
        with torch.no_grad():
            ref = ref_mod(x)
            out = FusedGeluProjection(ref_mod)(x)
            compiled = torch.compile(FusedGeluProjection(ref_mod), fullgraph=True)(x)
        assert out.shape == ref.shape and out.dtype == dtype
        assert _rel_rms(out, ref) <= tol, (dtype, _rel_rms(out, ref))
        assert _rel_rms(compiled, out) <= tol, (dtype, _rel_rms(compiled, out))


@pytest.mark.gpu
def test_tiny_wan_with_both_fused_options_matches_the_reference_path(tiny_ckpt, t2v_request):
    """bf16 on CUDA, compiled: final latents within relative RMS 2e-2 of the reference path."""
    if fused.unavailable_reason("cuda"):
        pytest.skip(fused.unavailable_reason("cuda"))
    deploy = {"device": "cuda", "dtype": "bfloat16"}
    ref = Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), **deploy).generate(t2v_request(steps=4))
    rt = Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), compile=True,
                            options={"qk_norm_rope": "fused", "ffn_gelu": "fused"}, **deploy)
    assert (rt.model.config["qk_norm_rope"], rt.model.config["ffn_gelu"]) == ("fused", "fused")
    out = rt.generate(t2v_request(steps=4))
    assert out.ok, out.error
    assert _rel_rms(out.artifacts["latents"].tensor, ref.artifacts["latents"].tensor) <= 2e-2
