"""Faster CPU float32 kernels for the Wan VAE (deploy option ``vae_cpu_kernels: fast``).

Opt-in, because the results are not bit-equal to diffusers' (the default, ``reference``, runs
diffusers' own ops and is what the parity tests pin).

Why: on a CPU, for a batch of one, PyTorch picks its native ``slow_conv3d`` (an explicit im2col
buffer and a GEMM) over oneDNN for every 3x3x3 convolution of the Wan VAE whose
``N*C*T*H`` is at most 20480 — a heuristic written for 2-D inputs that ignores the width. For
the causal decoder's per-frame calls (e.g. ``[1, 32, 6, 66, 66]``) the im2col buffer is 27x the
input and the native kernel runs ~9x slower than oneDNN on one thread. And ``WanRMS_norm``'s
``F.normalize(x, dim=1)`` reduces over a strided channel axis, ~25x slower than a sum of squares.
On the ``wan-demo`` VAE (17x64x64) the decode takes ~0.97 s with the reference kernels and
~0.21 s with these on one x86 thread.

What ``fast`` changes, on the VAE's modules only, and only for CPU float32 tensors without
autograd (anything else — CUDA, bfloat16, training — runs the module's own code):

* every ``nn.Conv3d`` (``WanCausalConv3d``) calls ``torch.mkldnn_convolution`` (oneDNN) directly;
* every channel-first ``WanRMS_norm`` computes ``x / max(sqrt(sum(x*x, dim=1)), 1e-12)`` (what
  ``F.normalize`` defines, summed in another order).

Tolerance (tests/wan/test_vae_kernels.py): the decoded video in [-1, 1] differs from the
reference kernels' by at most 1e-5 (observed: ~2e-6 on the wan-demo VAE); as uint8 frames, at
most 1 level on a few pixels in a million.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from omniloop_kit.options import choice_option

CHOICES = ("reference", "fast")
#: attribute set on a module whose forward was replaced (so configure is idempotent)
_MARK = "_omniloop_fast_kernel"


def parse_vae_cpu_kernels(value: Any) -> str:
    return choice_option({"vae_cpu_kernels": value}, "vae_cpu_kernels", CHOICES)


def _fast_path(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not (torch.is_grad_enabled() and x.requires_grad)
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
    )


def _conv3d_forward(self: nn.Conv3d, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if self.padding_mode == "zeros" and not isinstance(self.padding, str) and _fast_path(input) and not (
        torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
    ):
        return torch.mkldnn_convolution(
            input.contiguous(), weight.contiguous(), bias, list(self.padding), list(self.stride),
            list(self.dilation), self.groups,
        )
    return type(self)._conv_forward(self, input, weight, bias)


def _rms_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    if self.channel_first and _fast_path(x) and not (torch.is_grad_enabled() and self.gamma.requires_grad):
        norm = (x * x).sum(dim=1, keepdim=True).sqrt().clamp_min(1e-12)  # F.normalize's eps
        return x / norm * self.scale * self.gamma + self.bias
    return type(self).forward(self, x)


def install_fast_kernels(vae: nn.Module) -> int:
    """Replace the conv3d / RMS-norm forwards of ``vae``'s modules (idempotent); returns how many."""
    n = 0
    for module in vae.modules():
        if getattr(module, _MARK, False):
            continue
        if isinstance(module, nn.Conv3d):
            module._conv_forward = types.MethodType(_conv3d_forward, module)  # type: ignore[method-assign]
        elif type(module).__name__ == "WanRMS_norm" and hasattr(module, "channel_first"):
            module.forward = types.MethodType(_rms_norm_forward, module)  # type: ignore[method-assign]
        else:
            continue
        setattr(module, _MARK, True)
        n += 1
    return n


def remove_fast_kernels(vae: nn.Module) -> int:
    """Undo :func:`install_fast_kernels` (the modules run their class's code again)."""
    n = 0
    for module in vae.modules():
        if getattr(module, _MARK, False):
            module.__dict__.pop("_conv_forward", None)
            module.__dict__.pop("forward", None)
            delattr(module, _MARK)
            n += 1
    return n


def uses_fast_kernels(vae: nn.Module) -> bool:
    return any(getattr(m, _MARK, False) for m in vae.modules())


__all__ = ["CHOICES", "install_fast_kernels", "parse_vae_cpu_kernels", "remove_fast_kernels", "uses_fast_kernels"]
