"""Regional compilation: ``torch.compile`` each Flux block (double- and single-stream), not the model.

Deploy ``compile: true`` compiles every block at load (``torch.compile(block, fullgraph=True,
dynamic=False)``, lazily: the first forward of a shape compiles), as the Wan family does. The
compiled wrappers are kept beside the model; :func:`blocks_for` picks them unless the pipeline runs
eager (an interceptor or observer declared ``needs_eager``). ``run_blocks`` calls them in its plain
loop — or through a block interceptor, which runs outside the compiled regions.

Options (deploy ``options``): ``compile_backend`` (default ``inductor``; tests use ``eager``),
``compile_mode``, ``compile_dynamic`` (default false).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from omniloop.errors import DeployError

from .transformer import all_blocks

_COMPILED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[Any, ...], list[Any]]] = weakref.WeakKeyDictionary()


def compile_options(options: Mapping[str, Any]) -> dict[str, Any] | None:
    """The compile settings of a deployment, or None when ``compile`` is off."""
    deploy = options.get("deploy")
    if not bool(getattr(deploy, "compile", False)):
        return None
    backend = options.get("compile_backend", "inductor")
    mode = options.get("compile_mode")
    dynamic = options.get("compile_dynamic", False)
    if not isinstance(backend, str):
        raise DeployError(f"options.compile_backend: expected a torch.compile backend name, got {backend!r}")
    if mode is not None and (not isinstance(mode, str) or backend != "inductor"):
        raise DeployError(f"options.compile_mode: a mode name needs compile_backend 'inductor', got {mode!r}")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise DeployError(f"options.compile_dynamic: expected true, false or null, got {dynamic!r}")
    return {"backend": backend, "mode": mode, "dynamic": dynamic}


def compile_blocks(model: torch.nn.Module, *, backend: str = "inductor", mode: str | None = None,
                   dynamic: bool | None = False) -> list[Any]:
    """Wrap each block in ``torch.compile(fullgraph=True)`` (lazy: compiles on first call)."""
    key = (backend, mode, dynamic)
    have = _COMPILED.get(model)
    if have is not None and have[0] == key:
        return have[1]
    kw: dict[str, Any] = {"backend": backend, "fullgraph": True, "dynamic": dynamic}
    if mode is not None:
        kw["mode"] = mode
    blocks = [torch.compile(block, **kw) for block in all_blocks(model)]
    _COMPILED[model] = (key, blocks)
    return blocks


def blocks_for(model: torch.nn.Module, ctx: Any) -> Sequence[Any] | None:
    """The compiled blocks when this deployment compiles and the pipeline may; else None (eager)."""
    if ctx is None or getattr(ctx, "eager", False):
        return None
    deploy = (getattr(ctx, "options", None) or {}).get("deploy")
    if not bool(getattr(deploy, "compile", False)):
        return None
    have = _COMPILED.get(model)
    return have[1] if have is not None else None


def compile_info(ctx: Any) -> dict[str, Any] | None:
    deploy = (getattr(ctx, "options", None) or {}).get("deploy")
    if not bool(getattr(deploy, "compile", False)):
        return None
    if getattr(ctx, "eager", False):
        return {"enabled": False, "reason": "an interceptor or observer needs eager execution"}
    have = _COMPILED.get(ctx.components["transformer"])
    if have is None:
        return {"enabled": False, "reason": "blocks were not compiled at load"}
    backend, mode, _ = have[0]
    return {"enabled": True, "regional": True, "blocks": len(have[1]), "backend": backend, "mode": mode, "fullgraph": True}
