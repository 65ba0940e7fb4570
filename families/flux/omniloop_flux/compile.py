"""Regional compilation of Flux: each double- and single-stream block under ``torch.compile``.

The mechanics — the deploy's ``compile: true``, the ``compile_backend`` / ``compile_mode`` /
``compile_dynamic`` options, wrappers kept beside the model, eager fallback when the pipeline
must run eager, the request metric — are omniloop-kit's :mod:`omniloop_kit.compile`. Flux's part is its
block stack: :func:`omniloop_flux.transformer.all_blocks` (double-stream, then single-stream), the
order ``flux_forward`` runs them in.
"""

from __future__ import annotations

from typing import Any

from omniloop_kit.compile import CompiledBlocks, blocks_for, compile_info, compile_options, compiled, uncompile
from omniloop_kit.compile import compile_blocks as _compile_blocks

from .transformer import all_blocks


def compile_blocks(model: Any, **settings: Any) -> CompiledBlocks:
    """Compile each block of :func:`all_blocks` (lazy: a block compiles on its first call)."""
    return _compile_blocks(model, all_blocks(model), **settings)


__all__ = ["CompiledBlocks", "blocks_for", "compile_blocks", "compile_info", "compile_options", "compiled", "uncompile"]
