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
``ffn.0`` -> ``ffn.net.0.proj``, ``ffn.2`` -> ``ffn.net.2``. Keys outside the blocks' linears
(``diff_b`` bias deltas, ``head``, embeddings) are refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from omniloop.capabilities import AdapterSupport, unknown_keys_error
from omniloop.errors import DeployError

_ATTN = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "k_img": "add_k_proj", "v_img": "add_v_proj"}
SUBMODULES: dict[str, str] = {
    **{f"self_attn.{k}": f"attn1.{v}" for k, v in _ATTN.items() if "img" not in k},
    **{f"cross_attn.{k}": f"attn2.{v}" for k, v in _ATTN.items()},
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}
_KOHYA = {k.replace(".", "_"): v for k, v in SUBMODULES.items()}

_DOTTED = re.compile(r"(?:diffusion_model\.|model\.diffusion_model\.)?blocks\.(\d+)\.(.+)\.(lora_down|lora_up|lora_A|lora_B)\.weight")
_DOTTED_ALPHA = re.compile(r"(?:diffusion_model\.|model\.diffusion_model\.)?blocks\.(\d+)\.(.+)\.alpha")
_KOHYA_W = re.compile(r"lora_unet_blocks_(\d+)_(.+)\.(lora_down|lora_up)\.weight")
_KOHYA_ALPHA = re.compile(r"lora_unet_blocks_(\d+)_(.+)\.alpha")
_WHICH = {"lora_down": "lora_A", "lora_A": "lora_A", "lora_up": "lora_B", "lora_B": "lora_B"}


def convert(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """ComfyUI / kohya Wan LoRA keys -> diffusers' (``transformer.blocks.N.<module>.lora_A.weight``)."""
    out: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    unknown: list[str] = []
    for key, t in sd.items():
        m = _DOTTED.fullmatch(key)
        if m and m.group(2) in SUBMODULES:
            out[f"transformer.blocks.{m.group(1)}.{SUBMODULES[m.group(2)]}.{_WHICH[m.group(3)]}.weight"] = t
            continue
        m = _KOHYA_W.fullmatch(key)
        if m and m.group(2) in _KOHYA:
            out[f"transformer.blocks.{m.group(1)}.{_KOHYA[m.group(2)]}.{_WHICH[m.group(3)]}.weight"] = t
            continue
        m = _DOTTED_ALPHA.fullmatch(key)
        table = SUBMODULES
        if m is None:
            m = _KOHYA_ALPHA.fullmatch(key)
            table = _KOHYA
        if m and m.group(2) in table and t.numel() == 1:
            alphas[f"transformer.blocks.{m.group(1)}.{table[m.group(2)]}"] = float(t.item())
            continue
        unknown.append(key)
    if unknown:
        raise unknown_keys_error(unknown, "Wan (diffusers, ComfyUI or kohya)")
    return out, alphas


def check(model: Any, options: Mapping[str, Any]) -> None:
    """Adapters hook the linears' forwards: paths that bypass them are refused at load."""
    if options.get("ffn_gelu") == "fused":
        raise DeployError("adapters: options.ffn_gelu 'fused' computes the feed-forward projection without its "
                          "Linear, so a LoRA on it would be skipped; use ffn_gelu 'reference' with adapters")
    for name, comp in (getattr(model, "components", None) or {}).items():
        if name.startswith("transformer") and isinstance(comp, torch.nn.Module):
            if any(getattr(m, "fused_projections", False) for m in comp.modules()):
                raise DeployError(f"adapters: {name} has fused QKV projections; adapters need the separate to_q/to_k/to_v")


WAN_ADAPTERS = AdapterSupport(components=("transformer", "transformer_2"), convert=convert, check=check)

__all__ = ["SUBMODULES", "WAN_ADAPTERS", "check", "convert"]
