"""Regional compilation: ``torch.compile`` each joint block (as its :class:`JointStep`), not the model.

Deploy ``compile: true`` wraps every joint step of the loaded transformer in
``torch.compile(fullgraph=True, dynamic=False)`` at load (lazy: the first forward of a shape
compiles). The compiled steps share the modules and weights of the eager ones; :func:`blocks_for`
picks them unless the pipeline runs eager (an interceptor or observer declared ``needs_eager``).
``run_blocks`` calls them in its plain loop — or through a block interceptor, which then runs
outside the compiled regions. The split/concatenate of the joint sequence is inside each compiled
region, so inductor writes each block's two outputs straight into the joint buffer.

Options (deploy ``options``): ``compile_backend`` (default ``inductor``; ``eager`` checks tracing
without code generation), ``compile_mode`` (inductor only), ``compile_dynamic`` (default false).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from omniloop.errors import DeployError

from .transformer import joint_steps

_COMPILED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[Any, ...], list[Any]]] = weakref.WeakKeyDictionary()


def compile_options(options: Mapping[str, Any]) -> dict[str, Any] | None:
    """The compile settings of a deployment, or None when ``compile`` is off."""
    deploy = options.get("deploy")
    if not bool(getattr(deploy, "compile", False) or options.get("compile", False)):
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
                   dynamic: bool | None = False) -> list[Any]:
    """Each joint step of ``model`` under ``torch.compile(fullgraph=True)`` (kept beside the model)."""
    key = (backend, mode, dynamic)
    have = _COMPILED.get(model)
    if have is not None and have[0] == key:
        return have[1]
    kw: dict[str, Any] = {"backend": backend, "fullgraph": True, "dynamic": dynamic}
    if mode is not None:
        kw["mode"] = mode
    steps = [torch.compile(step, **kw) for step in joint_steps(model)]
    _COMPILED[model] = (key, steps)
    return steps


def blocks_for(model: torch.nn.Module, ctx: Any) -> Sequence[Any] | None:
    """The compiled steps when this deployment compiles and nothing needs eager; else None (eager)."""
    if ctx is None or getattr(ctx, "eager", False):
        return None
    have = _COMPILED.get(model)
    if have is None:
        return None
    opts = getattr(ctx, "options", None) or {}
    if compile_options(opts) is None:
        return None
    return have[1]


__all__ = ["blocks_for", "compile_blocks", "compile_options"]
