"""LoRA files in the layouts that circulate outside diffusers — kohya (sd-scripts), ComfyUI,
musubi-tuner — converted to diffusers' keys: the body of a family's ``AdapterSupport.convert``
(omniloop-adapters applies the result).

Such a file names a module by its path in the *original* checkpoint (``lora_unet_blocks_0_self_attn_q``,
``diffusion_model.double_blocks.0.img_attn.qkv``), followed by ``.lora_down.weight`` /
``.lora_up.weight`` (or ``lora_A`` / ``lora_B``) and an optional scalar ``.alpha``. A family says
only where each original module lives in diffusers (:func:`convert`'s ``target``). Where the original
fuses projections diffusers keeps apart (FLUX's and SD3's ``qkv``, FLUX's ``linear1``), one module
maps to several: its ``lora_up`` rows are split in the given ratio, so a fused LoRA ``B·A`` becomes
one LoRA per part with the same ``A`` and that part's rows of ``B`` — the same product, split.
Keys the family does not map are refused by name (``omniloop.capabilities.unknown_keys_error``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omniloop.capabilities import AdapterFormatError, unknown_keys_error

#: a key's suffix: the LoRA's down (``A``) or up (``B``) matrix, or its ``alpha``
SUFFIXES = {"lora_down.weight": "A", "lora_A.weight": "A", "lora_up.weight": "B", "lora_B.weight": "B",
            "alpha": "alpha"}
#: what a family's ``target`` returns for an original module: diffusers' module paths
#: (``transformer.blocks.0.attn1.to_q``) and the ratio of ``lora_up`` rows each takes
Target = tuple[tuple[str, ...], tuple[int, ...]]


def parse(key: str) -> tuple[str, str] | None:
    """``(module path, "A" | "B" | "alpha")`` of a LoRA key, or None."""
    for suffix, which in SUFFIXES.items():
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], which
    return None


def split_rows(rows: int, ratios: tuple[int, ...], where: str) -> list[int]:
    """``rows`` of a fused ``lora_up`` split in ``ratios`` (one ``AdapterFormatError`` when they do not divide)."""
    unit, rest = divmod(rows, sum(ratios))
    if rest:
        raise AdapterFormatError(f"{where}: lora_up has {rows} rows, not parts of {':'.join(map(str, ratios))}")
    return [unit * r for r in ratios]


def convert(sd: Mapping[str, Any], target: Callable[[str], Target | None],
            layout: str) -> tuple[dict[str, Any], dict[str, float]]:
    """``sd``'s LoRA (original module paths) as diffusers' keys (``<module>.lora_A.weight`` /
    ``lora_B.weight``) and alphas by diffusers module; ``layout`` names what was expected
    ("FLUX.1 (diffusers, ComfyUI/BFL or kohya)") when a key maps nowhere."""
    groups: dict[str, dict[str, Any]] = {}
    targets: dict[str, Target] = {}
    unknown: list[str] = []
    for key, tensor in sd.items():
        got = parse(key)
        mapped = target(got[0]) if got is not None else None
        if got is None or mapped is None:
            unknown.append(key)
            continue
        targets[got[0]] = mapped
        groups.setdefault(got[0], {})[got[1]] = tensor
    if unknown:
        raise unknown_keys_error(unknown, layout)
    out: dict[str, Any] = {}
    alphas: dict[str, float] = {}
    for src, g in groups.items():
        if "A" not in g or "B" not in g:
            raise AdapterFormatError(f"{src}: has no {'lora_up' if 'A' in g else 'lora_down'} weight")
        down, up = g["A"], g["B"]
        if up.ndim != 2:
            raise AdapterFormatError(f"{src}: lora_up is not a matrix")
        if "alpha" in g and g["alpha"].numel() != 1:
            raise AdapterFormatError(f"{src}.alpha: not a scalar")
        modules, ratios = targets[src]
        for module, rows in zip(modules, up.split(split_rows(up.shape[0], ratios, src), dim=0), strict=True):
            out[f"{module}.lora_A.weight"] = down
            out[f"{module}.lora_B.weight"] = rows.contiguous()
            if "alpha" in g:
                alphas[module] = float(g["alpha"].item())
    return out, alphas


__all__ = ["SUFFIXES", "Target", "convert", "parse", "split_rows"]
