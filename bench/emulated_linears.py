"""An experiment for issue 40, not a deploy mode: omniloop-quant's FP8 linears with the GEMM emulated.

Run before an adherence evaluation in the same process (``gpu_fp8lin_flux_demo.sh``'s ``PRELUDE``)::

    PRELUDE='import runpy; runpy.run_path("bench/emulated_linears.py")' EMULATE=e4m3 \\
        RUNS=fp8 bash plugins/compute/quant/scripts/gpu_fp8lin_flux_demo.sh

``linear_precision: fp8`` then installs the same layers with the same scales (per output channel for the
weights, per row — token — for the activations), but each GEMM is the float32 product of the dequantised
operands (the numerical model, ``omniloop_quant.fp8.reference_output``) instead of ``torch._scaled_mm``, and the
rounding grid is ``EMULATE``'s:

* ``e4m3`` — FP8's own grid: against real ``fp8`` on the same device, only the GEMM kernel (its accumulation,
  its epilogue) differs. flux-demo's FP8 shape losses on the GPU (27-29 lost, 12 gained of 432) did not appear
  on the CPU (12 lost, 16 gained with this emulation): this separates the grid from the kernel. On an H100
  (2026-12-07) the emulation lost 28 and gained 12 — as the kernel does, agreeing with it on 411 of 432
  images: the kernel is not the cause (``results/flux-demo-fp8-grid-vs-kernel-h100-s26-2026-12-07.json``);
* ``int8`` — a symmetric INT8 grid (round to nearest, ±127) with the same scale granularity: what 8-bit
  integer GEMMs (``torch._int_mm``, int32 accumulation, exact) would cost in adherence.

``EMULATE_SIDE`` (default ``both``) says which operand goes on the grid: ``weights`` (activations exact), ``activations``
(weights exact) or ``none`` (the harness alone: float32 products of the bf16 operands, a control that should move
nothing). With ``omniloop eval compare --features`` it tells which operand carries FP8's systematic effect on flux-demo
(its objects shrink by ~1 % of their area, ``bench/README.md``, "Session 27").

The fused GELU + quantisation kernel is off (``FUSE_GELU_QUANT = False``): every activation is quantised by
the patched ``quantize_rows``.
"""

from __future__ import annotations

import os

import torch

import omniloop_quant.fp8 as _fp8

EMULATE = os.environ.get("EMULATE", "e4m3")
if EMULATE not in ("e4m3", "int8"):
    raise SystemExit(f"EMULATE={EMULATE!r}: e4m3 or int8")
QMAX = 127.0 if EMULATE == "int8" else _fp8.E4M3_MAX
SIDE = os.environ.get("EMULATE_SIDE", "both")
if SIDE not in ("both", "weights", "activations", "none"):
    raise SystemExit(f"EMULATE_SIDE={SIDE!r}: both, weights, activations or none")


def _grid(v: torch.Tensor) -> torch.Tensor:
    if EMULATE == "int8":
        return torch.round(v).clamp(-QMAX, QMAX)
    return v.clamp(-QMAX, QMAX).to(_fp8.FP8_DTYPE).float()


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wq [out, in] float32 on the grid, scale [1, out])``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=_fp8._TINY_AMAX) / QMAX
    q = _grid(w / scale) if SIDE in ("both", "weights") else w / scale
    return q.contiguous(), scale.reshape(1, -1).contiguous()


def quantize_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(aq [M, K] float32 on the grid, scale [M, 1])``."""
    af = a.float()
    scale = af.abs().amax(dim=-1, keepdim=True).clamp(min=_fp8._TINY_AMAX) / QMAX
    return (_grid(af / scale) if SIDE in ("both", "activations") else af / scale), scale


def forward_quantized(self: _fp8.FP8Linear, xq: torch.Tensor, sx: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    out = (xq.float() * sx) @ self.dequantized_weight().t()
    if self.bias is not None:
        out = out + self.bias.float()
    return out.to(out_dtype)


_fp8.quantize_weight = quantize_weight
_fp8.quantize_rows = quantize_rows
_fp8.FP8Linear.forward_quantized = forward_quantized  # type: ignore[method-assign]
_fp8.FUSE_GELU_QUANT = False
print(f"emulated_linears: fp8 linears as float32 GEMMs on the {EMULATE} grid ({SIDE})", flush=True)
