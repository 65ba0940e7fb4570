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
of ``B`` for that part — the same product, split. Unknown keys are refused by name.
"""

from __future__ import annotations

import re

import torch

from omniloop.capabilities import AdapterFormatError, AdapterSupport, unknown_keys_error
from omniloop_kit.attention import refuse_fused_qkv as check  # options.qkv: fused bypasses to_q/to_k/to_v

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
_DOTTED = re.compile(_PREFIX + r"(double_blocks|single_blocks)\.(\d+)\.(.+)\.(lora_down\.weight|lora_up\.weight|lora_A\.weight|lora_B\.weight|alpha)")
_KOHYA = re.compile(r"lora_unet_(double_blocks|single_blocks)_(\d+)_(.+)\.(lora_down\.weight|lora_up\.weight|alpha)")
_WHICH = {"lora_down.weight": "A", "lora_A.weight": "A", "lora_up.weight": "B", "lora_B.weight": "B", "alpha": "alpha"}


def _split_sizes(parts: tuple[str, ...], rows: int, where: str) -> list[int]:
    if len(parts) == 1:
        return [rows]
    if len(parts) == 3:
        if rows % 3:
            raise AdapterFormatError(f"{where}: lora_up has {rows} rows, not 3 equal q/k/v parts")
        return [rows // 3] * 3
    if rows % 7:  # q, k, v, then the MLP input of 4x the width (FLUX's mlp_ratio 4)
        raise AdapterFormatError(f"{where}: lora_up has {rows} rows, not q/k/v/mlp parts of 1:1:1:4")
    inner = rows // 7
    return [inner, inner, inner, 4 * inner]


def convert(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """kohya / ComfyUI FLUX.1 LoRA keys -> diffusers' (``transformer.<module>.lora_A/lora_B.weight``)."""
    groups: dict[tuple[str, str, tuple[str, ...]], dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key, t in sd.items():
        m = _DOTTED.fullmatch(key)
        table_d, table_s = DOUBLE, SINGLE
        if m is None:
            m = _KOHYA.fullmatch(key)
            table_d, table_s = _KOHYA_DOUBLE, _KOHYA_SINGLE
        if m is None:
            unknown.append(key)
            continue
        kind, idx, sub, which = m.groups()
        table = table_d if kind == "double_blocks" else table_s
        parts = table.get(sub)
        if parts is None:
            unknown.append(key)
            continue
        block = ("transformer_blocks." if kind == "double_blocks" else "single_transformer_blocks.") + idx
        groups.setdefault((block, key.rsplit(".", 2 if which != "alpha" else 1)[0], parts), {})[_WHICH[which]] = t
    if unknown:
        raise unknown_keys_error(unknown, "FLUX.1 (diffusers, ComfyUI/BFL or kohya)")
    out: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for (block, src, parts), g in groups.items():
        if "A" not in g or "B" not in g:
            raise AdapterFormatError(f"{src}: has no {'lora_up' if 'A' in g else 'lora_down'} weight")
        down, up = g["A"], g["B"]
        if up.ndim != 2:
            raise AdapterFormatError(f"{src}: lora_up is not a matrix")
        for part, chunk in zip(parts, up.split(_split_sizes(parts, up.shape[0], src), dim=0), strict=True):
            mod = f"transformer.{block}.{part}"
            out[f"{mod}.lora_A.weight"] = down
            out[f"{mod}.lora_B.weight"] = chunk.contiguous()
            if "alpha" in g:
                if g["alpha"].numel() != 1:
                    raise AdapterFormatError(f"{src}.alpha: not a scalar")
                alphas[mod] = float(g["alpha"].item())
    return out, alphas


FLUX_ADAPTERS = AdapterSupport(components=("transformer",), convert=convert, check=check)

__all__ = ["DOUBLE", "FLUX_ADAPTERS", "SINGLE", "check", "convert"]
