"""Regional compilation: ``torch.compile`` each transformer block, not the whole model.

Deploy ``compile: true`` compiles every block of every loaded transformer at load
(``torch.compile(block, fullgraph=True, dynamic=False)``, lazily: the first forward of a shape
compiles). The compiled blocks are wrappers around the same modules and weights, kept beside the
model; :func:`blocks_for` picks them for a forward unless the pipeline runs eager (``ctx.eager``:
an interceptor or observer declared ``needs_eager``), so the eager blocks stay untouched and both
can be used by the same loaded model. ``run_blocks`` then calls the compiled blocks in its plain
loop — or through a block interceptor, which runs outside the compiled regions.

``fullgraph=True`` makes a graph break inside a block an error at its first call instead of a
silent slow path. Options (deploy ``options``): ``compile_backend`` (default ``inductor``; tests
use ``eager``, which runs dynamo's tracing and graph-break checks without code generation),
``compile_mode`` (e.g. ``max-autotune-no-cudagraphs``), ``compile_dynamic`` (default false).

Compilation time shows in the first step of each new shape: request metrics carry
``denoise.first_step_seconds`` apart from ``denoise.steady_step_seconds``.

Components shared by several runtimes (``WanFamily.from_components``) share their compiled
blocks: the last load's settings win.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from attrs import define

from omniloop.errors import DeployError


@define
class CompiledBlocks:
    blocks: list[Any]
    backend: str
    mode: str | None
    dynamic: bool | None


_COMPILED: weakref.WeakKeyDictionary[torch.nn.Module, CompiledBlocks] = weakref.WeakKeyDictionary()


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
    if mode is not None and not isinstance(mode, str):
        raise DeployError(f"options.compile_mode: expected a torch.compile mode name, got {mode!r}")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise DeployError(f"options.compile_dynamic: expected true, false or null, got {dynamic!r}")
    if mode is not None and backend != "inductor":
        raise DeployError(f"options.compile_mode: {mode!r} needs compile_backend 'inductor', not {backend!r}")
    return {"backend": backend, "mode": mode, "dynamic": dynamic}


def compile_blocks(model: torch.nn.Module, *, backend: str = "inductor", mode: str | None = None,
                   dynamic: bool | None = False) -> CompiledBlocks:
    """Wrap each of ``model.blocks`` in ``torch.compile(fullgraph=True)`` (lazy: compiles on first call)."""
    have = _COMPILED.get(model)
    if have is not None and (have.backend, have.mode, have.dynamic) == (backend, mode, dynamic):
        return have
    kw: dict[str, Any] = {"backend": backend, "fullgraph": True, "dynamic": dynamic}
    if mode is not None:
        kw["mode"] = mode
    blocks = [torch.compile(block, **kw) for block in model.blocks]
    cb = CompiledBlocks(blocks=blocks, backend=backend, mode=mode, dynamic=dynamic)
    _COMPILED[model] = cb
    return cb


def compiled(model: torch.nn.Module) -> CompiledBlocks | None:
    return _COMPILED.get(model)


def uncompile(model: torch.nn.Module) -> None:
    _COMPILED.pop(model, None)


def _enabled(ctx: Any) -> bool:
    if ctx is None or getattr(ctx, "eager", False):
        return False
    deploy = (getattr(ctx, "options", None) or {}).get("deploy")
    return bool(getattr(deploy, "compile", False))


def blocks_for(model: torch.nn.Module, ctx: Any) -> Sequence[Any]:
    """The block list a forward of this pipeline runs: compiled when on and allowed, else eager."""
    if _enabled(ctx):
        cb = _COMPILED.get(model)
        if cb is not None:
            return cb.blocks
    return model.blocks  # type: ignore[return-value]


def compile_info(ctx: Any) -> dict[str, Any] | None:
    """What a request ran with, for its metrics (None when compile is off for this deployment)."""
    deploy = (getattr(ctx, "options", None) or {}).get("deploy")
    if not bool(getattr(deploy, "compile", False)):
        return None
    if getattr(ctx, "eager", False):
        return {"enabled": False, "reason": "an interceptor or observer needs eager execution"}
    models = [m for name, m in ctx.components.items() if name.startswith("transformer")]
    cbs = [_COMPILED.get(m) for m in models]
    if not all(cbs):
        return {"enabled": False, "reason": "blocks were not compiled at load"}
    cb = cbs[0]
    assert cb is not None
    return {"enabled": True, "regional": True, "blocks": sum(len(c.blocks) for c in cbs if c),
            "backend": cb.backend, "mode": cb.mode, "fullgraph": True}


__all__ = ["CompiledBlocks", "blocks_for", "compile_blocks", "compile_info", "compile_options", "compiled", "uncompile"]
