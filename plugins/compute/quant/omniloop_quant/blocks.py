"""The denoiser blocks whose linears omniloop-quant converts, and the ``linear_precision: fp8`` check
and apply the plugin registers (see the package docstring)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from omniloop.capabilities import capabilities_of
from omniloop.errors import DeployError

from .fp8 import ALIGN, FP8GeluProjection, FP8Linear, _children, install, unavailable_reason
from .options import fp8_options, keep_matcher

log = logging.getLogger("omniloop.quant")

#: values of the deploy's ``linear_precision``: ``fp8-fast`` is ``fp8`` with the GEMMs' fast
#: (reduced-precision) accumulation (``FP8Linear.fast_accum``); ``fp8-fast-except-down`` the same except
#: the feed-forwards' down projections (the largest reduction dimension), which keep full accumulation
MODES = ("dtype", "fp8", "fp8-fast", "fp8-fast-except-down")
#: each FP8 mode's accumulation: :func:`omniloop_quant.fp8.install`'s ``fast_accum`` / ``down_fast_accum``
ACCUMULATION: dict[str, dict[str, bool]] = {
    "fp8": {"fast_accum": False, "down_fast_accum": False},
    "fp8-fast": {"fast_accum": True, "down_fast_accum": True},
    "fp8-fast-except-down": {"fast_accum": True, "down_fast_accum": False},
}
_DEFAULT_BLOCK_LISTS = "blocks|transformer_blocks|single_transformer_blocks"


def denoiser_blocks(components: Mapping[str, Any], family: Any) -> list[tuple[str, nn.Module]]:
    """``(label, block)`` for every transformer block of the family's denoiser components present
    in ``components`` (see the module docstring for how they are found)."""
    caps = capabilities_of(family)
    declared = caps.quant_blocks
    if not declared:
        offload = dict(caps.offload.components) if caps.offload is not None else {}
        comps = (tuple(caps.adapters.components if caps.adapters is not None else ())
                 or tuple(n for n in offload if n.startswith("transformer")) or ("transformer",))
        declared = {c: offload.get(c) or _DEFAULT_BLOCK_LISTS for c in comps}
    out: list[tuple[str, nn.Module]] = []
    seen: list[nn.Module] = []
    for comp, paths in declared.items():
        module = components.get(comp)
        if not isinstance(module, nn.Module):
            continue
        listed = [paths] if isinstance(paths, str) else list(paths)  # FLUX declares a tuple of block lists
        for path in (p for entry in listed for p in str(entry).split("|")):
            obj: Any = module
            for part in path.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if isinstance(obj, (nn.ModuleList, nn.Sequential)) and not any(obj is b for b in seen):
                seen.append(obj)
                out += [(f"{comp}.{path}.{i}", block) for i, block in enumerate(obj)]
    return out


def stray_weights(blocks: list[tuple[str, nn.Module]]) -> list[str]:
    """Floating-point 2-D buffers named ``*weight*`` inside the blocks, outside any FP8 module: weights a
    family copied out of its linears (e.g. SD3's ``options.qkv: fused`` concatenates q/k/v into one
    buffer and multiplies by it directly). FP8 cannot reach them; :func:`apply` reports and warns."""
    out: list[str] = []
    for label, block in blocks:
        for path, module in block.named_modules():
            if isinstance(module, (FP8Linear, FP8GeluProjection)):
                continue
            for name, buf in module._buffers.items():
                if buf is not None and buf.dim() == 2 and buf.is_floating_point() and "weight" in name:
                    out.append(f"{label}.{path + '.' if path else ''}{name}")
    return out


def check_deploy(deploy: Any, family: Any, device: Any, dtype: Any) -> None:
    """Refuse, with one :class:`DeployError`, a ``linear_precision`` that cannot run in this
    deployment — before any weight loads."""
    mode = getattr(deploy, "linear_precision", "dtype")
    if mode == "dtype":
        return
    if mode not in MODES:
        raise DeployError(f"linear_precision: must be one of {', '.join(MODES)}, not {mode!r}")
    why = unavailable_reason(device, dtype)
    if why:
        raise DeployError(f"linear_precision: {mode!r} cannot run here: {why}")
    if getattr(deploy, "adapters", None):
        raise DeployError(f"linear_precision: {mode!r} does not combine with adapters (LoRA) yet: the adapters hook "
                          "and fuse into the linears (in the deploy dtype) that FP8 replaces; use linear_precision: dtype")
    fp8_options(deploy)  # the keep patterns' form (the core checked them against FP8Options already)
    if getattr(deploy, "offload", "none") != "none":
        raise DeployError(f"linear_precision: {mode!r} does not combine with offload: {deploy.offload!r} yet (untested); "
                          "use offload: none")


#: diffusers' fused projections (``fuse_qkv_projections`` / Wan's ``fuse_projections``, kept beside the separate
#: linears, which the deployment then no longer computes) and the separate projections each one's output stacks, in order
_FUSED = {"to_qkv": ("to_q", "to_k", "to_v"), "to_kv": ("to_k", "to_v"),
          "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"), "to_added_kv": ("add_k_proj", "add_v_proj")}


def _shadowed(block: nn.Module, path: str) -> tuple[str, int, int] | str | None:
    """What computes the projection at ``path`` in ``block`` instead of its own linear: a fused sibling linear as
    ``(its path, this projection's part, parts)`` (``("attn.to_qkv", 2, 3)`` for ``attn.to_v``); a 2-D weight buffer
    the family concatenated from the separate weights (omniloop-kit's ``options.qkv: fused``), which FP8 does not
    reach, as a description; or None."""
    parent_path, _, name = path.rpartition(".")
    parent = block.get_submodule(parent_path) if parent_path else block
    prefix = f"{parent_path}." if parent_path else ""
    for fused, names in _FUSED.items():
        if name in names and isinstance(getattr(parent, fused, None), nn.Linear):
            return f"{prefix}{fused}", names.index(name), len(names)
    if not any(name in names for names in _FUSED.values()):
        return None
    for bname, buf in parent._buffers.items():
        if buf is not None and buf.dim() == 2 and buf.is_floating_point() and "weight" in bname:
            return f"{prefix}{bname} (a concatenated copy of the projections' weights)"
    return None


def _keep(patterns: list[str], blocks: list[tuple[str, nn.Module]]
          ) -> tuple[Any, dict[str, tuple[int, frozenset[int]]], dict[str, list[str]]]:
    """``(exclude, parts, kept_in_fused)`` for :func:`~omniloop_quant.fp8.install` from the keep ``patterns``:
    ``exclude`` keeps what they match (None without patterns); a separate projection the deployment computes
    through a fused linear (``attn.to_v`` beside ``attn.to_qkv``) is kept as that part of the fused linear
    (``parts``: its path -> ``(parts, the parts kept)``, an :class:`~omniloop_quant.fp8.FP8PartLinear`; the
    fused linear kept whole where every part is kept); ``kept_in_fused``: fused path -> the projections kept in
    it. A pattern that matches no module in any block is one :class:`DeployError`, raised before any linear is
    swapped, naming the paths a block has; so is one the family computes through a weight buffer FP8 does not
    reach (omniloop-kit's ``options.qkv: fused``: the projections stay in the model dtype there anyway)."""
    if not patterns:
        return None, {}, {}
    matched, hits = keep_matcher(patterns)
    for _, block in blocks:
        for *_, path in _children(block, exclude=matched):
            matched(path)
    missing = [p for p, paths in hits.items() if not paths]
    if missing:
        label, first = blocks[0]
        paths = [path for _p, _n, child, path in _children(first)
                 if any(isinstance(m, nn.Linear) for m in child.modules())]  # those that hold a linear
        shown = ", ".join(paths[:24]) + (f" ... ({len(paths)} in all)" if len(paths) > 24 else "")
        raise DeployError(f"linear_precision_options.keep: {', '.join(map(repr, missing))} matched no module in "
                          f"any of the {len(blocks)} transformer blocks; a block's modules ({label}): {shown}")
    kept_parts: dict[str, set[int]] = {}
    counts: dict[str, int] = {}
    in_fused: dict[str, list[str]] = {}
    for label, block in blocks:
        for *_, path in _children(block, exclude=matched):
            other = _shadowed(block, path) if matched(path) else None
            if isinstance(other, str):
                raise DeployError(
                    f"linear_precision_options.keep: {path!r} ({label}) does not compute this deployment's "
                    f"projection: {other} does (the family fused the Q/K/V projections, e.g. options.qkv: fused), "
                    "which FP8 leaves in the model dtype anyway; deploy without the fusion to keep one projection")
            if other is not None:
                fused, part, count = other
                kept_parts.setdefault(fused, set()).add(part)
                counts[fused] = count
                if path not in in_fused.setdefault(fused, []):
                    in_fused[fused].append(path)
    whole = {f for f, ps in kept_parts.items() if len(ps) == counts[f]}
    parts = {f: (counts[f], frozenset(ps)) for f, ps in kept_parts.items() if f not in whole}

    def exclude(path: str) -> bool:
        return matched(path) or path in whole

    return exclude, parts, in_fused


def apply(model: Any, family: Any, deploy: Any) -> dict[str, Any] | None:
    """Swap the denoiser blocks' linears of a loaded ``model`` (a ``LoadedModel``) for FP8 ones,
    in place, keeping no bf16 copy; records ``model.config["linear_precision"]`` and returns the
    report (None for ``linear_precision: dtype``)."""
    mode = getattr(deploy, "linear_precision", "dtype")
    if mode == "dtype":
        return None
    blocks = denoiser_blocks(model.components, family)
    if not blocks:
        raise DeployError(f"linear_precision: {mode!r}: family {family.name!r} has no transformer "
                          "blocks to quantise (declare FamilyCapabilities(quant_blocks={component: 'blocks'}))")
    options = fp8_options(deploy)
    exclude, parts, in_fused = _keep(options.keep, blocks)
    report = install([b for _, b in blocks], keep_original=False, names=[n for n, _ in blocks], exclude=exclude,
                     parts=parts, **ACCUMULATION[mode])
    report = {"mode": mode, "blocks": len(blocks), **report, "stray_weights": stray_weights(blocks)}
    if options.keep:
        kept = [path for _, block in blocks for _p, _n, _c, path in _children(block, exclude=exclude) if exclude(path)]
        report["keep"] = list(options.keep)
        report["kept"] = {path: kept.count(path) for path in dict.fromkeys(kept)}  # path in a block -> blocks
        if in_fused:  # fused path -> the separate projections whose rows of it stay in the model dtype
            report["kept_in_fused"] = in_fused
            log.info("linear_precision %s: computed through fused projections, kept as their rows: %s", mode,
                     "; ".join(f"{f}: {', '.join(ps)}" for f, ps in in_fused.items()))
        log.info("linear_precision %s: kept in the model dtype (keep %s): %s", mode, options.keep,
                 ", ".join(f"{p} x{n}" for p, n in report["kept"].items()))
    model.config["linear_precision"] = report
    if report["stray_weights"]:
        log.warning("linear_precision fp8: %d weight buffer(s) used outside nn.Linear stay in the model dtype "
                    "(a family option that copies the linears' weights, e.g. SD3 qkv: fused): %s",
                    len(report["stray_weights"]), ", ".join(report["stray_weights"][:4]))
    if report["skipped"]:
        log.warning("linear_precision fp8: %d linear(s) kept in the model dtype (dimensions not multiples of %d): %s",
                    len(report["skipped"]), ALIGN, ", ".join(report["skipped"][:6]))
    log.info("linear_precision fp8: %d linears in %d blocks quantised", report["quantized"], len(blocks))
    return report


__all__ = ["ACCUMULATION", "MODES", "apply", "check_deploy", "denoiser_blocks", "stray_weights"]
