"""LoRA adapters for SD3 / SD3.5: the family's opt-in (:data:`SD3_ADAPTERS`).

The core applies adapters (the omniloop-adapters plugin) to the ``transformer``'s linears, read from
diffusers' files (``StableDiffusion3Pipeline.save_lora_weights``: ``transformer.<module>.lora_A/
lora_B.weight``). Other layouts are refused with the keys named (no kohya conversion for SD3 yet).
``options.qkv: fused`` projects Q/K/V with one concatenated weight, bypassing the ``to_q``/
``to_k``/``to_v`` linears an adapter hooks, and ``options.ffn_gelu: fused`` computes the feed-forward
input projection from its weight directly, so adapters refuse both at load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniloop.capabilities import AdapterSupport
from omniloop_kit.attention import refuse_fused_qkv
from omniloop_kit.ffn import refuse_fused_ffn


def check(model: Any, options: Mapping[str, Any]) -> None:
    """Adapters refuse ``options.qkv: fused`` and ``options.ffn_gelu: fused`` (each computes a projection
    past the ``Linear`` an adapter hooks)."""
    refuse_fused_qkv(model, options)
    refuse_fused_ffn(model, options)


SD3_ADAPTERS = AdapterSupport(components=("transformer",), check=check)

__all__ = ["SD3_ADAPTERS", "check"]
