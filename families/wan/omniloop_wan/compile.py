"""Regional compilation of Wan: each transformer block (``model.blocks``) under ``torch.compile``.

The mechanics — the deploy's ``compile: true``, the ``compile_backend`` / ``compile_mode`` /
``compile_dynamic`` options, wrappers kept beside the model, eager fallback when the pipeline
must run eager, the request metric — are omniloop-kit's :mod:`omniloop_kit.compile`. Wan's part is which
modules are its blocks (``model.blocks``) and that every loaded expert (``transformer``,
``transformer_2``) is compiled; ``wan_forward(..., blocks=blocks_for(model, ctx))`` runs them.

Compilation time shows in the first step of each new shape: request metrics carry
``denoise.first_step_seconds`` apart from ``denoise.steady_step_seconds`` and
``denoise.compile`` (:func:`omniloop_kit.compile.compile_info`).
"""

from __future__ import annotations

from typing import Any

from omniloop_kit.compile import CompiledBlocks, blocks_for, compile_info, compile_options, compiled, uncompile
from omniloop_kit.compile import compile_blocks as _compile_blocks


def compile_blocks(model: Any, **settings: Any) -> CompiledBlocks:
    """Compile each of ``model.blocks`` (lazy: a block compiles on its first call)."""
    return _compile_blocks(model, model.blocks, **settings)


__all__ = ["CompiledBlocks", "blocks_for", "compile_blocks", "compile_info", "compile_options", "compiled", "uncompile"]
