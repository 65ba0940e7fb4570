"""Regional compilation of the Stable Audio DiT: each block, as its :class:`BlockStep`, under
``torch.compile`` (the mechanics — deploy ``compile: true``, ``compile_backend`` / ``compile_mode``
/ ``compile_dynamic``, eager fallback when the pipeline must run eager — are the core's
:mod:`omniloop_kit.compile`)."""

from __future__ import annotations

from typing import Any

from omniloop_kit.compile import CompiledBlocks, blocks_for, compile_info, compile_options
from omniloop_kit.compile import compile_blocks as _compile_blocks

from .transformer import block_steps


def compile_blocks(model: Any, **settings: Any) -> CompiledBlocks:
    """Compile each block step of ``model`` (lazy: a step compiles on its first call)."""
    if type(model).__name__ == "StableAudio3DiTModel":
        from . import sa3

        return _compile_blocks(model, sa3.block_steps(model), **settings)
    return _compile_blocks(model, block_steps(model), **settings)


__all__ = ["blocks_for", "compile_blocks", "compile_info", "compile_options"]
