"""``flash-attn-4``: FlashAttention's CuTe-DSL forward kernels (package ``flash-attn-4``) on Hopper.

What runs: ``flash_attn.cute.flash_attn_func`` — the FA3-design Hopper kernel (warp-specialised,
wgmma, TMA) that ``flash-attn-4`` writes in NVIDIA's CuTe DSL and JIT-compiles on first use (one
compile per head dimension / dtype / causal flag, cached for the process). bf16/fp16 q/k/v,
float32 softmax, output in the input dtype: the same function as SDPA up to floating-point
reassociation, so the backend is **exact-class** (``exact: true`` requests run on it).

Layout: the kernel takes ``[B, L, H, D]`` with a unit last stride; our backends take ``[B, H, L, D]``.
The Wan processor's q/k/v are ``[B, H, L, D]`` views of ``[B, L, H, D]`` tensors, so the transpose
back is free; other layouts with 16-byte-aligned strides are passed as they are (the kernel's
strides are dynamic), misaligned ones are copied by the package's wrapper.

The call is a ``torch.library`` custom op (``omniloop_attention::flash_attn4_fwd``, fake impl
registered) so that ``torch.compile(fullgraph=True)`` keeps it in the graph instead of tracing
into the DSL's Python. Forward only: no autograd (inference runtime).

Install (``pip install 'omniloop-attention[flash-attn-4]'``): ``flash-attn-4`` pulls
``nvidia-cutlass-dsl``, whose ``cutlass.cute`` lives in ``nvidia-cutlass-dsl-libs-core`` and whose
compiler in ``nvidia-cutlass-dsl-libs-cu12`` / ``-cu13`` (choose the one matching torch's CUDA:
``nvidia-cutlass-dsl[cu13]`` for a cu13x torch). ``nvidia-cutlass-dsl`` puts its packages on
``sys.path`` with a ``.pth`` file, which Python only reads in a *site* directory: a ``pip install
--target DIR`` tree must be added with ``site.addsitedir(DIR)``, or with both ``DIR`` and
``DIR/nvidia_cutlass_dsl/dsl_packages`` on ``PYTHONPATH`` (what the H200 runs did), else
``import cutlass`` fails.

Available (else a clear reason at load): CUDA, a Hopper GPU (compute capability 9.x: the only
architecture measured here; Blackwell's kernels exist in the package but are untested), and
``flash_attn.cute`` importable. A mask is an error (the kernel takes none).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any

import torch

#: FA4's Hopper kernel handles these head dimensions (``_validate_head_dims``: 8..256, a multiple
#: of 8 for 16-bit types)
MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256
DTYPES = (torch.bfloat16, torch.float16)


def _module_missing() -> str | None:
    try:
        spec = importlib.util.find_spec("flash_attn.cute")
    except (ImportError, ValueError):  # ``flash_attn`` itself absent or broken
        spec = None
    if spec is None:
        return ("the flash-attn-4 package (module 'flash_attn.cute') is not installed "
                "(pip install 'omniloop-attention[flash-attn-4]')")
    return None


@functools.lru_cache(maxsize=1)
def _import_error() -> str | None:
    """Importing ``flash_attn.cute`` pulls in cutlass and its MLIR runtime: try once, keep the reason."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as exc:  # a partial install (e.g. no nvidia-cutlass-dsl-libs-core: no cutlass.cute)
        return (f"flash-attn-4 is installed but does not import: {type(exc).__name__}: {exc} "
                "(needs nvidia-cutlass-dsl with nvidia-cutlass-dsl-libs-core and -libs-cu12 or -libs-cu13, "
                "installed into a site directory)")
    return None


def flash_attn4_available() -> str | None:
    """None when the ``flash-attn-4`` backend can run here, else the reason it cannot."""
    missing = _module_missing()
    if missing:
        return missing
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return (f"flash-attn-4 is enabled on Hopper (sm90) only, where it was measured; this GPU is "
                f"sm{major}{minor}")
    return _import_error()


#: ``attention_backend: auto`` picks this backend wherever it is available and accepts the deploy
#: (``AttentionBackendSpec.auto_rank``). Measured on the H200 (2026-12-03,
#: ``bench/results/attention_flash4-h200-2026-12-03.json``, ``wan_gpu-*-fa4-*``): 1.14-1.22x cuDNN
#: SDPA on Wan's self-attention, 1.04x on a FLUX-sized one, 0.84x on Wan's 512-token
#: cross-attention (0.04 ms a call); the whole Wan 1.3B step 1.12x faster than with ``sdpa-cudnn``.
AUTO_RANK = 10


#: the families whose whole step was measured faster with flash-attn-4 (auto picks it only there).
#: SD3.5-medium (joint image+text attention, head dim 64; compile + qkv fused + cuda_graphs): 1.073x
#: sdpa-cudnn's step (``bench/results/sd3_gpu-sd35m-1024-fa4-graphs-h200-run2-2026-12-04.json``).
#: FLUX.1-dev (head dim 128): within run-to-run spread of diffusers' SDPA (``flux_gpu-fa4-graphs-h200-*``),
#: so not picked there.
AUTO_FAMILIES = ("wan", "sd3")


def cuda_half_accepts(deploy: Any, family: str, families: tuple[str, ...]) -> str | None:
    """``auto_accepts`` of a Hopper kernel measured faster for ``families``: a deploy of one of them on a
    CUDA device in bf16 or fp16 (the kernels' dtypes); others keep ``sdpa``."""
    if family not in families:
        return f"family {family!r} was not measured faster with it (auto picks it for {', '.join(families)})"
    if torch.device(deploy.device).type != "cuda":
        return f"device {deploy.device!r} is not a CUDA device"
    if deploy.dtype not in ("bfloat16", "float16"):
        return f"dtype {deploy.dtype!r}: the kernel runs bf16 and fp16 only"
    return None


def flash_attn4_accepts(deploy: Any, family: str) -> str | None:
    """``auto`` may pick flash-attn-4 for a Wan or SD3 deploy on a CUDA device in bf16 or fp16."""
    return cuda_half_accepts(deploy, family, AUTO_FAMILIES)


@torch.library.custom_op("omniloop_attention::flash_attn4_fwd", mutates_args=())
def flash_attn4_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                    causal: bool) -> torch.Tensor:
    """FA4 forward on ``[B, L, H, D]`` q/k/v (unit last stride) → ``[B, Lq, H, Dv]`` contiguous."""
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)
    return out[0] if isinstance(out, tuple) else out


@flash_attn4_fwd.register_fake
def _flash_attn4_fwd_fake(q, k, v, softmax_scale, causal):  # type: ignore[no-untyped-def]
    B, Lq, H, _ = q.shape
    return q.new_empty((B, Lq, H, v.shape[-1]))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict[str, Any]) -> None:
    if kw.get("attn_mask") is not None:
        raise ValueError("flash-attn-4 backend takes no attention mask")
    extra = sorted(k_ for k_, v_ in kw.items() if k_ not in ("attn_mask", "is_causal", "scale") and v_ is not None)
    if extra:
        raise ValueError(f"flash-attn-4 backend does not take {', '.join(extra)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"flash-attn-4 backend needs bf16 or fp16 q/k/v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    D = q.shape[-1]
    if not (MIN_HEAD_DIM <= D <= MAX_HEAD_DIM and D % 8 == 0) or v.shape[-1] % 8:
        raise ValueError(f"flash-attn-4 backend needs a head dim in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], a multiple of 8; got {D}")


def flash_attn4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    """The backend callable: ``[B, H, L, D]`` in and out (transposed views, no copy when the
    inputs are views of ``[B, L, H, D]`` tensors, as in the Wan blocks)."""
    _check(q, k, v, kw)
    scale = kw.get("scale")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    qt, kt, vt = (x if x.stride(-1) == 1 else x.contiguous() for x in (qt, kt, vt))
    out = torch.ops.omniloop_attention.flash_attn4_fwd(qt, kt, vt, scale, bool(kw.get("is_causal", False)))
    return out.transpose(1, 2)


__all__ = ["AUTO_FAMILIES", "AUTO_RANK", "cuda_half_accepts", "flash_attn4", "flash_attn4_accepts", "flash_attn4_available", "flash_attn4_fwd"]
