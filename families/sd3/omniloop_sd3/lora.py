"""LoRA adapters for SD3 / SD3.5: the family's opt-in (:data:`SD3_ADAPTERS`).

The core applies adapters (the omniloop-adapters plugin) to the ``transformer``'s linears, read from
diffusers' files (``StableDiffusion3Pipeline.save_lora_weights``: ``transformer.<module>.lora_A/
lora_B.weight``). Other layouts are refused with the keys named (no kohya conversion for SD3 yet).
``options.qkv: fused`` projects Q/K/V with one concatenated weight, bypassing the ``to_q``/
``to_k``/``to_v`` linears an adapter hooks, so adapters refuse it at load.
"""

from __future__ import annotations

from omniloop.capabilities import AdapterSupport
from omniloop_kit.attention import refuse_fused_qkv

SD3_ADAPTERS = AdapterSupport(components=("transformer",), check=refuse_fused_qkv)

__all__ = ["SD3_ADAPTERS"]
