"""Entry point of omniloop-quant: registers the deploy's ``linear_precision: fp8``, ``fp8-fast`` and
``fp8-fast-except-down``."""

from __future__ import annotations

from typing import Any

from omniloop.family import LinearPrecisionSpec
from omniloop.hookspecs import hookimpl

from .options import FP8Options

OMNILOOP_HOOK_API = ">=1.5,<2"  # 1.5: LinearPrecisionSpec.options_schema (linear_precision_options)

FP8 = LinearPrecisionSpec(
    name="fp8",
    check=lambda deploy, family, device, dtype: _quant().check_deploy(deploy, family, device, dtype),
    apply=lambda model, family, deploy: _quant().apply(model, family, deploy),
    distribution_altering=True,
    options_schema=FP8Options,  # linear_precision_options: keep (layers left in the deploy dtype)
    description="e4m3 GEMMs for the linears in the denoiser's transformer blocks (per-channel weight, "
                "per-token activation scales; CUDA capability >= 8.9, or the CPU)",
)


def _variant(name: str, description: str) -> LinearPrecisionSpec:
    """Another accumulation mode of the same e4m3 GEMMs: FP8's check and apply (which read the mode)."""
    return LinearPrecisionSpec(name=name, check=FP8.check, apply=FP8.apply, distribution_altering=True,
                               options_schema=FP8.options_schema, description=description)


FP8_FAST = _variant("fp8-fast", "fp8 with the GEMMs' fast accumulation (use_fast_accum: no periodic float32 promotion "
                                "on Hopper; faster, less accurate — see omniloop-quant's README for its measured quality)")
FP8_FAST_EXCEPT_DOWN = _variant(
    "fp8-fast-except-down",
    "fp8-fast except the feed-forwards' down projections, which keep full accumulation (their reduction over the "
    "FFN's inner width is the longest, where fast accumulation errs most; see omniloop-quant's README for its "
    "measured quality: on wan-demo one shape verdict lost of 96, fp8-fast two)")


def _quant() -> Any:  # the package (and torch) load only when a deploy names fp8
    import omniloop_quant

    return omniloop_quant


@hookimpl
def omniloop_register_linear_precisions(register: Any) -> None:
    register(FP8)
    register(FP8_FAST)
    register(FP8_FAST_EXCEPT_DOWN)
