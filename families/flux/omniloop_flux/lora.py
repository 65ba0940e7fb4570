"""LoRA adapters for FLUX.1: the family's opt-in (:data:`FLUX_ADAPTERS`) and the key layouts it reads.

The core applies adapters (the omniloop-adapters plugin) to the ``transformer``'s linears. diffusers'
files (``FluxPipeline.save_lora_weights``) are read as they are; the Black Forest Labs layouts
that circulate outside diffusers are converted at load:

* kohya (sd-scripts): ``lora_unet_double_blocks_N_img_attn_qkv.lora_down.weight`` (``lora_up``,
  ``.alpha``), ``lora_unet_single_blocks_N_linear1...``;
* ComfyUI / BFL: ``diffusion_model.double_blocks.N.img_attn.qkv.lora_A.weight`` (or
  ``lora_down``/``lora_up``, ``.alpha``).

BFL fuses projections diffusers keeps apart: ``img_attn.qkv`` is ``to_q``/``to_k``/``to_v``
(``txt_attn.qkv``: ``add_q_proj``/``add_k_proj``/``add_v_proj``) and a single block's
``linear1`` is ``to_q``/``to_k``/``to_v``/``proj_mlp`` (sizes ``inner, inner, inner, 4·inner``,
FLUX's mlp ratio). A fused LoRA ``B·A`` becomes one LoRA per part with the same ``A`` and the rows
of ``B`` for that part — the same product, split (omniloop-kit's :mod:`omniloop_kit.lora`). Unknown
keys are refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from omniloop.capabilities import AdapterSupport
from omniloop_kit import lora as kit_lora
from omniloop_kit.attention import refuse_fused_qkv
from omniloop_kit.ffn import refuse_fused_ffn

DOUBLE: dict[str, tuple[str, ...]] = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn.proj": ("attn.to_out.0",),
    "img_mlp.0": ("ff.net.0.proj",),
    "img_mlp.2": ("ff.net.2",),
    "img_mod.lin": ("norm1.linear",),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn.proj": ("attn.to_add_out",),
    "txt_mlp.0": ("ff_context.net.0.proj",),
    "txt_mlp.2": ("ff_context.net.2",),
    "txt_mod.lin": ("norm1_context.linear",),
}
SINGLE: dict[str, tuple[str, ...]] = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation.lin": ("norm.linear",),
}
_KOHYA_DOUBLE = {k.replace(".", "_"): v for k, v in DOUBLE.items()}
_KOHYA_SINGLE = {k.replace(".", "_"): v for k, v in SINGLE.items()}
_PREFIX = r"(?:diffusion_model\.|model\.diffusion_model\.|transformer\.)?"
_DOTTED = re.compile(_PREFIX + r"(double_blocks|single_blocks)\.(\d+)\.(.+)")
_KOHYA = re.compile(r"lora_unet_(double_blocks|single_blocks)_(\d+)_(.+)")
#: lora_up's rows per part: one module, q/k/v, or q/k/v then the MLP input of 4x the width (mlp_ratio 4)
_RATIOS = {1: (1,), 3: (1, 1, 1), 4: (1, 1, 1, 4)}


def check(model: Any, options: Mapping[str, Any]) -> None:
    """Adapters refuse ``options.qkv: fused`` (Q/K/V computed past ``to_q``/``to_k``/``to_v``) and
    ``options.ffn_gelu: fused`` (the feed-forward projection computed past its ``Linear``)."""
    refuse_fused_qkv(model, options)
    refuse_fused_ffn(model, options)


def target(src: str) -> kit_lora.Target | None:
    """diffusers' modules (and their share of lora_up's rows) of a BFL / kohya module path."""
    m, tables = _DOTTED.fullmatch(src), (DOUBLE, SINGLE)
    if m is None:
        m, tables = _KOHYA.fullmatch(src), (_KOHYA_DOUBLE, _KOHYA_SINGLE)
    parts = None if m is None else tables[m.group(1) == "single_blocks"].get(m.group(3))
    if m is None or parts is None:
        return None
    block = ("transformer_blocks." if m.group(1) == "double_blocks" else "single_transformer_blocks.") + m.group(2)
    return tuple(f"transformer.{block}.{part}" for part in parts), _RATIOS[len(parts)]


def convert(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """kohya / ComfyUI FLUX.1 LoRA keys -> diffusers' (``transformer.<module>.lora_A/lora_B.weight``)."""
    return kit_lora.convert(sd, target, "FLUX.1 (diffusers, ComfyUI/BFL or kohya)")


FLUX_ADAPTERS = AdapterSupport(components=("transformer",), convert=convert, check=check)

__all__ = ["DOUBLE", "FLUX_ADAPTERS", "SINGLE", "check", "convert", "target"]
