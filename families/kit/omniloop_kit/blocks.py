"""A family's own block forwards in place of diffusers' blocks, sharing their modules.

When a family needs a block to compute something diffusers' forward cannot (FLUX.1's per-request
modulation and its single blocks' fused MLP, Wan's fused norm + e4m3 fronts), it writes a block
module that takes over a diffusers block's *child modules* under the same attribute names and puts
it in the block list (``model.blocks[i]``, ``model.transformer_blocks[i]``, ...). Everything that
finds modules by name keeps finding them: state-dict keys, LoRA targets, FP8 linear swaps,
offload hooks on the block (installed after the family's load), regional compilation (which wraps
whatever the list holds — :func:`omniloop_kit.compile.compile_blocks` makes new wrappers when the
list's blocks changed). The family's block computes diffusers' operations in diffusers' order when
nothing is asked of it, so a parity test against diffusers can say ``torch.equal``.

:func:`replace` does the swap (once per model; the diffusers blocks are kept for :func:`restore`),
:func:`replaced` says whether it happened::

    from omniloop_kit import blocks

    blocks.replace(transformer, {"blocks": MyBlock})     # before compiling the blocks
    ...
    blocks.restore(transformer)                           # diffusers' blocks back

Used by omniloop_flux.blocks and omniloop_wan.blocks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

_ORIGINALS: weakref.WeakKeyDictionary[Any, dict[str, list[Any]]] = weakref.WeakKeyDictionary()


def replace(model: Any, make: Mapping[str, Callable[[Any], Any]]) -> int:
    """For each ``list name -> make`` put ``make(block)`` in place of every block of ``model.<list name>``
    (in place); returns how many blocks ``model`` has replaced. Called again for the same model it
    changes nothing (the family updates its own blocks' settings itself)."""
    if model in _ORIGINALS:
        return sum(len(v) for v in _ORIGINALS[model].values())
    originals: dict[str, list[Any]] = {}
    for name, build in make.items():
        stack = getattr(model, name)
        originals[name] = list(stack)
        for i, block in enumerate(originals[name]):
            stack[i] = build(block)
    _ORIGINALS[model] = originals
    return sum(len(v) for v in originals.values())


def restore(model: Any) -> int:
    """Put the blocks :func:`replace` took out back (no-op when it was not called); returns how many."""
    originals = _ORIGINALS.pop(model, {})
    for name, blocks in originals.items():
        stack = getattr(model, name)
        for i, block in enumerate(blocks):
            stack[i] = block
    return sum(len(v) for v in originals.values())


def replaced(model: Any) -> bool:
    return model in _ORIGINALS


__all__ = ["replace", "replaced", "restore"]
