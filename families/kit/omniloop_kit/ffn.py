"""Fused feed-forward input projection: ``gelu_tanh(x @ W.T + b)`` as one cuBLASLt matmul (CUDA).

A diffusers ``FeedForward`` with ``activation_fn="gelu-approximate"`` (Wan's blocks, FLUX's and
SD3's) starts with a ``GELU(approximate="tanh")`` module: a ``Linear`` then the activation, two
kernels — and the activation is a full extra read and write of the widest tensor of the block
(``tokens x ffn_dim``; in Wan ~1.2 GB per 1.3B block at 480x832x81, 12 ms of a 0.52 s forward on
the H200; ``torch.compile`` keeps cuBLAS for the matmul and
cannot fuse the activation into it). :class:`FusedGeluProjection` computes the projection with
``torch._addmm_activation(..., use_gelu=True)``: cuBLASLt applies bias and tanh-GELU in the matmul
epilogue, on the float32 accumulator. Inductor keeps that op as one extern kernel, so compiled
blocks get the same fusion.

Numerics: the activation is applied before rounding to bf16 instead of after, so results are
within bf16 rounding of the reference (not bit-equal). Opt-in with a family option (Wan's
``options.ffn_gelu: fused``; CUDA only: on CPU ``_addmm_activation`` computes the exact-erf GELU,
not the tanh form, so a family refuses the option at load there -- :func:`ffn_option`). The swap keeps the
``Linear`` (same parameters, same state-dict keys, so weight updates land); :func:`restore` puts diffusers' modules
back. An adapter on the projection would be bypassed: a family's ``AdapterSupport.check`` calls
:func:`refuse_fused_ffn`. Offered by Wan (``options.ffn_gelu``), FLUX.1 (its double blocks' ``ff`` and
``ff_context``; a single block's MLP is a bare ``Linear`` + ``GELU``, which FLUX's own single-block forward
fuses the same way, ``omniloop_flux.blocks``) and SD3 (every joint block's ``ff`` and ``ff_context``).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from omniloop.errors import DeployError

from .options import choice_option

#: values of ``options.ffn_gelu``
MODES = ("reference", "fused")

_SWAPPED: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[Any, int, torch.nn.Module]]] = (
    weakref.WeakKeyDictionary()
)


class FusedGeluProjection(torch.nn.Module):
    """Stands in for diffusers' ``GELU(approximate="tanh")``: same ``proj``, one matmul with epilogue."""

    def __init__(self, original: torch.nn.Module) -> None:
        super().__init__()
        self.proj = original.proj
        self.approximate = original.approximate

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        proj = self.proj
        if hidden_states.is_cuda and proj.bias is not None:
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            out = torch._addmm_activation(proj.bias, flat, proj.weight.t(), use_gelu=True)
            return out.view(*hidden_states.shape[:-1], out.shape[-1])
        return torch.nn.functional.gelu(proj(hidden_states), approximate=self.approximate)


def ffn_option(options: Any, device: Any) -> str:
    """``options.ffn_gelu`` (:data:`MODES`), or one ``DeployError``: an unknown value, or ``fused`` on a
    device other than CUDA (cuBLASLt's epilogue; elsewhere the op computes another GELU)."""
    mode = choice_option(options, "ffn_gelu", MODES)
    if mode == "fused" and torch.device(device).type != "cuda":
        raise DeployError(f"options.ffn_gelu: 'fused' needs a CUDA device (cuBLASLt's GELU epilogue), not {device}; "
                          "use ffn_gelu 'reference'")
    return mode


def refuse_fused_ffn(model: Any, options: Mapping[str, Any]) -> None:
    """An ``AdapterSupport.check``: ``options.ffn_gelu: fused`` computes the feed-forward input projection
    from its weight directly, past an adapter hooked on the ``Linear``, so adapters refuse it at load."""
    if options.get("ffn_gelu", "reference") == "fused":
        raise DeployError("adapters: options.ffn_gelu 'fused' computes the feed-forward projection without its "
                          "Linear, so a LoRA on it would be skipped; use ffn_gelu 'reference' with adapters")


def _gelu_modules(model: torch.nn.Module) -> list[tuple[Any, int, torch.nn.Module]]:
    from diffusers.models.activations import GELU

    found = []
    for module in model.modules():
        net = getattr(module, "net", None)
        if isinstance(net, torch.nn.ModuleList) and len(net) and isinstance(net[0], GELU):
            if net[0].approximate == "tanh" and net[0].proj.bias is not None:
                found.append((net, 0, net[0]))
    return found


def install(model: torch.nn.Module) -> int:
    """Swap every feed-forward ``GELU(approximate="tanh")`` of ``model``; returns how many."""
    if model in _SWAPPED:
        return len(_SWAPPED[model])
    swapped = _gelu_modules(model)
    for net, i, original in swapped:
        net[i] = FusedGeluProjection(original)
    _SWAPPED[model] = swapped
    return len(swapped)


def restore(model: torch.nn.Module) -> int:
    """Put diffusers' modules back (no-op when :func:`install` was not called); returns how many."""
    swapped = _SWAPPED.pop(model, [])
    for net, i, original in swapped:
        net[i] = original
    return len(swapped)


def installed(model: torch.nn.Module) -> bool:
    return model in _SWAPPED


__all__ = ["MODES", "FusedGeluProjection", "ffn_option", "install", "installed", "refuse_fused_ffn", "restore"]
