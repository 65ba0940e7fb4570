"""omniloop-quant: lower-precision compute for a model's denoiser, chosen in the deploy file.

Deploy ``linear_precision: fp8`` (a core field, :class:`omniloop.deploy.DeployConfig`, whose values
beyond the built-in ``dtype`` are registered by plugins: this package's entry point,
:mod:`omniloop_quant.plugin`, registers ``fp8``, ``fp8-fast`` and ``fp8-fast-except-down`` through ``omniloop_register_linear_precisions``) swaps the ``nn.Linear`` layers inside the
denoiser's transformer blocks for e4m3 GEMMs (:mod:`omniloop_quant.fp8`): weights quantised once at
load per output channel, activations per token on every call, bias and scales applied in the
GEMM's epilogue, output in the model dtype. Embeddings, the timestep MLP, text projections and the
final ``proj_out`` live outside the blocks and stay in the model dtype.

The core calls :func:`check_deploy` (the spec's ``check``) before any weight loads (device, dtype and combinations) and
:func:`apply` right after the family loads its components (before any compiled block is traced).
Which modules are "the denoiser's blocks" is family-independent: a family may declare
``FamilyCapabilities(quant_blocks={component: "attr.path|other.path"})``; otherwise the components
LoRA adapters target (``capabilities.adapters.components``), else the ``transformer*`` entries of
``capabilities.offload.components``, with their declared block lists (``blocks``, ``transformer_blocks``,
``single_transformer_blocks`` when none is declared).

FP8 linears change outputs (distribution-altering): ``exact: true`` requests are refused by the
core while a deploy uses them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniloop.lazy import lazy_exports

#: public names by defining module, imported on first use (PEP 562): loading the plugin
#: (``omniloop --help``) imports no torch (issue 42); the block selection lives in ``blocks``
_EXPORTS: dict[str, tuple[str, ...]] = {
    "blocks": ("ACCUMULATION", "MODES", "apply", "check_deploy", "denoiser_blocks", "stray_weights"),
    "fp8": ("ALIGN", "E4M3_MAX", "MIN_CAPABILITY", "FP8FeedForward", "FP8GeluProjection", "FP8Linear", "FP8PartLinear", "install", "installed", "quantize_rows", "quantize_weight", "reference_output", "restore", "shape_ok", "unavailable_reason"),
}

if TYPE_CHECKING:
    from .blocks import ACCUMULATION, MODES, apply, check_deploy, denoiser_blocks, stray_weights
    from .fp8 import (
        ALIGN,
        E4M3_MAX,
        MIN_CAPABILITY,
        FP8FeedForward,
        FP8GeluProjection,
        FP8Linear,
        FP8PartLinear,
        install,
        installed,
        quantize_rows,
        quantize_weight,
        reference_output,
        restore,
        shape_ok,
        unavailable_reason,
    )

__all__ = ["ACCUMULATION", "ALIGN", "E4M3_MAX", "MIN_CAPABILITY", "MODES", "FP8FeedForward", "FP8GeluProjection", "FP8Linear", "FP8PartLinear", "apply", "check_deploy", "denoiser_blocks", "install", "installed", "quantize_rows", "quantize_weight", "reference_output", "restore", "shape_ok", "stray_weights", "unavailable_reason"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
