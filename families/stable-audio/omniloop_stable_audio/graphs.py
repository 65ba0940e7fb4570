"""Deploy ``options.cuda_graphs: true``: the whole DiT forward of a step replayed as one CUDA graph.

At Stable Audio Open's size a compiled step is bound by the host: the DiT's GEMMs take a few
milliseconds of GPU time, launching its few hundred kernels (and, with regional compilation,
checking 24 compiled blocks' guards) costs about as much again. With this option the family
captures its outer forward — the compiled (or eager) blocks included — once per input shape and
dtype, after two warm-up calls on a side stream (the compilation happens there), and each later
forward copies its inputs into the captured buffers, replays the graph and returns a copy of the
output. Same kernels, same inputs: the same numbers as the forward it captured.

Used only when nothing is bound inside the forward (no block interceptor, no block taps, no
observer that needs eager execution); a request that is cancelled stops between steps, not
between blocks (the graph has no host code). CUDA devices only (refused at load otherwise).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omniloop.errors import DeployError

_GRAPHS: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
#: one forward at a time through the captured buffers (capture, input copies, replay, output copy)
_LOCK = threading.Lock()


def graph_option(options: Mapping[str, Any], device: torch.device | None) -> bool:
    """The checked ``options.cuda_graphs`` (false when absent)."""
    value = options.get("cuda_graphs", False)
    if not isinstance(value, bool):
        raise DeployError(f"options.cuda_graphs: expected true or false, got {value!r}")
    if value and (device is None or torch.device(device).type != "cuda"):
        raise DeployError(f"options.cuda_graphs: CUDA graphs need a CUDA device, not {device}")
    return value


def prefetch_option(options: Mapping[str, Any]) -> bool:
    """The checked ``options.noise_prefetch`` (false when absent)."""
    value = options.get("noise_prefetch", False)
    if not isinstance(value, bool):
        raise DeployError(f"options.noise_prefetch: expected true or false, got {value!r}")
    return value


def graphs_enabled(ctx: Any, block_ctx: Any) -> bool:
    """The deploy asks for graphs and this forward may run as one (nothing bound per block)."""
    if getattr(ctx, "eager", False) or not (getattr(ctx, "options", None) or {}).get("cuda_graphs"):
        return False
    return block_ctx is None or (block_ctx.interceptor is None and block_ctx.block_tap is None)


def replay(model: Any, tag: Any, fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``fn(**inputs)`` through the CUDA graph kept for ``model``, ``tag`` and the inputs' shapes
    and dtypes (captured on the first call)."""
    with _LOCK:
        return _replay(model, tag, fn, inputs)


def _replay(model: Any, tag: Any, fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    key = (tag, *((k, tuple(v.shape), v.dtype, v.device) for k, v in sorted(inputs.items())))
    graphs = _GRAPHS.setdefault(model, {})
    entry = graphs.get(key)
    if entry is None:
        static = {k: v.clone() for k, v in inputs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: compilation, cuBLAS handles, workspaces
                fn(**static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(**static)
        entry = graphs[key] = (graph, static, out)
    graph, static, out = entry
    for k, v in inputs.items():
        static[k].copy_(v)
    graph.replay()
    return out.clone()


__all__ = ["graph_option", "graphs_enabled", "prefetch_option", "replay"]
