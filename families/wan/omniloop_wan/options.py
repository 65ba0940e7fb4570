"""The Wan family's deploy options (``options:`` in the deploy config), checked before loading.

=====================  =====================================================================
``vae_dtype``          ``float32`` (default, as Wan-AI runs its VAE), ``bfloat16``, ``float16``
``text_cache``         text-embedding cache entries (default 64; ``0``/``false``: off)
``vae_tiling``         ``true`` or ``{tile_sample_min_height, tile_sample_min_width,
                       tile_sample_stride_height, tile_sample_stride_width}`` (pixels):
                       ``AutoencoderKLWan.enable_tiling`` — decode (and I2V encode) in
                       overlapping spatial tiles, blended; lower peak memory, not bit-equal
``vae_slicing``        ``true``: ``AutoencoderKLWan.enable_slicing`` — a batch of videos is
                       decoded one at a time (a request decodes one video, so this only
                       matters to callers that decode batches)
``vae_cpu_kernels``    ``reference`` (default: diffusers' ops, bit-equal to diffusers) or ``fast``:
                       CPU float32 VAE convolutions through oneDNN and a sum-of-squares RMS
                       norm (:mod:`omniloop_wan.vae_kernels`): ~4.5x faster decode on one
                       thread, not bit-equal (decoded video within 1e-5 of the reference)
``qk_norm_rope``       ``reference`` (default: diffusers' ops, bit-equal) or ``fused``: the
                       self-attention QK RMS norm and rotary embedding in one Triton kernel
                       (:mod:`omniloop_wan.fused`; CUDA + ``triton`` only, refused at load
                       otherwise); bf16 results within rounding of the reference, not bit-equal
``ffn_gelu``           ``reference`` (default) or ``fused``: each feed-forward's input projection
                       and tanh-GELU as one cuBLASLt matmul with a GELU epilogue
                       (:mod:`omniloop_wan.ffn`; CUDA only, refused at load otherwise); within
                       bf16 rounding of the reference, not bit-equal
``qkv``                ``separate`` (default: diffusers' three Q/K/V linears) or ``fused``: diffusers'
                       ``WanAttention.fuse_projections`` — one GEMM over ``[W_q; W_k; W_v]``
                       (cross-attention: ``[W_k; W_v]``), the originals kept; with
                       ``linear_precision: fp8`` one activation quantisation instead of three;
                       refused with adapters (they hook the separate linears)
``norm_quant``         ``reference`` (default) or ``fused``: with ``linear_precision: fp8*``, each
                       block's residual add + norm + modulation + per-row e4m3 quantisation in
                       front of its FP8 GEMMs as one kernel (:mod:`omniloop_wan.blocks`; CUDA +
                       ``triton`` only); refused without FP8 linears
``compile_backend``    ``torch.compile`` backend for deploy ``compile: true`` (default
                       ``inductor``; ``eager`` checks tracing without code generation)
``compile_mode``       e.g. ``max-autotune-no-cudagraphs`` (inductor only)
``compile_dynamic``    ``torch.compile(dynamic=...)`` (default ``false``: one graph per shape)
``compile_inductor``   inductor settings, ``torch.compile(options=...)`` (e.g. ``{triton.multi_kernel: 1}``)
``rollout``            ``bidirectional`` (default) or ``causal``: chunk-by-chunk streaming with a
                       chunk-KV cache (:mod:`omniloop_wan.causal.pipeline`)
``rollout_options``    the causal rollout's settings (``chunk_frames``, ``steps``, ``window``,
                       ``sink``, ``max_sessions``, ...: ``omniloop_wan.causal.CausalOptions``)
=====================  =====================================================================

The runtime adds ``deploy``, ``registry`` and ``attention`` (the deploy's attention backend).
Unknown keys are refused by the core before anything loads (``WanFamily.capabilities.options``
is :data:`KNOWN`); :func:`parse_options`, called directly with an unknown key, warns.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from attrs import define

from omniloop.errors import DeployError
from omniloop_kit.attention import qkv_option
from omniloop_kit.compile import OPTION_KEYS as COMPILE_KEYS
from omniloop_kit.options import choice_option
from omniloop_kit.textcache import capacity_from_options

from .compile import compile_options
from .fused import MODES
from .vae_kernels import parse_vae_cpu_kernels

log = logging.getLogger("omniloop_wan")

RUNTIME_KEYS = frozenset({"deploy", "registry", "attention"})
TILING_KEYS = ("tile_sample_min_height", "tile_sample_min_width", "tile_sample_stride_height", "tile_sample_stride_width")
KNOWN = frozenset(
    {
        "vae_dtype", "text_cache", "vae_tiling", "vae_slicing", "vae_cpu_kernels", "qk_norm_rope", "ffn_gelu", "qkv",
        "norm_quant",
        *COMPILE_KEYS,
        "rollout", "rollout_options",  # read by omniloop_wan.causal.pipeline (rollout: causal)
    }
)


@define(frozen=True)
class WanOptions:
    text_cache: int
    vae_tiling: dict[str, int] | None
    vae_slicing: bool
    #: "reference" or "fast" (see omniloop_wan.vae_kernels)
    vae_cpu_kernels: str
    #: "reference" or "fused" (see omniloop_wan.fused)
    qk_norm_rope: str
    #: "reference" or "fused" (see omniloop_wan.ffn)
    ffn_gelu: str
    #: "separate" or "fused" (diffusers' fuse_projections)
    qkv: str
    #: "reference" or "fused" (see omniloop_wan.blocks)
    norm_quant: str
    #: None when compile is off, else {backend, mode, dynamic}
    compile: dict[str, Any] | None
    attention: Any


def parse_options(options: Mapping[str, Any] | None) -> WanOptions:
    options = dict(options or {})
    unknown = sorted(set(options) - KNOWN - RUNTIME_KEYS)
    if unknown:
        log.warning("options %s are not wan family options (known: %s); ignored", unknown, ", ".join(sorted(KNOWN)))
    tiling = options.get("vae_tiling", False)
    tiling_kw: dict[str, int] | None
    if tiling is True:
        tiling_kw = {}
    elif tiling is False or tiling is None:
        tiling_kw = None
    elif isinstance(tiling, Mapping):
        bad = sorted(set(tiling) - set(TILING_KEYS))
        if bad:
            raise DeployError(f"options.vae_tiling.{bad[0]}: unknown key (known: {', '.join(TILING_KEYS)})")
        for k, v in tiling.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 8:
                raise DeployError(f"options.vae_tiling.{k}: expected pixels (an integer >= 8), got {v!r}")
        tiling_kw = dict(tiling)
    else:
        raise DeployError(f"options.vae_tiling: expected true, false or a mapping of tile sizes, got {tiling!r}")
    slicing = options.get("vae_slicing", False)
    if not isinstance(slicing, bool):
        raise DeployError(f"options.vae_slicing: expected true or false, got {slicing!r}")
    fused = {key: choice_option(options, key, MODES) for key in ("qk_norm_rope", "ffn_gelu", "norm_quant")}
    if fused["norm_quant"] == "fused":
        deploy = options.get("deploy")
        precision = getattr(deploy, "linear_precision", None)
        if precision == "dtype":
            raise DeployError("options.norm_quant: 'fused' hands e4m3 rows to FP8 linears; set linear_precision "
                              "fp8 (or fp8-fast...), or norm_quant 'reference'")
    return WanOptions(
        text_cache=capacity_from_options(options),
        vae_tiling=tiling_kw,
        vae_slicing=slicing,
        vae_cpu_kernels=parse_vae_cpu_kernels(options.get("vae_cpu_kernels")),
        qk_norm_rope=fused["qk_norm_rope"],
        ffn_gelu=fused["ffn_gelu"],
        qkv=qkv_option(options),
        norm_quant=fused["norm_quant"],
        compile=compile_options(options),
        attention=options.get("attention"),
    )


__all__ = ["KNOWN", "WanOptions", "parse_options"]
