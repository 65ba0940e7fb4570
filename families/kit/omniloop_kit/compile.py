"""Regional compilation: ``torch.compile`` each transformer block, not the whole model (omniloop-kit;
it was ``omniloop_kit.compile`` before omniloop 0.2: issue 34).

A family that runs its block stack through :func:`omniloop.interceptors.run_blocks` can compile
each block separately and keep the eager blocks untouched beside them, so one loaded model serves
both compiled requests and requests whose pipeline must run eager (an interceptor or observer
declared ``needs_eager``). The family decides only *which* modules are its blocks; the rest is
here:

- :func:`compile_options`: the deploy's compile settings, checked (call it at load, before any
  weight is read); ``None`` when the deploy's ``compile`` is off;
- :func:`compile_blocks`: wrap each block in ``torch.compile(block, fullgraph=True, ...)`` — lazy,
  the first forward of a shape compiles — and keep the wrappers beside the model (a weak
  reference: they go with the model);
- :func:`blocks_for`: the compiled blocks for one forward when the deploy compiles and the
  pipeline may (``ctx.eager`` is false), else ``None`` — the family's forward then runs its eager
  blocks;
- :func:`compile_info`: what a request ran with, for its metrics;
- :func:`compiled` / :func:`uncompile`: look up / drop a model's compiled blocks;
- :func:`wrapped_blocks`: a model's blocks each wrapped once per model (the unit a family
  compiles and runs when that is not the block module itself: SD3's joint step, Stable Audio's
  block step).

Deploy settings. The switch is the deploy's ``compile: true`` (:class:`omniloop.deploy.DeployConfig`);
``options`` refines it:

=====================  =====================================================================
``compile_backend``    ``torch.compile`` backend (default ``inductor``; ``eager`` runs dynamo's
                       tracing and graph-break checks without code generation — what CPU tests
                       use)
``compile_mode``       an inductor mode (``default``, ``reduce-overhead``, ``max-autotune``,
                       ``max-autotune-no-cudagraphs``, ... as this torch lists them); inductor only
``compile_dynamic``    ``torch.compile(dynamic=...)``: ``false`` (default: one graph per shape),
                       ``true`` or ``null`` (torch decides)
``compile_inductor``   inductor settings for the compiled blocks, ``torch.compile(options=...)``:
                       a mapping of ``torch._inductor.config`` names to booleans, numbers or
                       strings, e.g. ``{"triton.multi_kernel": 1}`` (persistent reductions up to
                       16× wider, the faster of the two variants picked by timing them — what
                       turns inductor's looped norm + modulation + FP8-quantisation reductions
                       into one pass over the row); inductor only, not with ``compile_mode``
                       (torch.compile takes one or the other). A caution from the H200 (torch
                       2.11, Triton 3.6, 2026-12-05): ``triton.multi_kernel`` gained 0.6 % on Wan's
                       FP8 step, and a second process that loaded the compiled blocks from
                       inductor's on-disk cache failed to compile (multi-kernel's cache lookup
                       inside Triton) — measure a setting, and restart with it, before serving it
=====================  =====================================================================

These are checked whether or not ``compile`` is on (a typo fails at load, not on the day compile
is switched on). ``options.compile`` is refused: the switch lives on the deploy, in one place.
Each problem raises one :class:`omniloop.errors.DeployError` naming the option.

``fullgraph=True`` makes a graph break inside a block an error at its first call instead of a
silent slow path. A block interceptor runs outside the compiled regions (``run_blocks`` calls the
compiled blocks in its loop). Components shared by several loaded models share their compiled
blocks: the last load's settings win.

Example (a family's load and forward)::

    from omniloop_kit.compile import blocks_for, compile_blocks, compile_options

    copts = compile_options(options)              # at load, before the weights
    ...
    if copts is not None:
        compile_blocks(transformer, transformer.blocks, **copts)
        model.config["compile"] = copts
    ...
    out = my_forward(transformer, ..., blocks=blocks_for(transformer, ctx))  # None: the eager blocks
"""

from __future__ import annotations

import difflib
import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from attrs import define

from omniloop.errors import DeployError

#: the ``options`` keys read here
OPTION_KEYS = frozenset({"compile_backend", "compile_mode", "compile_dynamic", "compile_inductor"})
#: the default ``compile_backend``
DEFAULT_BACKEND = "inductor"

__all__ = [
    "DEFAULT_BACKEND",
    "OPTION_KEYS",
    "CompiledBlocks",
    "blocks_for",
    "compile_blocks",
    "compile_enabled",
    "compile_info",
    "compile_options",
    "compiled",
    "uncompile",
    "wrapped_blocks",
]


@define
class CompiledBlocks:
    """A model's compiled block wrappers and the settings they were made with."""

    blocks: list[Any]
    backend: str
    mode: str | None
    dynamic: bool | None
    #: ``torch.compile(options=...)``: inductor settings (``compile_inductor``), or None
    options: dict[str, Any] | None = None
    #: ``id`` of each block the wrappers were made from: a model whose blocks were replaced since
    #: (e.g. a family's own block forwards installed) gets new wrappers, not ones running the old blocks
    sources: tuple[int, ...] = ()

    @property
    def settings(self) -> tuple[Any, ...]:
        return (self.backend, self.mode, self.dynamic, _frozen(self.options))


def _frozen(options: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    return None if options is None else tuple(sorted(options.items()))


_COMPILED: weakref.WeakKeyDictionary[Any, CompiledBlocks] = weakref.WeakKeyDictionary()
_WRAPPED: weakref.WeakKeyDictionary[Any, dict[Any, list[Any]]] = weakref.WeakKeyDictionary()


def _deploy_compiles(options: Mapping[str, Any] | None) -> bool:
    return bool(getattr((options or {}).get("deploy"), "compile", False))


def _inductor_modes() -> list[str] | None:
    """The mode names this torch's inductor knows, or None when it cannot tell."""
    try:
        from torch._inductor import list_mode_options

        return list(list_mode_options())
    except Exception:  # an older/newer torch without the helper: leave the mode to torch.compile
        return None


def _inductor_settings(value: Any) -> dict[str, Any]:
    """``compile_inductor`` checked: every name a setting of this torch's ``torch._inductor.config``,
    every value a boolean, a finite number or a string."""
    if not isinstance(value, Mapping) or not value:
        raise DeployError("options.compile_inductor: expected a non-empty mapping of inductor settings "
                          f"(e.g. {{'triton.multi_kernel': 1}}), got {value!r}")
    from torch._inductor import config as inductor_config

    known = set(inductor_config.get_config_copy())
    out: dict[str, Any] = {}
    for name, v in value.items():
        if not isinstance(name, str) or name not in known:
            close = difflib.get_close_matches(str(name), sorted(known), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise DeployError(f"options.compile_inductor: {name!r} is not a setting of this torch's inductor{hint}")
        if not isinstance(v, (bool, int, float, str)) or (isinstance(v, float) and not math.isfinite(v)):
            raise DeployError(f"options.compile_inductor.{name}: expected a boolean, a finite number or a string, "
                              f"got {v!r}")
        out[name] = v
    return out


def compile_options(options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The checked compile settings ``{"backend", "mode", "dynamic", "options"}`` of a deployment
    (``torch.compile``'s keyword arguments: ``options`` is ``compile_inductor`` or None), or
    ``None`` when the deploy's ``compile`` is off. Raises :class:`DeployError` for a bad value
    (checked even when compile is off)."""
    options = options or {}
    if "compile" in options:
        raise DeployError(
            f"options.compile: not an option (got {options['compile']!r}); "
            "switch compilation on with the deploy's own 'compile: true'"
        )
    backend = options.get("compile_backend", DEFAULT_BACKEND)
    mode = options.get("compile_mode")
    dynamic = options.get("compile_dynamic", False)
    if not isinstance(backend, str) or not backend:
        raise DeployError(f"options.compile_backend: expected a torch.compile backend name, got {backend!r}")
    if mode is not None:
        if not isinstance(mode, str) or not mode:
            raise DeployError(f"options.compile_mode: expected a torch.compile mode name, got {mode!r}")
        if backend != DEFAULT_BACKEND:
            raise DeployError(
                f"options.compile_mode: {mode!r} needs compile_backend {DEFAULT_BACKEND!r}, not {backend!r}"
            )
        known = _inductor_modes()
        if known is not None and mode not in known:
            raise DeployError(f"options.compile_mode: {mode!r} is not an inductor mode (known: {', '.join(known)})")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise DeployError(f"options.compile_dynamic: expected true, false or null, got {dynamic!r}")
    inductor = None
    if options.get("compile_inductor") is not None:
        if backend != DEFAULT_BACKEND:
            raise DeployError(f"options.compile_inductor: needs compile_backend {DEFAULT_BACKEND!r}, not {backend!r}")
        if mode is not None:
            raise DeployError("options.compile_inductor: not with compile_mode (torch.compile takes a mode or "
                              "inductor settings, not both; a mode is a named set of settings)")
        inductor = _inductor_settings(options["compile_inductor"])
    if not _deploy_compiles(options):
        return None
    return {"backend": backend, "mode": mode, "dynamic": dynamic, "options": inductor}


def compile_blocks(
    model: Any,
    blocks: Iterable[Any],
    *,
    backend: str = DEFAULT_BACKEND,
    mode: str | None = None,
    dynamic: bool | None = False,
    options: Mapping[str, Any] | None = None,
) -> CompiledBlocks:
    """Wrap each of ``blocks`` (the family's block stack of ``model``) in
    ``torch.compile(fullgraph=True)`` and keep the wrappers beside ``model``.

    Lazy: nothing compiles until a wrapper's first call. Called again with the same settings and the
    same block objects it returns the wrappers it made; with other settings, or blocks replaced since
    (a wrapper holds the module it was made from), it replaces them."""
    import torch

    inductor = dict(options) if options else None
    blocks = list(blocks)
    sources = tuple(id(b) for b in blocks)
    have = _COMPILED.get(model)
    if have is not None and have.settings == (backend, mode, dynamic, _frozen(inductor)) and have.sources == sources:
        return have
    kw: dict[str, Any] = {"backend": backend, "fullgraph": True, "dynamic": dynamic}
    if mode is not None:
        kw["mode"] = mode
    if inductor is not None:
        kw["options"] = dict(inductor)
    cb = CompiledBlocks(blocks=[torch.compile(block, **kw) for block in blocks], backend=backend, mode=mode,
                        dynamic=dynamic, options=inductor, sources=sources)
    _COMPILED[model] = cb
    return cb


def compiled(model: Any) -> CompiledBlocks | None:
    """The compiled blocks kept beside ``model``, if any."""
    return _COMPILED.get(model)


def uncompile(model: Any) -> None:
    """Drop ``model``'s compiled blocks (its forwards run the eager blocks again)."""
    _COMPILED.pop(model, None)


def compile_enabled(ctx: Any) -> bool:
    """Whether a forward in this stage context may run compiled blocks: the deploy compiles and
    nothing bound to the pipeline needs eager execution (``ctx.eager``)."""
    if ctx is None or getattr(ctx, "eager", False):
        return False
    return _deploy_compiles(getattr(ctx, "options", None))


def blocks_for(model: Any, ctx: Any) -> Sequence[Any] | None:
    """The compiled blocks of ``model`` for a forward in ``ctx``, or ``None``: run the eager ones."""
    if not compile_enabled(ctx):
        return None
    cb = _COMPILED.get(model)
    return cb.blocks if cb is not None else None


def compile_info(ctx: Any, models: Sequence[Any] | None = None) -> dict[str, Any] | None:
    """What a request ran with, for its metrics: ``None`` when the deploy does not compile, else
    ``{"enabled": False, "reason": ...}`` or ``{"enabled": True, "regional": True, "blocks": n,
    "backend", "mode", "fullgraph": True}``. ``models``: the compiled models (default: every
    component whose name starts with ``transformer``)."""
    if not _deploy_compiles(getattr(ctx, "options", None)):
        return None
    if getattr(ctx, "eager", False):
        return {"enabled": False, "reason": "an interceptor or observer needs eager execution"}
    if models is None:
        models = [m for name, m in ctx.components.items() if name.startswith("transformer")]
    cbs = [_COMPILED.get(m) for m in models]
    if not cbs or any(cb is None for cb in cbs):
        return {"enabled": False, "reason": "blocks were not compiled at load"}
    first = cbs[0]
    assert first is not None
    info = {"enabled": True, "regional": True, "blocks": sum(len(cb.blocks) for cb in cbs if cb is not None),
            "backend": first.backend, "mode": first.mode, "fullgraph": True}
    if first.options:
        info["inductor"] = dict(first.options)
    return info


def wrapped_blocks(model: Any, wrap: Callable[[Any], Any], blocks: str = "transformer_blocks") -> list[Any]:
    """``model``'s blocks (``model.<blocks>``) each as ``wrap(block)`` — the unit a family compiles
    and runs (SD3's joint step, Stable Audio's block step) — built once per model and ``wrap``."""
    per_model = _WRAPPED.setdefault(model, {})
    if wrap not in per_model:
        per_model[wrap] = [wrap(b) for b in getattr(model, blocks)]
    return per_model[wrap]
