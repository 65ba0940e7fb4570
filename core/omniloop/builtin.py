"""What the core registers itself: the portable attention backend ``sdpa``.

GPU-specific backends (explicit cuDNN / flash / efficient kernels, flash-attn, FP8) are plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .family import AttentionBackendSpec
from .hookspecs import hookimpl

if TYPE_CHECKING:
    import torch

OMNILOOP_HOOK_API = ">=1.0,<2"


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    """``q, k, v``: ``[B, heads, L, D]``. torch's SDPA with its own kernel choice."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, **kw)


@hookimpl
def omniloop_register_attention_backends(register: Any) -> None:
    register(AttentionBackendSpec(
        name="sdpa", fn=sdpa,
        description="torch scaled_dot_product_attention, kernel chosen by torch",
    ))
