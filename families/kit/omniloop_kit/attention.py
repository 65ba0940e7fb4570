"""The deploy's attention backend inside a diffusers model's attention modules: a family's
processor (diffusers' op for op, attention computed by ``AttentionBackendSpec.fn(q, k, v)`` on
``[B, heads, L, D]``) derives from :class:`BackendProcessor`, and :func:`install` puts one on every
attention module of a model (Wan's ``WanAttention``).

* :meth:`BackendProcessor.attend` — ``[B, L, H, D]`` in and out like diffusers' dispatcher; a 2-D
  mask is broadcast over heads and queries; a backend declaring ``accepts_grid`` (``sparse-tile``)
  gets the self-attention token grid as ``grid=(T, H, W)``;
* :func:`set_token_grid` — the grid of the forward about to run, told to the model's grid-taking
  processors (eager, before the blocks: a backend's ``prepare_grid(grid, device)`` runs outside
  compiled code);
* :func:`installed`, :func:`restored` — the backend a model runs; diffusers' own processors put
  back for a while (reference runs, benchmarks).

A runtime loads its own modules, so runtimes do not interfere; modules shared by several runtimes
(``from_components``) carry the backend of the last one installed (a warning says so).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

log = logging.getLogger("omniloop_kit")

_INSTALLED: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
#: per model: the installed processors whose backend takes the token grid (``accepts_grid``)
_GRID_PROCESSORS: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = weakref.WeakKeyDictionary()


class BackendProcessor:
    """A diffusers attention processor computing attention with ``fn(q, k, v)`` (``[B, H, L, D]``)."""

    def __init__(self, fn: Callable[..., torch.Tensor], backend: str = "custom") -> None:
        self.fn = fn
        self.backend = backend
        #: the backend takes ``grid=(T, H, W)`` on self-attention calls (e.g. ``sparse-tile``)
        self.wants_grid = bool(getattr(fn, "accepts_grid", False))
        #: the latent token grid of the current forward (set by :func:`set_token_grid`)
        self.grid: tuple[int, int, int] | None = None

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None = None, grid: tuple[int, int, int] | None = None) -> torch.Tensor:
        """``[B, L, H, D]`` in and out, like diffusers' dispatcher; the backend sees ``[B, H, L, D]``."""
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
        if grid is not None and attention_mask is None:
            out = self.fn(q, k, v, grid=grid)
        elif attention_mask is None:
            out = self.fn(q, k, v)
        else:
            if attention_mask.ndim == 2 and attention_mask.shape[0] == q.shape[0]:
                attention_mask = attention_mask.unsqueeze(1).unsqueeze(1)
            out = self.fn(q, k, v, attn_mask=attention_mask)
        return out.permute(0, 2, 1, 3)


def install(model: torch.nn.Module, modules: Sequence[Any], make: Callable[[], BackendProcessor], name: str) -> int:
    """Put ``make()`` (a processor of the backend ``name``) on each of ``modules`` (``model``'s
    attention modules); returns how many got one."""
    previous = _INSTALLED.get(model)
    if previous is not None and previous != name:
        log.warning("attention backend of shared %s components changed from %r to %r: every runtime using "
                    "these modules now runs %r", type(model).__name__, previous, name, name)
    procs = []
    for m in modules:
        proc = make()
        m.set_processor(proc)
        if proc.wants_grid and not m.is_cross_attention:
            procs.append(proc)
    _INSTALLED[model] = name
    if procs:
        _GRID_PROCESSORS[model] = procs
    else:
        _GRID_PROCESSORS.pop(model, None)
    return len(modules)


def set_token_grid(model: torch.nn.Module, grid: tuple[int, int, int], device: Any) -> None:
    """Tell ``model``'s self-attention processors the latent token grid ``(frames, rows, columns)``
    of the forward about to run; a no-op unless the installed backend takes a grid."""
    procs = _GRID_PROCESSORS.get(model)
    if not procs:
        return
    grid = (int(grid[0]), int(grid[1]), int(grid[2]))
    prepared: set[int] = set()
    for proc in procs:
        proc.grid = grid
        prepare = getattr(proc.fn, "prepare_grid", None)
        if prepare is not None and id(proc.fn) not in prepared:
            prepare(grid, device)
            prepared.add(id(proc.fn))


def installed(model: torch.nn.Module) -> str | None:
    """The backend name installed on ``model``'s attention modules, or None (diffusers' own)."""
    return _INSTALLED.get(model)


@contextlib.contextmanager
def restored(modules: Sequence[Any], make: Callable[[], Any]) -> Iterator[None]:
    """Run ``modules`` with ``make()`` (diffusers' own processor), then put theirs back."""
    saved = [(m, m.processor) for m in modules]
    for m in modules:
        m.set_processor(make())
    try:
        yield
    finally:
        for m, proc in saved:
            m.set_processor(proc)


__all__ = ["BackendProcessor", "install", "installed", "restored", "set_token_grid"]
