"""An experiment for issue 40, not a deploy mode: FP8 linears whose weight rounding is corrected in the mean.

Session 27 found that FP8's systematic effect on flux-demo (objects ~1 % smaller, centroids moved by ~0.1 pixel, on
the GPU and the CPU alike) comes from the **weights'** e4m3 rounding, not the activations'
(``bench/emulated_linears.py`` with ``EMULATE_SIDE``): a rounded weight is a fixed change of the model, and its
error ``E = W - Wq`` times the inputs' mean is a bias every token of every image gets (bias correction, Nagel et al.
2019, "Data-Free Quantization Through Weight Equalization and Bias Correction").

Run before an adherence evaluation (``PRELUDE``, or ``python -c``)::

    python -c 'import runpy; runpy.run_path("bench/fp8_mean_correction.py"); import sys; \\
        from omniloop_wan_demo.cli import adherence; adherence(sys.argv[1:])' --model flux-demo --linear-precision fp8 ...

Each ``FP8Linear`` then keeps its weight's rounding error ``E`` (float32) and adds ``mean(x) @ E.T`` to its output
on every call: the mean over the call's tokens (the second-to-last dimension), or, for a 2-D input of at most
``EXACT_ROWS`` rows (a modulation linear's per-sample vector), each row's own ``x @ E.T``. The token mean of each
output is then what the exact weight gives; what is left of the weight's error has zero mean over the tokens. The
cost, were it a deploy mode: one GEMV against a bf16-sized error matrix per linear and call (or the bf16 weight kept).
The fused GELU + quantisation kernel is off (it would skip the down projection's ``forward``).
"""

from __future__ import annotations

import torch
from torch import nn

import omniloop_quant.fp8 as _fp8

#: 2-D inputs with at most this many rows are corrected row by row (exactly): per-sample vectors, not tokens
EXACT_ROWS = 16
_init = _fp8.FP8Linear.__init__
_forward = _fp8.FP8Linear.forward


def __init__(self: _fp8.FP8Linear, linear: nn.Linear, **kwargs: object) -> None:
    _init(self, linear, **kwargs)
    self.register_buffer("weight_error", linear.weight.detach().float() - self.dequantized_weight())


def forward(self: _fp8.FP8Linear, x: torch.Tensor) -> torch.Tensor:
    y = _forward(self, x)
    xf = x.float()
    if x.dim() == 2 and x.shape[0] <= EXACT_ROWS:
        mean = xf
    else:
        mean = xf.mean(dim=-2, keepdim=True)
    return y + (mean @ self.weight_error.t()).to(y.dtype)


_fp8.FP8Linear._forward_uncorrected = _forward  # type: ignore[attr-defined]
_fp8.FP8Linear.__init__ = __init__  # type: ignore[method-assign]
_fp8.FP8Linear.forward = forward  # type: ignore[method-assign]
_fp8.FUSE_GELU_QUANT = False
print("fp8_mean_correction: FP8 linears with their weight rounding corrected in the token mean", flush=True)
