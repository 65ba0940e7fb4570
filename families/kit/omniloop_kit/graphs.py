"""Deploy ``options.cuda_graphs: true``: a denoiser's whole outer forward replayed as one CUDA graph.

A compiled step of a mid-sized model is bound by the host: the GEMMs take a few milliseconds of
GPU time, and launching a few hundred kernels (and, with regional compilation, checking each
compiled block's guards) costs about as much again. With this option a family captures its outer
forward — the compiled (or eager) blocks included — once per input shape, dtype and device, after
two warm-up calls on a side stream (compilation happens there); each later forward copies its
inputs into the captured buffers, replays the graph and returns a copy of the output. Same
kernels, same inputs: the same numbers as the forward it captured.

A family opts in by declaring ``cuda_graphs`` among its ``capabilities.options`` (a family that
does not is refused by the runtime in one line: ``options.cuda_graphs: family ... does not read
this option``), checking :func:`graph_option` before it reads any weight, and running its forward
through :func:`graphed` (Stable Audio Open; SD3 and FLUX.1 through the default
``omniloop_kit.denoise.DenoiseLoop.forward``, which does this with their ``model_forward``)::

    def forward(self, ctx, expert, batch, block_ctx):
        def run(bctx, **inputs):
            return my_forward(model, **inputs, block_ctx=bctx, blocks=blocks)
        return graphs.graphed(ctx, block_ctx, model, blocks is not None, run, batch)

The inputs are tensors, ``None`` or tuples of tensors (FLUX's rotary ``(cos, sin)``); anything
else is refused (a Python number would be baked into the graph). The graphs are kept per model
(a weak reference) and per key — the family's ``tag`` (e.g. compiled or not) and every input's
shape, dtype and device (:func:`graph_key`); at most :data:`MAX_GRAPHS` per model, a shape beyond
that runs as a plain forward (logged once per model).

Used only when nothing is bound inside the forward: a block interceptor, block taps or a plugin
that needs eager execution run that request's forward as a plain one (:func:`graphs_enabled`). A
cancelled request stops between steps, not between blocks (the graph has no host code). Refused
at load: a non-CUDA device, ``offload`` (weights move under host control), and — by
omniloop-adapters — unfused LoRA adapters (a graph would replay one adapter set for every request).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omniloop.errors import DeployError

log = logging.getLogger("omniloop_kit")

#: the deploy option this module serves
OPTION = "cuda_graphs"
#: graphs kept per model (one per input shape); a new shape beyond these runs without a graph
MAX_GRAPHS = 8

_GRAPHS: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
_FULL_LOGGED: weakref.WeakSet[Any] = weakref.WeakSet()
#: one forward at a time through the captured buffers (capture, input copies, replay, output copy)
_LOCK = threading.Lock()


def graph_option(options: Mapping[str, Any], device: Any) -> bool:
    """The checked ``options.cuda_graphs`` (false when absent): a boolean, on a CUDA device, without
    ``offload``. Call it before any weight is read."""
    value = options.get(OPTION, False)
    if not isinstance(value, bool):
        raise DeployError(f"options.cuda_graphs: expected true or false, got {value!r}")
    if not value:
        return False
    if device is None or torch.device(device).type != "cuda":
        raise DeployError(f"options.cuda_graphs: CUDA graphs need a CUDA device, not {device}")
    deploy = options.get("deploy")
    offload = getattr(deploy, "offload", "none")
    if offload not in (None, "none"):
        raise DeployError(f"options.cuda_graphs: not with offload: {offload} (the weights move under host control "
                          "between blocks; a graph cannot replay that)")
    return True


def graphs_enabled(ctx: Any, block_ctx: Any) -> bool:
    """The deploy asks for graphs and this forward may run as one (nothing bound per block)."""
    if getattr(ctx, "eager", False) or not (getattr(ctx, "options", None) or {}).get(OPTION):
        return False
    return block_ctx is None or (block_ctx.interceptor is None and block_ctx.block_tap is None)


def _describe(name: str, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device)
    if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple((tuple(v.shape), v.dtype, v.device) for v in value)
    raise TypeError(f"cuda_graphs: forward input {name!r} is a {type(value).__name__}; a captured forward takes "
                    "tensors, None or tuples of tensors")


def graph_key(tag: Any, inputs: Mapping[str, Any]) -> tuple[Any, ...]:
    """The key a graph is kept under: ``tag`` and each input's name, shape, dtype and device
    (``None`` for an absent input; a tuple of those for a tuple of tensors)."""
    return (tag, *((k, _describe(k, v)) for k, v in sorted(inputs.items())))


def _clone(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(v.clone() for v in value)
    return value.clone()


def _copy_into(static: Any, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, tuple):
        for s, v in zip(static, value, strict=True):
            s.copy_(v)
    else:
        static.copy_(value)


def _capture(fn: Callable[..., torch.Tensor], static: dict[str, Any]) -> tuple[Callable[[], None], torch.Tensor]:
    """Warm ``fn(**static)`` up twice on a side stream, capture it once: ``(replay, output)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compilation, cuBLAS handles, workspaces
            fn(**static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(**static)
    return graph.replay, out


def replay(model: Any, tag: Any, fn: Callable[..., torch.Tensor], inputs: dict[str, Any]) -> torch.Tensor:
    """``fn(**inputs)`` through the CUDA graph kept for ``model``, ``tag`` and the inputs' shapes
    and dtypes (captured on the first call); a new key past :data:`MAX_GRAPHS` runs ``fn`` plainly."""
    key = graph_key(tag, inputs)
    with _LOCK:
        graphs = _GRAPHS.setdefault(model, {})
        entry = graphs.get(key)
        if entry is None:
            if len(graphs) >= MAX_GRAPHS:
                if model not in _FULL_LOGGED:
                    _FULL_LOGGED.add(model)
                    log.warning("cuda_graphs: %s already keeps %d graphs; forwards of new input shapes run "
                                "without one", type(model).__name__, MAX_GRAPHS)
                return fn(**inputs)
            static = {k: _clone(v) for k, v in inputs.items()}
            run, out = _capture(fn, static)
            entry = graphs[key] = (run, static, out)
        run, static, out = entry
        for k, v in inputs.items():
            _copy_into(static[k], v)
        run()
        return out.clone()


def graphed(ctx: Any, block_ctx: Any, model: Any, tag: Any, fn: Callable[..., torch.Tensor],
            inputs: dict[str, Any]) -> torch.Tensor:
    """A family's forward, ``fn(bctx, **inputs)``: through a CUDA graph when the deploy asks for
    graphs and nothing is bound in the forward (:func:`graphs_enabled`), else called as it is."""
    if graphs_enabled(ctx, block_ctx):
        return replay(model, tag, lambda **kw: fn(None, **kw), inputs)
    return fn(block_ctx, **inputs)


def captured(model: Any) -> int:
    """How many graphs are kept for ``model``."""
    return len(_GRAPHS.get(model, {}))


def release(model: Any) -> None:
    """Drop ``model``'s graphs (their memory pools go with them)."""
    with _LOCK:
        _GRAPHS.pop(model, None)
        _FULL_LOGGED.discard(model)


__all__ = ["MAX_GRAPHS", "OPTION", "captured", "graph_key", "graph_option", "graphed", "graphs_enabled", "release",
           "replay"]
