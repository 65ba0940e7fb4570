"""omniloop-trace: activation statistics (mean, std, absmax) per tap and module, as JSONL.

Enable with ``plugins: {trace: {path: trace.jsonl, taps: '.*', blocks: 'blocks\\.\\d+$'}}``.
One line per (request, step, branch, name)::

    {"request_id": "...", "node": "denoise", "step": 3, "branch": "cond", "name": "blocks.2",
     "kind": "block", "timestep": 250.0, "shape": [1, 48, 32], "dtype": "float32",
     "mean": 0.01, "std": 0.98, "absmax": 4.1, "nonfinite": 0}
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from attrs import define, field

from omniloop.hookspecs import hookimpl
from omniloop.observers import TapFilter
from omniloop.schema import check_regex

if TYPE_CHECKING:
    import torch

__version__ = "0.1.0"

log = logging.getLogger("omniloop.trace")



@define(frozen=True)
class TraceConfig:
    """``path``: the JSONL file (``{request_id}`` gives one file per request); ``taps``: regex of
    tap names to trace (block outputs excluded); ``blocks``: regex of block names whose outputs to
    trace (forces eager block execution); ``append``: keep lines already in the file (else the
    file is truncated the first time this runtime writes it)."""

    path: str = "omniloop-trace.jsonl"
    taps: str = field(default=".*", validator=check_regex)
    blocks: str | None = field(default=None, validator=check_regex)
    append: bool = True


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def tensor_stats(value: torch.Tensor) -> dict[str, Any]:
    """mean, population std and absmax of a tensor (computed in float32 on its device; one sync)."""
    import torch  # on use: loading the trace plugin imports no torch (issue 42)

    with torch.no_grad():
        return _tensor_stats(value)


def _tensor_stats(value: torch.Tensor) -> dict[str, Any]:
    import torch

    x = value.detach()
    if x.is_complex():
        x = x.abs()
    x = x.float()
    n = x.numel()
    if n == 0:
        return {"mean": None, "std": None, "absmax": None, "nonfinite": 0}
    finite = torch.isfinite(x)
    mean, std, absmax, nfin = torch.stack(
        [
            x.mean(),
            x.std(correction=0),
            x.abs().max(),
            finite.sum().float(),
        ]
    ).tolist()
    return {"mean": _num(mean), "std": _num(std), "absmax": _num(absmax), "nonfinite": n - int(nfin)}


class ActivationTrace:
    """Observer object created by the ``trace`` plugin (one per runtime)."""

    def __init__(self, config: TraceConfig | None = None) -> None:
        self.config = config or TraceConfig()
        #: block taps need the blocks to run eagerly (no compiled block stack)
        self._select = TapFilter(self.config.taps, self.config.blocks, observer="trace", doing="tracing")
        self.needs_eager = self._select.needs_eager
        self._files: dict[str, IO[str]] = {}
        self._opened: set[str] = set()
        self.lines_written = 0

    def _file(self, request_id: str) -> IO[str]:
        path = self.config.path.format(request_id=request_id)
        fh = self._files.get(path)
        if fh is None:
            p = Path(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            mode = "a" if self.config.append or path in self._opened else "w"
            fh = open(p, mode, encoding="utf-8")
            self._opened.add(path)
            self._files[path] = fh
        return fh

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files.clear()

    @hookimpl
    def omniloop_wants_block_taps(self, node: str) -> Any:
        return self.config.blocks

    @hookimpl
    def omniloop_tap(self, request: Any, node: str, step: Any, name: str, value: Any) -> None:
        import torch
        if not isinstance(value, torch.Tensor):
            return
        kind = self._select.kind(name)
        if kind is None:
            return
        line = {
            "request_id": request.request_id,
            "node": node,
            "step": None if step is None else int(step.step_index),
            "branch": None if step is None else step.branch,
            "name": name,
            "kind": kind,
            "timestep": None if step is None else float(step.timestep),
            "shape": list(value.shape),
            "dtype": str(value.dtype).replace("torch.", ""),
            **tensor_stats(value),
        }
        self._file(request.request_id).write(json.dumps(line) + "\n")
        self.lines_written += 1

    @hookimpl
    def omniloop_step_end(self, request: Any, node: str, step: int, total: int, loop: Any, seconds: float) -> None:
        path = self.config.path.format(request_id=request.request_id)
        fh = self._files.get(path)
        if fh is not None:
            fh.flush()

    @hookimpl
    def omniloop_request_end(self, request: Any, output: Any) -> None:
        path = self.config.path.format(request_id=request.request_id)
        fh = self._files.get(path)
        if fh is None:
            return
        if "{request_id}" in self.config.path:  # one file per request: done with it
            fh.close()
            del self._files[path]
        else:
            fh.flush()


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a trace file as dicts."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


__all__ = ["ActivationTrace", "TraceConfig", "read_trace", "tensor_stats"]
