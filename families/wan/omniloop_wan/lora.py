"""LoRA adapters for Wan: the family's opt-in (:data:`WAN_ADAPTERS`) and the key layouts it reads.

The core applies adapters (:mod:`omniloop.adapters`); this module says which components they may
target (``transformer``, as diffusers' ``WanLoraLoaderMixin`` loads them; Wan2.2's
``transformer_2`` too when the file names it) and converts the layouts that circulate outside
diffusers to diffusers' keys:

* ComfyUI / musubi-tuner: ``diffusion_model.blocks.N.self_attn.q.lora_down.weight`` (``lora_up``,
  ``.alpha``), also with ``lora_A``/``lora_B``;
* kohya: ``lora_unet_blocks_N_self_attn_q.lora_down.weight`` (``lora_up``, ``.alpha``).

Wan's original names map to diffusers': ``self_attn.{q,k,v,o}`` -> ``attn1.{to_q,to_k,to_v,to_out.0}``,
``cross_attn.*`` -> ``attn2.*`` (``k_img``/``v_img`` -> ``add_k_proj``/``add_v_proj``),
``ffn.0`` -> ``ffn.net.0.proj``, ``ffn.2`` -> ``ffn.net.2`` (the keys' suffixes, alphas and checks
are omniloop-kit's :mod:`omniloop_kit.lora`). Keys outside the blocks' linears (``diff_b`` bias
deltas, ``head``, embeddings) are refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from omniloop.capabilities import AdapterSupport
from omniloop.errors import DeployError
from omniloop_kit import lora as kit_lora
from omniloop_kit.ffn import refuse_fused_ffn

_ATTN = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "k_img": "add_k_proj", "v_img": "add_v_proj"}
SUBMODULES: dict[str, str] = {
    **{f"self_attn.{k}": f"attn1.{v}" for k, v in _ATTN.items() if "img" not in k},
    **{f"cross_attn.{k}": f"attn2.{v}" for k, v in _ATTN.items()},
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}
_KOHYA = {k.replace(".", "_"): v for k, v in SUBMODULES.items()}

_DOTTED = re.compile(r"(?:diffusion_model\.|model\.diffusion_model\.)?blocks\.(\d+)\.(.+)")
_KOHYA_PATH = re.compile(r"lora_unet_blocks_(\d+)_(.+)")


def target(src: str) -> kit_lora.Target | None:
    """diffusers' module of a ComfyUI / kohya module path (one each: Wan fuses no projection)."""
    m, table = _DOTTED.fullmatch(src), SUBMODULES
    if m is None:
        m, table = _KOHYA_PATH.fullmatch(src), _KOHYA
    if m is None or m.group(2) not in table:
        return None
    return (f"transformer.blocks.{m.group(1)}.{table[m.group(2)]}",), (1,)


def convert(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """ComfyUI / kohya Wan LoRA keys -> diffusers' (``transformer.blocks.N.<module>.lora_A.weight``)."""
    return kit_lora.convert(sd, target, "Wan (diffusers, ComfyUI or kohya)")


def check(model: Any, options: Mapping[str, Any]) -> None:
    """Adapters hook the linears' forwards: paths that bypass them are refused at load."""
    refuse_fused_ffn(model, options)
    for name, comp in (getattr(model, "components", None) or {}).items():
        if name.startswith("transformer") and isinstance(comp, torch.nn.Module):
            if any(getattr(m, "fused_projections", False) for m in comp.modules()):
                raise DeployError(f"adapters: {name} has fused QKV projections; adapters need the separate to_q/to_k/to_v")


WAN_ADAPTERS = AdapterSupport(components=("transformer", "transformer_2"), convert=convert, check=check)

__all__ = ["SUBMODULES", "WAN_ADAPTERS", "check", "convert", "target"]
