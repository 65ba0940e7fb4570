"""Regional compilation of SD3: each joint block, as its :class:`JointStep`, under ``torch.compile``.

The mechanics — the deploy's ``compile: true``, the ``compile_backend`` / ``compile_mode`` /
``compile_dynamic`` options, wrappers kept beside the model, eager fallback when the pipeline
must run eager — are omniloop-kit's :mod:`omniloop_kit.compile`. SD3's part is what a block is: the
:class:`~omniloop_sd3.transformer.JointStep` wrappers of ``transformer_blocks``, so the
split/concatenate of the joint sequence is inside each compiled region and inductor writes each
block's two outputs straight into the joint buffer.
"""

from __future__ import annotations

from typing import Any

from omniloop_kit.compile import CompiledBlocks, blocks_for, compile_info, compile_options, compiled, uncompile
from omniloop_kit.compile import compile_blocks as _compile_blocks

from .transformer import joint_steps


def compile_blocks(model: Any, **settings: Any) -> CompiledBlocks:
    """Compile each joint step of ``model`` (lazy: a step compiles on its first call)."""
    return _compile_blocks(model, joint_steps(model), **settings)


__all__ = ["CompiledBlocks", "blocks_for", "compile_blocks", "compile_info", "compile_options", "compiled", "uncompile"]
