"""omniloop-quant's residual + LayerNorm + modulation + e4m3 kernel (``omniloop_quant.norm_kernels``):
against its torch reference — which is diffusers' Wan block arithmetic — under Triton's CPU
interpreter here and on a GPU where there is one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omniloop_quant import norm_kernels as nk

REPO = Path(__file__).resolve().parents[2]


def test_two_pieces_cover_the_row():
    assert nk.two_pieces(1536) == (1024, 512)  # Wan 1.3B's width: no padding
    assert nk.two_pieces(5120) == (4096, 1024)  # 14B's
    assert nk.two_pieces(2048) == (2048, 0)
    for n in (64, 80, 100, 1000, 3072, 16383):
        p1, p2 = nk.two_pieces(n)
        assert p1 <= n <= p1 + p2 or (p2 == 0 and p1 == n), (n, p1, p2)
    with pytest.raises(ValueError, match="column"):
        nk.two_pieces(0)


def test_reference_is_diffusers_wan_block_arithmetic():
    torch.manual_seed(0)
    x = (torch.randn(2, 5, 64) * 2).to(torch.bfloat16)
    delta = torch.randn(2, 5, 64).to(torch.bfloat16)
    gate, scale, shift = (torch.randn(2, 1, 64) for _ in range(3))
    norm = torch.nn.LayerNorm(64, eps=1e-6, elementwise_affine=False)
    r, q, s = nk.reference(x, eps=1e-6, delta=delta, gate=gate, scale=scale, shift=shift)
    want_r = (x.float() + delta * gate).type_as(x)
    want_n = (norm(want_r.float()) * (1 + scale) + shift).type_as(x).reshape(-1, 64).float()
    assert torch.equal(r, want_r)
    assert torch.equal(s, want_n.abs().amax(-1, keepdim=True) / 448)
    assert torch.equal(q.float(), (want_n / s).clamp(-448, 448).to(torch.float8_e4m3fn).float())


def test_arguments_are_checked_before_any_launch():
    x = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    v = torch.zeros(1, 1, 64)
    for kwargs, match in (({"scale": v}, "scale and shift"), ({"gate": v}, "gate scales the delta"),
                          ({"weight": torch.ones(64)}, "weight and bias"), ({"eps": float("nan")}, "eps"),
                          ({"delta": torch.zeros(1, 3, 64, dtype=torch.bfloat16)}, "delta"),
                          ({"scale": torch.zeros(3, 64), "shift": torch.zeros(3, 64)}, "scale")):
        with pytest.raises(ValueError, match=match):
            nk.residual_norm_quantize_rows(x, **{"eps": 1e-6, **kwargs})
    assert not nk.supported(x)  # a CPU tensor


def _sites(b: int, length: int, n: int, device: str) -> list[tuple[str, torch.Tensor, dict]]:
    """Wan's three sites: norm1 + modulation; residual x gate + affine norm2; residual + norm3 + modulation."""
    torch.manual_seed(0)
    x = (torch.randn(b, length, n, device=device) * 2).to(torch.bfloat16)
    delta = torch.randn(b, length, n, device=device).to(torch.bfloat16)
    gate, scale, shift = (torch.randn(b, 1, n, device=device) * 0.3 for _ in range(3))
    weight, bias = torch.randn(n, device=device) * 0.5 + 1, torch.randn(n, device=device) * 0.1
    return [("norm1", x, {"scale": scale, "shift": shift}),
            ("norm2", x, {"delta": delta, "gate": gate, "weight": weight, "bias": bias}),
            ("norm3", x, {"delta": delta, "scale": scale, "shift": shift})]


@pytest.mark.skipif(not (torch.cuda.is_available() and nk.supported(torch.zeros(1, 1, 64, dtype=torch.bfloat16,
                                                                               device="cuda" if torch.cuda.is_available() else "cpu"))),
                    reason="needs CUDA and triton")
@pytest.mark.parametrize("n", [1536, 5120, 200 * 16])
def test_kernel_matches_the_torch_ops_on_the_gpu(n):
    for site, x, kw in _sites(2, 300, n, "cuda"):
        r, q, s = nk.residual_norm_quantize_rows(x, eps=1e-6, **kw)
        rr, rq, rs = nk.reference(x, eps=1e-6, **kw)
        if rr is not None:  # the residual: float32 sums may fuse (FMA), one bf16 step at most
            diff = (r.float() - rr.float()).abs()
            assert float((diff == 0).float().mean()) > 0.999 and bool((diff <= rr.float().abs() * 2**-7).all()), site
        torch.testing.assert_close(s, rs, rtol=2**-7, atol=0, msg=site)
        assert float((q.float() == rq.float()).float().mean()) > 0.99, site
        # where the normed bf16 value differs by a step (FMA), its e4m3 may round one e4m3 step away:
        # up to 2**-3 of the value at the bottom of a binade (3 mantissa bits; H100, 2026-12-05: the
        # first form of this check, rtol 0.07, failed there on a few of the 1e6 values, which share > 0.99)
        torch.testing.assert_close(q.float() * s, rq.float() * rs, rtol=2**-3 + 2**-6, atol=float(rs.max()) * 2**-8,
                                   msg=site)
    fn = torch.compile(lambda x, kw: nk.residual_norm_quantize_rows(x, eps=1e-6, **kw), fullgraph=True)
    site, x, kw = _sites(1, 64, n, "cuda")[2]
    (cr, cq, cs), (er, eq, es) = fn(x, kw), nk.residual_norm_quantize_rows(x, eps=1e-6, **kw)
    assert torch.equal(cr, er) and torch.equal(cq.float(), eq.float()) and torch.equal(cs, es)


_INTERPRETED = """
import torch
from omniloop_quant import norm_kernels as nk
from test_norm_kernel import _sites as sites
for n in (1536, 200):
    for site, x, kw in sites(2, 5, n, "cpu"):
        r, q, s = nk.residual_norm_quantize_rows(x, eps=1e-6, **kw)
        rr, rq, rs = nk.reference(x, eps=1e-6, **kw)
        # Triton's interpreter converts float32 to bf16 and e4m3 by truncation (the GPU rounds to
        # nearest; a value rounding up to a power of two lands one binade low): one bf16 step on the
        # residual and the normed row, one e4m3 step on most of q, half a value on a few; near zero, one
        # bf16 step of the residual moves the normed value by up to ~amax / 64 (amax = 448 * scale)
        if rr is not None:
            assert bool(((r.float() - rr.float()).abs() <= rr.float().abs() * 2**-7).all()), site
        assert bool(((s - rs).abs() <= rs * 2**-6).all()), site
        a, b = q.float() * s, rq.float() * rs
        assert bool(((a - b).abs() <= b.abs() * 0.52 + rs * 7).all()), (site, n)
        near = ((a - b).abs() <= b.abs() * 0.14 + rs * 2**-8).float().mean().item()
        assert near > 0.97, (site, n, near)
# an opaque operator with declared shapes: fullgraph compile calls it without tracing into the launch
site, x, kw = sites(1, 3, 96, "cpu")[1]
fn = torch.compile(lambda x: nk.residual_norm_quantize_rows(x, eps=1e-6, **kw), backend="aot_eager", fullgraph=True)
(cr, cq, cs), (er, eq, es) = fn(x), nk.residual_norm_quantize_rows(x, eps=1e-6, **kw)
assert torch.equal(cr, er) and torch.equal(cq.float(), eq.float()) and torch.equal(cs, es)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (its CPU interpreter)")
def test_kernel_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(REPO / "plugins" / "compute" / "quant"),
                                           str(REPO / "core"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _INTERPRETED], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
