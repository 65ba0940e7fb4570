"""omniloop-kit's joint q/k norm + rotary kernel (``omniloop_kit.qk_norm_rope``); FLUX.1's use of it:
tests/flux/test_qk_norm_rope.py.

* Always: the option's values and refusals (``fused`` off CUDA without Triton's interpreter, unknown
  values); ``supported`` refuses what the kernel does not do; the kernel builds for sm_90 (no GPU).
* Under Triton's CPU interpreter (``TRITON_INTERPRET=1``, a child pytest process): the kernel against
  the eager ops (float32 within 1e-6 of the largest value: the same float32 math, another order of the
  mean's sum; bfloat16 within two bf16 ulps of the largest value: the interpreter truncates float32 to
  bfloat16 where a GPU rounds to nearest, and the kernel rounds twice, after the norm and at the end).
* CUDA: the kernel in bfloat16 at FLUX.1-dev's shapes, eagerly and inside ``torch.compile``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from omniloop.errors import DeployError
from omniloop.testing.pytest_plugin import HAS_TRITON, interpreted
from omniloop.testing.pytest_plugin import IN_TRITON_INTERPRETER as IN_INTERPRETER
from omniloop_kit import qk_norm_rope as knr


def _case(dtype: torch.dtype, heads: int = 3, d: int = 8, device: str = "cpu", lens: tuple[int, int] = (7, 5),
          seed: int = 0):
    """A strided context part (a chunk of a fused projection), a contiguous sample part, their norms and
    diffusers-style ``(cos, sin)`` tables of the joint sequence."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(2, lens[0], 3 * heads * d, generator=g).to(device=device, dtype=dtype)
    a = big[..., : heads * d]
    b = torch.randn(2, lens[1], heads * d, generator=g).to(device=device, dtype=dtype)
    norms = []
    for _ in range(2):
        n = torch.nn.RMSNorm(d, eps=1e-6).to(device=device, dtype=dtype)
        with torch.no_grad():
            n.weight.copy_(torch.rand(d, generator=g) + 0.5)
        norms.append(n)
    angle = torch.randn(sum(lens), d // 2, generator=g)
    rotary = (angle.cos().repeat_interleave(2, -1).to(device), angle.sin().repeat_interleave(2, -1).to(device))
    return a, b, norms, rotary


def _tolerance(dtype: torch.dtype, ref: torch.Tensor, ulps: int = 1) -> float:
    if dtype == torch.float32:
        return 1e-6 * max(1.0, ref.abs().max().item())
    return ulps * 2.0 ** (torch.frexp(ref.abs().max().float()).exponent.item() - 8)  # bf16 ulps of the largest value


# -- always ---------------------------------------------------------------------------------------


def test_option_values_and_refusals(monkeypatch) -> None:
    monkeypatch.setattr(knr, "INTERPRETED", False)
    assert knr.qk_norm_rope_option({}, "cpu") == "reference"
    assert knr.qk_norm_rope_option({"qk_norm_rope": "reference"}, "cpu") == "reference"
    with pytest.raises(DeployError, match=r"^options\.qk_norm_rope: must be one of reference, fused, not 'triton'$"):
        knr.qk_norm_rope_option({"qk_norm_rope": "triton"}, "cpu")
    with pytest.raises(DeployError, match=r"^options\.qk_norm_rope: 'fused' cannot run: "):
        knr.qk_norm_rope_option({"qk_norm_rope": "fused"}, "cpu")


def test_supported_refuses_what_the_kernel_does_not_do(monkeypatch) -> None:
    monkeypatch.setattr(knr, "INTERPRETED", True)  # CPU tensors count as the kernel's device here
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    a, b, norms, rotary = _case(torch.float32)
    assert knr.supported([a, b], norms, rotary, 3)
    assert knr.supported([a, b], [None, None], None, 3)
    assert not knr.supported([a, b, b], [*norms, norms[0]], rotary, 3)  # three parts
    assert not knr.supported([a, b], norms, (rotary[0][:5], rotary[1][:5]), 3)  # tables of another length
    assert not knr.supported([a.transpose(1, 2)], norms[:1], None, 3)  # 2-D-ish: channels not contiguous
    assert not knr.supported([a, b], [norms[0], None], rotary, 3)  # one part without its norm
    assert not knr.supported([a, b.double()], norms, rotary, 3)  # mixed dtypes
    off = copy.deepcopy(norms[0]).to(torch.float64)  # a weight not in the parts' dtype (or device: offloaded)
    assert not knr.supported([a, b], [off, norms[1]], rotary, 3)
    six = torch.randn(1, 4, 3 * 6)
    assert not knr.supported([six], [torch.nn.RMSNorm(6)], None, 3)  # head dim 6: not a power of two
    monkeypatch.setattr(knr, "INTERPRETED", False)
    assert not knr.supported([a, b], norms, rotary, 3)  # CPU without the interpreter


def test_supported_traces_without_a_graph_break(monkeypatch) -> None:
    """The processor calls ``supported`` inside compiled blocks (``fullgraph=True``): plain reads only."""
    monkeypatch.setattr(knr, "INTERPRETED", True)
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    a, b, norms, rotary = _case(torch.float32)

    def check(a, b, cos, sin):
        return a.sum() if knr.supported([a, b], norms, (cos, sin), 3) else b.sum()

    torch._dynamo.reset()
    compiled = torch.compile(check, fullgraph=True, backend="eager")
    assert torch.equal(compiled(a, b, *rotary), a.sum())


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("dtype, heads, d", [("bf16", 24, 128), ("fp32", 3, 8)])
def test_the_kernel_compiles_for_hopper(compile_for_sm90, rope, dtype, heads, d) -> None:
    """The launches :func:`joint_norm_rope` makes build to a cubin for sm_90 (no GPU needed): FLUX.1's
    bf16 24 heads x 128 (4 heads a program) and a tiny float32 3 x 8 (one head a program, one warp)."""
    table = "*fp32" if rope else f"*{dtype}"
    sig = {**{f"{n}_ptr": f"*{dtype}" for n in ("a", "b", "wa", "wb", "out")}, "cos_ptr": table, "sin_ptr": table,
           "a_bstride": "i32", "a_tstride": "i32", "b_bstride": "i32", "b_tstride": "i32", "n_a": "i32",
           "seq_len": "i32", "eps_a": "fp32", "eps_b": "fp32",
           **dict.fromkeys(("H", "D", "BLOCK_H", "NORM", "ROPE"), "constexpr")}
    block_h = knr.heads_per_program(heads, d)
    asm = compile_for_sm90(knr.KERNEL.get(), sig, {"H": heads, "D": d, "BLOCK_H": block_h, "NORM": True, "ROPE": rope},
                           num_warps=knr.warps_for(block_h, d))
    assert asm.get("cubin")


# -- Triton's interpreter ---------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_eager_ops_interpreted(dtype) -> None:
    a, b, norms, rotary = _case(dtype)
    for parts, ns, rot in (([a, b], norms, rotary),  # a double block's query: two parts, rotated
                           ([a], norms[:1], (rotary[0][:7], rotary[1][:7])),  # a single block's
                           ([a, b], [None, None], None),  # the value: the concatenation alone
                           ([b], norms[1:], None)):  # norm only
        out = knr.joint_norm_rope(parts, ns, rot, 3)
        ref = knr.reference(parts, ns, rot, 3)
        assert out.shape == ref.shape and out.is_contiguous() and out.dtype == dtype
        # the interpreter truncates float32 -> bf16 (a GPU rounds to nearest): two roundings, two ulps
        assert (out.float() - ref.float()).abs().max().item() <= _tolerance(dtype, ref, ulps=2), (len(parts), rot is None)


@pytest.mark.skipif(not HAS_TRITON or IN_INTERPRETER, reason="triton is not installed / this is the interpreter run")
def test_interpreted_tests_in_a_child_process(run_interpreted_child) -> None:
    """The ``*_interpreted`` tests above, in a fresh pytest process started with TRITON_INTERPRET=1."""
    run_interpreted_child(__file__)


# -- CUDA -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_flux_dev_shapes_in_bf16_cuda(compiled) -> None:
    """FLUX.1-dev 1024²: a double block's query (512 context + 4,096 image tokens, chunks of fused
    projections) and a single block's (4,608 tokens), within one bf16 ulp of the eager ops."""
    if knr.unavailable_reason("cuda") or IN_INTERPRETER:
        pytest.skip(knr.unavailable_reason("cuda") or "interpreter run")
    torch.manual_seed(0)
    heads, d = 24, 128
    a, b, norms, rotary = _case(torch.bfloat16, heads=heads, d=d, device="cuda", lens=(512, 4096))
    fn = torch.compile(knr.joint_norm_rope, fullgraph=True) if compiled else knr.joint_norm_rope
    knr.prepare()
    for parts, ns, rot in (([a, b], norms, rotary), ([b], norms[1:], (rotary[0][:4096], rotary[1][:4096]))):
        out = fn(parts, ns, rot, heads)
        ref = knr.reference(parts, ns, rot, heads)
        diff = (out.float() - ref.float()).abs()
        assert diff.max().item() <= _tolerance(torch.bfloat16, ref)
        assert (diff > 0).float().mean().item() < 0.01  # nearly every element equal
