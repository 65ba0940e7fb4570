"""omniloop-quant's FP8 feed-forward: a diffusers ``FeedForward`` replaced whole by ``FP8FeedForward``
(two FP8 GEMMs, the GELU between), equal op for op to the separate FP8 modules on the CPU, undone by
``restore``; and the Triton GELU + per-row quantisation kernel it uses on CUDA
(``omniloop_quant.kernels``): on a GPU against the torch ops, and under Triton's CPU interpreter when
triton is installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")

from diffusers.models.attention import FeedForward

import omniloop_quant.fp8 as fp8
from omniloop_quant import kernels
from omniloop_quant.fp8 import FP8FeedForward, FP8Linear, install, quantize_rows, restore, unavailable_reason

REPO = Path(__file__).resolve().parents[2]

#: the FP8 modules computed on the CPU (CI's torch takes row-wise scales there; torch 2.11's does not)
cpu_fp8 = pytest.mark.skipif(unavailable_reason("cpu") is not None, reason=f"FP8 on this CPU: {unavailable_reason('cpu')}")


def _block(approximate: str = "tanh", dim: int = 32, inner: int = 96) -> nn.Module:
    torch.manual_seed(0)
    block = nn.Module()
    block.norm = nn.LayerNorm(dim)
    block.ffn = FeedForward(dim, inner_dim=inner, activation_fn="gelu-approximate" if approximate == "tanh" else "gelu")
    return block.eval()


@cpu_fp8
@torch.no_grad()
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_feed_forward_is_replaced_whole_and_equals_the_separate_fp8_modules(approximate):
    block = _block(approximate)
    up, down = block.ffn.net[0].proj, block.ffn.net[2]
    x = torch.randn(2, 7, 32)
    # what the separate modules computed: FP8 up GEMM, GELU, FP8 down GEMM (per-token quantisation each)
    want = FP8Linear(down)(nn.functional.gelu(FP8Linear(up)(x), approximate=approximate))
    original = block.ffn
    report = install([block])
    assert report == {"quantized": 2, "skipped": []}
    assert isinstance(block.ffn, FP8FeedForward) and block.ffn.approximate == approximate
    assert torch.equal(block.ffn(x), want)
    assert install([block])["quantized"] == 2  # already installed: reported, not redone
    assert restore([block]) == 1 and block.ffn is original


@cpu_fp8
@torch.no_grad()
def test_the_kernel_flag_changes_nothing_off_cuda(monkeypatch):
    block = _block()
    install([block])
    x = torch.randn(3, 32)
    assert fp8.FUSE_GELU_QUANT  # on by default (since its H200 run of 2026-12-05)
    monkeypatch.setattr(fp8, "FUSE_GELU_QUANT", False)
    want = block.ffn(x)
    monkeypatch.setattr(fp8, "FUSE_GELU_QUANT", True)
    assert not kernels.supported(torch.zeros(3, 96))  # a CPU tensor: the torch path
    assert torch.equal(block.ffn(x), want)


def test_only_a_plain_gelu_feed_forward_is_taken_whole():
    """GEGLU (two outputs from one projection) or misaligned widths: not an FP8FeedForward; the
    linears inside are handled one by one as before."""
    torch.manual_seed(0)
    geglu = nn.Module()
    geglu.ffn = FeedForward(32, inner_dim=64, activation_fn="geglu")
    report = install([geglu])
    assert not isinstance(geglu.ffn, FP8FeedForward) and report["quantized"] == 2
    restore([geglu])
    odd = nn.Module()
    odd.ffn = FeedForward(24, inner_dim=40, activation_fn="gelu-approximate")
    report = install([odd])
    assert not isinstance(odd.ffn, FP8FeedForward) and report["quantized"] == 0 and len(report["skipped"]) == 2


def test_down_fast_accum_sets_only_the_feed_forward_down_projections():
    """``install(fast_accum=True, down_fast_accum=False)`` (deploy ``fp8-fast-except-down``): fast
    accumulation on every GEMM but the feed-forwards' down projections (``net[2]``, the largest K) --
    in an ``FP8FeedForward`` and in a feed-forward whose linears are swapped one by one (GEGLU, or an
    up projection of unaligned width); without ``down_fast_accum`` the down GEMMs follow ``fast_accum``."""
    torch.manual_seed(0)
    root = nn.Module()
    root.attn = nn.Linear(32, 32)
    root.ffn = FeedForward(32, inner_dim=96, activation_fn="gelu-approximate")
    root.geglu = FeedForward(32, inner_dim=64, activation_fn="geglu")
    root.odd = FeedForward(24, dim_out=32, inner_dim=64, activation_fn="gelu-approximate")  # up 24->64 kept
    report = install([root], fast_accum=True, down_fast_accum=False)
    assert report["quantized"] == 6 and len(report["skipped"]) == 1
    assert isinstance(root.ffn, FP8FeedForward) and root.ffn.up.fast_accum and not root.ffn.down.fast_accum
    assert root.attn.fast_accum and root.geglu.net[0].proj.fast_accum
    for down in (root.geglu.net[2], root.odd.net[2]):
        assert isinstance(down, FP8Linear) and not down.fast_accum
    fast = {name for name, m in root.named_modules() if isinstance(m, FP8Linear) and m.fast_accum}
    assert fast == {"attn", "ffn.up", "geglu.net.0.proj"}
    restore([root])
    for kw, want in (({"fast_accum": True}, True), ({"fast_accum": False}, False),
                     ({"fast_accum": False, "down_fast_accum": True}, True)):
        install([root], **kw)
        assert root.ffn.down.fast_accum is want and root.geglu.net[2].fast_accum is want
        assert root.attn.fast_accum is kw["fast_accum"]
        restore([root])
    ffn = FP8FeedForward(nn.Linear(32, 64), "tanh", nn.Linear(64, 32), fast_accum=True)
    assert ffn.up.fast_accum and ffn.down.fast_accum  # down_fast_accum None: as fast_accum


def test_exclude_keeps_the_matched_modules_and_everything_below_them():
    """``install(exclude=...)`` (``bench/fp8_error.py --groups``): a module whose dotted path under the
    root the predicate accepts is left as it is, and nothing inside it is swapped; the rest is FP8, and
    the report counts only what was swapped."""
    torch.manual_seed(0)
    root = nn.Module()
    root.attn = nn.Module()
    root.attn.to_q, root.attn.to_out = nn.Linear(32, 32), nn.Linear(32, 32)
    root.ffn = FeedForward(32, inner_dim=96, activation_fn="gelu-approximate")
    seen: list[str] = []

    def keep(path: str) -> bool:
        seen.append(path)
        return path in ("attn.to_q", "ffn")

    original_q, original_ffn = root.attn.to_q, root.ffn
    report = install([root], exclude=keep)
    assert report == {"quantized": 1, "skipped": []}
    assert root.attn.to_q is original_q and root.ffn is original_ffn and isinstance(root.attn.to_out, FP8Linear)
    assert not any(p.startswith("ffn.") for p in seen)  # nothing below a kept module is visited
    assert restore([root]) == 1 and isinstance(root.attn.to_out, nn.Linear)


def test_reference_is_gelu_then_quantize_rows():
    h = torch.randn(4, 48) * 3
    q, s = kernels.reference(h, "tanh")
    rq, rs = quantize_rows(nn.functional.gelu(h, approximate="tanh"))
    assert torch.equal(q.float(), rq.float()) and torch.equal(s, rs)
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none'"):
        kernels.gelu_quantize_rows(h, "exact")
    with pytest.raises(ValueError, match="chunk must be 0"):
        kernels.gelu_quantize_rows(h, "tanh", chunk=100)
    with pytest.raises(ValueError, match="num_warps must be 0"):
        kernels.gelu_quantize_rows(h, "tanh", num_warps=3)
    with pytest.raises(ValueError, match="pow2"):
        kernels.gelu_quantize_rows(h, "tanh", chunk=256, pow2=True)


needs_cuda_triton = pytest.mark.skipif(not (torch.cuda.is_available() and kernels.triton_available()),
                                       reason="needs CUDA and triton")


@needs_cuda_triton
@pytest.mark.parametrize(("n", "approximate", "dtype"), [(8960, "tanh", torch.bfloat16), (13824, "tanh", torch.bfloat16),
                                                          (640, "none", torch.float16), (100, "tanh", torch.float32)])
def test_kernel_matches_the_torch_ops_on_the_gpu(n, approximate, dtype):
    torch.manual_seed(0)
    h = (torch.randn(64, n, device="cuda") * 3).to(dtype)
    h[5] = 0  # an all-zero row quantises to zeros with a finite scale
    q, s = kernels.gelu_quantize_rows(h, approximate)
    rq, rs = kernels.reference(h, approximate)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 1)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    # the GELU in float32 may differ from torch's in the last float32 bit, which can move a value
    # across an e4m3 (or bf16) rounding boundary: a few elements, by one e4m3 step
    same = (q.float() == rq.float()).float().mean().item()
    assert same > 0.995, same
    torch.testing.assert_close(q.float() * s, rq.float() * rs, rtol=0.07, atol=float(rs.max()) * 2**-9)
    assert bool((q[5].float() == 0).all())


@needs_cuda_triton
@pytest.mark.parametrize("n", [5120, 1536, 640])  # Wan 14B / 1.3B attention outputs, a small width
def test_the_row_kernel_matches_quantize_rows_on_the_gpu(n):
    """``kernels.quantize_rows`` (the pieces layout without the GELU) against ``fp8.quantize_rows``: the
    same scales; e4m3 values equal but where the kernel's division rounds a value across a rounding boundary."""
    torch.manual_seed(0)
    h = (torch.randn(300, n, device="cuda") * 3).to(torch.bfloat16)
    h[7] = 0
    q, s = kernels.quantize_rows(h)
    rq, rs = fp8.quantize_rows(h)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    assert (q.float() == rq.float()).float().mean().item() > 0.999
    assert bool((q[7].float() == 0).all())


@needs_cuda_triton
@torch.no_grad()
def test_fp8_feed_forward_with_the_kernel_on_the_gpu(monkeypatch):
    torch.manual_seed(1)
    block = nn.Module()
    block.ffn = FeedForward(256, inner_dim=1024, activation_fn="gelu-approximate").to("cuda", torch.bfloat16).eval()
    install([block])
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(fp8, "FUSE_GELU_QUANT", False)
    plain = block.ffn(x)
    monkeypatch.setattr(fp8, "FUSE_GELU_QUANT", True)
    fused = block.ffn(x)
    rel = float((fused.float() - plain.float()).pow(2).mean().sqrt() / plain.float().pow(2).mean().sqrt())
    assert rel < 0.01, rel
    compiled = torch.compile(block.ffn, fullgraph=True)
    torch.testing.assert_close(compiled(x).float(), fused.float(), rtol=0.02, atol=0.02)


_INTERPRETED = """
import sys, torch, triton
from omniloop_quant import kernels
torch.manual_seed(0)
# the chunked kernel loops over the row with range(0, n_cols, CHUNK): Triton 3.6's interpreter fails on
# that loop under NumPy 2.4 ("only 0-dimensional arrays can be converted to Python scalars"; the kernel
# itself runs on the GPU); 3.9's runs it
CHUNKED = ({"chunk": 256}, {"chunk": 1024, "num_warps": 8}) if tuple(map(int, triton.__version__.split(".")[:2])) >= (3, 9) else ()
for dtype in (torch.bfloat16, torch.float32):
    for n, approx in ((8960, "tanh"), (640, "none"), (100, "tanh")):
        h = (torch.randn(6, n) * 3).to(dtype)
        h[2] = 0
        q, s = kernels.gelu_quantize_rows(h, approx)
        rq, rs = kernels.reference(h, approx)
        assert torch.equal(s, rs), (dtype, n, approx)
        a, b = q.float(), rq.float()
        # Triton's interpreter converts to e4m3 by truncation (subnormals, and a value rounding up to a
        # power of two lands one binade low); the GPU rounds to nearest: allow that, nothing more
        assert bool(((a - b).abs() <= b.abs() * 0.5 + 2.0**-9).all()), (dtype, n, approx)
        assert bool((a[2] == 0).all())
        # the launch variants compute the same values: the row in pieces (read twice), other warp counts
        for kw in CHUNKED + ({"num_warps": 2}, {"pow2": True}):
            vq, vs = kernels.gelu_quantize_rows(h, approx, **kw)
            assert torch.equal(vs, s) and torch.equal(vq.float(), q.float()), (dtype, n, approx, kw)
# quantize_rows: the same layout without the GELU
from omniloop_quant import fp8
for n in (640, 100):
    h = (torch.randn(6, n) * 3).to(torch.bfloat16)
    q, s = kernels.quantize_rows(h)
    rq, rs = fp8.quantize_rows(h)
    assert torch.equal(s, rs), n
    a, b = q.float(), rq.float()
    assert bool(((a - b).abs() <= b.abs() * 0.5 + 2.0**-9).all()), n
# an opaque operator with declared shapes: fullgraph compile calls it without tracing into the launch
# (building or launching a Triton kernel inside a traced region broke dynamo on the H200, 2026-12-05)
h = (torch.randn(4, 300) * 3).to(torch.bfloat16)
fn = torch.compile(lambda x: kernels.gelu_quantize_rows(x, "tanh"), backend="aot_eager", fullgraph=True)
(cq, cs), (eq, es) = fn(h), kernels.gelu_quantize_rows(h, "tanh")
assert torch.equal(cq.float(), eq.float()) and torch.equal(cs, es)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (its CPU interpreter)")
def test_pieces_cover_the_row_with_powers_of_two():
    assert kernels.pieces(8960) == (8192, 512, 256, 0)  # Wan 1.3B's FFN: no padding
    assert kernels.pieces(13824) == (8192, 4096, 1024, 512)  # Wan 14B's
    assert kernels.pieces(12288) == (8192, 4096, 0, 0)  # FLUX's
    for n in (1, 63, 64, 65, 100, 300, 640, 1000, 5120, 8959, 8961, 16383, 16384):
        got = [p for p in kernels.pieces(n) if p]
        assert all(p & (p - 1) == 0 and p >= kernels.MIN_PIECE for p in got), (n, got)
        assert got == sorted(got, reverse=True) and n <= sum(got) < n + max(kernels.MIN_PIECE, got[-1]), (n, got)
    with pytest.raises(ValueError, match="column"):
        kernels.pieces(0)


@pytest.mark.parametrize("gelu", [True, False])
def test_the_pieces_kernel_compiles_for_hopper(compile_for_sm90, gelu):
    """The GELU kernel's pieces layout (the FP8 feed-forward) and the same without the GELU
    (``quantize_rows``) at Wan 14B's widths build to a cubin for sm_90 (no GPU needed)."""
    width = (8192, 4096, 1024, 512) if gelu else (4096, 1024, 0, 0)  # 13,824 and 5,120
    sig = {"h_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "n_cols": "i32", "stride_h": "i32", "stride_q": "i32",
           **dict.fromkeys(("P1", "P2", "P3", "P4", "TANH", "ROUND_BF16", "ROUND_F16", "GELU"), "constexpr")}
    consts = {**dict(zip(("P1", "P2", "P3", "P4"), width, strict=True)), "TANH": True, "ROUND_BF16": True,
              "ROUND_F16": False, "GELU": gelu}
    asm = compile_for_sm90(kernels._KERNEL_PIECES, sig, consts, num_warps=kernels.PIECES_WARPS)
    assert asm.get("cubin")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (its CPU interpreter)")
def test_kernel_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "plugins" / "compute" / "quant"), str(REPO / "core"),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _INTERPRETED], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
