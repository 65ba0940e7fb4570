"""Predictions the admission policy uses: seconds per step and bytes per request.

Both models start from a prior derived from the request's shape and are calibrated from what the
engine measures (exponential moving averages). A key is ``(model, (frames, height, width),
branches)``; an unseen key is predicted from a per-model coefficient, itself calibrated from every
measurement of that model, so the first long video on a fresh server is not predicted from the
image prior alone.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import torch
from attrs import define, evolve

from omniloop.execution import Execution
from omniloop.request import OmniRequest
from omniloop.resolved import Workload

GIB = 1024**3

# Priors. The per-model coefficients replace them after the first measurement.
#: seconds per FLOP-ish unit (see CostModel.units)
PRIOR_SECONDS_PER_UNIT = 2e-7
#: resident bytes per output pixel (latents, conditioning, decoded frames)
PRIOR_RESIDENT_PER_PIXEL = 16.0
#: peak activation bytes per output pixel and guidance branch during one step
PRIOR_PEAK_PER_PIXEL = 256.0


@define(frozen=True)
class RequestShape:
    """What the scheduler knows about a request's size before it runs (defaults resolved)."""

    model: str
    task: str
    frames: int
    height: int
    width: int
    steps: int
    branches: int

    @property
    def pixels(self) -> int:
        return self.frames * self.height * self.width

    @property
    def key(self) -> Hashable:
        return (self.model, (self.frames, self.height, self.width), self.branches)

    def describe(self) -> str:
        return f"{self.frames}x{self.height}x{self.width} {self.branches}br {self.steps}st"


def model_name(runtime: Any) -> str:
    deploy = getattr(runtime, "deploy", None)
    if deploy is not None and deploy.model.preset:
        return str(deploy.model.preset)
    return str(getattr(runtime, "model_path", "model"))


def shape_of(runtime: Any, request: OmniRequest | Execution) -> RequestShape:
    """A request's size as its family predicts it: the resolved request's ``workload()``.

    Given an :class:`~omniloop.execution.Execution` (what a scheduler holds) its ``resolved`` is
    read; given a bare request the runtime resolves it (``Runtime.resolve``). The scheduler never
    guesses a family's defaults, so a new family needs no edit here."""
    if isinstance(request, Execution):
        resolved, req = request.resolved, request.request
    else:
        resolved, req = runtime.resolve(request), request
    w: Workload = resolved.workload() if resolved is not None else Workload(steps=1)
    return RequestShape(model=model_name(runtime), task=req.task.value, frames=w.frames, height=w.height,
                        width=w.width, steps=w.steps, branches=w.branches)


def refine_shape(shape: RequestShape, loop: Any) -> RequestShape:
    """Correct branches and steps from a loop's state once its ``init`` ran."""
    try:
        return evolve(shape, branches=max(1, len(loop.branches)), steps=int(loop.total) or shape.steps)
    except Exception:
        return shape


def tensor_bytes(obj: Any, _depth: int = 0) -> int:
    """Bytes of the tensors reachable from ``obj`` (tensors, attrs artifacts, dicts, lists; shallow)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if _depth > 3:
        return 0
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v, _depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, _depth + 1) for v in obj)
    fields = getattr(type(obj), "__attrs_attrs__", None)
    if fields is not None:
        return sum(tensor_bytes(getattr(obj, f.name, None), _depth + 1) for f in fields)
    return 0


def execution_bytes(execution: Any) -> int:
    """What one execution holds right now: its artifacts, loop tensors and plugin state."""
    state = execution.state
    total = tensor_bytes(state.artifacts)
    for loop in state.loops.values():
        total += tensor_bytes(loop.tensors) + tensor_bytes(loop.plugin_state)
    return total


class _Ema:
    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.values: dict[Hashable, float] = {}
        self.counts: dict[Hashable, int] = {}

    def update(self, key: Hashable, value: float) -> None:
        old = self.values.get(key)
        self.values[key] = value if old is None else (1 - self.alpha) * old + self.alpha * value
        self.counts[key] = self.counts.get(key, 0) + 1

    def get(self, key: Hashable) -> float | None:
        return self.values.get(key)


class CostModel:
    """Predicted seconds per loop step from (model, shape, guidance branches)."""

    def __init__(self, alpha: float = 0.3, prior_seconds_per_unit: float = PRIOR_SECONDS_PER_UNIT) -> None:
        self._lock = threading.Lock()
        self._step = _Ema(alpha)  # key -> seconds per unbatched step
        self._unit = _Ema(alpha)  # model -> seconds per unit
        self._batch = _Ema(alpha)  # (key, n) -> seconds per member of a batch of n
        self.prior = prior_seconds_per_unit

    @staticmethod
    def units(shape: RequestShape) -> float:
        """FLOP-ish work of one step: linear layers ~ tokens, attention ~ tokens²; times branches."""
        tokens = max(1.0, shape.pixels / 64.0)  # one token per 8x8 pixels before patching
        return shape.branches * (tokens + tokens * tokens / 4096.0)

    def step_seconds(self, shape: RequestShape, batch: int = 1) -> float:
        with self._lock:
            if batch > 1:
                b = self._batch.get((shape.key, batch))
                if b is not None:
                    return b
            exact = self._step.get(shape.key)
            if exact is not None:
                return exact
            coef = self._unit.get(shape.model)
            return self.units(shape) * (self.prior if coef is None else coef)

    def remaining_seconds(self, shape: RequestShape, steps_left: int) -> float:
        return self.step_seconds(shape) * max(0, steps_left)

    def observe(self, shape: RequestShape, seconds: float, batch: int = 1) -> None:
        """One measured step: ``seconds`` per member when ``batch`` members ran together."""
        if seconds <= 0:
            return
        with self._lock:
            if batch > 1:
                self._batch.update((shape.key, batch), seconds)
                return
            self._step.update(shape.key, seconds)
            self._unit.update(shape.model, seconds / self.units(shape))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "step_seconds": {repr(k): v for k, v in self._step.values.items()},
                "seconds_per_unit": dict(self._unit.values),
            }


@define(frozen=True)
class MemoryEstimate:
    resident: int
    peak: int

    @property
    def total(self) -> int:
        return self.resident + self.peak


class MemoryModel:
    """Predicted resident and peak bytes of one request from (model, shape, branches).

    *Resident*: what a request holds between its steps (latents, embeddings, plugin caches,
    decoded frames), measured on any device by walking the execution's tensors. *Peak*: the extra
    transient memory of one step (activations), measured on CUDA from
    ``torch.cuda.max_memory_allocated`` deltas around each step; on CPU the prior is kept.
    """

    def __init__(self, alpha: float = 0.3, margin: float = 1.2) -> None:
        self._lock = threading.Lock()
        self.margin = margin
        self._resident = _Ema(alpha)  # key -> bytes
        self._peak = _Ema(alpha)  # key -> bytes per member
        self._res_px = _Ema(alpha)  # model -> bytes per pixel
        self._peak_px = _Ema(alpha)  # model -> bytes per pixel and branch

    def predict(self, shape: RequestShape) -> MemoryEstimate:
        with self._lock:
            res = self._resident.get(shape.key)
            if res is None:
                per_px = self._res_px.get(shape.model) or PRIOR_RESIDENT_PER_PIXEL
                res = per_px * shape.pixels
            peak = self._peak.get(shape.key)
            if peak is None:
                per_px = self._peak_px.get(shape.model) or PRIOR_PEAK_PER_PIXEL
                peak = per_px * shape.pixels * shape.branches
        return MemoryEstimate(int(res * self.margin), int(peak * self.margin))

    def observe_resident(self, shape: RequestShape, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            self._resident.update(shape.key, float(nbytes))
            self._res_px.update(shape.model, nbytes / max(1, shape.pixels))

    def observe_peak(self, shape: RequestShape, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            self._peak.update(shape.key, float(nbytes))
            self._peak_px.update(shape.model, nbytes / max(1, shape.pixels * shape.branches))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "resident_bytes": {repr(k): v for k, v in self._resident.values.items()},
                "peak_bytes": {repr(k): v for k, v in self._peak.values.items()},
            }


def total_estimate(estimates: Iterable[MemoryEstimate], max_batch: int) -> int:
    """Pool memory if these requests are resident together: every resident plus the peaks of the
    largest batch that could run at once (one forward at a time, up to ``max_batch`` members)."""
    ests = list(estimates)
    peaks = sorted((e.peak for e in ests), reverse=True)[:max_batch]
    return sum(e.resident for e in ests) + sum(peaks)
