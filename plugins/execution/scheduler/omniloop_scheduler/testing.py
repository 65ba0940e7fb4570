"""Test helpers for schedulers and servers (CPU, toy family).

* :class:`Probe` — a step interceptor that records ``open``/``close`` per (request, branch) and
  injects an exception or NaN into chosen requests' steps: failure isolation and state release
  are tested with it.
* :class:`ProbePlugin` / :class:`DecisionRecorder` — in-process plugins registering the probe and
  an observer of ``schedule_decision`` events.
* :func:`make_runtime` — a toy runtime with this package's schedulers (``serial`` and ``step``);
  :func:`family_manager` / :func:`family_runtime` — the same for a family's tests: only the given
  plugins, the inline serial scheduler or (``step=True``) this package's ``step`` scheduler.
* :func:`req` — a small t2v request dict.
* :func:`engine_outputs` — requests submitted together to an :class:`AsyncEngine` over a runtime;
  their outputs and the engine (for its ``trace`` of schedule decisions).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from omniloop.family import PluginComponentSpec
from omniloop.hookspecs import hookimpl
from omniloop.runtime import Runtime
from omniloop.testing import PassThroughSteps, component_plugin, make_manager

from . import plugin as scheduler_plugin


class Probe(PassThroughSteps):
    """A step interceptor: records open/close per (request, branch); fails or NaNs chosen requests."""

    name = "probe"

    def __init__(self) -> None:
        self.fail_at: dict[str, int] = {}  # request id -> step index to raise at
        self.nan_at: dict[str, int] = {}
        self.opened: list[tuple[str, str | None]] = []
        self.closed: list[tuple[str, str | None]] = []
        self.lock = threading.Lock()

    def open(self, step: Any, loop: Any, params: Any = None) -> dict[str, Any]:
        with self.lock:
            self.opened.append((step.request_id, step.branch))
        return {"request_id": step.request_id, "branch": step.branch}

    def forward(self, step: Any, state: Any, inputs: Any, compute: Any) -> Any:
        at = self.fail_at.get(step.request_id)
        if at is not None and step.step_index >= at:
            raise RuntimeError(f"injected failure at step {step.step_index}")
        out = compute()
        at = self.nan_at.get(step.request_id)
        if at is not None and step.step_index >= at:
            out = out * float("nan")
        return out

    def close(self, state: Any) -> None:
        with self.lock:
            self.closed.append((state["request_id"], state["branch"]))


def ProbePlugin(probe: Probe) -> Any:  # was a class; the name stays for its callers
    """An in-process plugin registering ``probe`` as the step interceptor ``probe``."""
    return component_plugin("probe", "step_interceptor", lambda: probe)


class DecisionRecorder:
    """An observer that records ``schedule_decision`` events."""

    OMNILOOP_HOOK_API = ">=1.0,<2"

    def __init__(self) -> None:
        self.decisions: list[Any] = []

    @hookimpl
    def omniloop_register_observers(self, register: Any) -> None:
        register(PluginComponentSpec(name="recorder", kind="observer", factory=lambda cfg: self))

    @hookimpl
    def omniloop_schedule_decision(self, decision: Any) -> None:
        self.decisions.append(decision)


def make_runtime(checkpoint: Path, *plugins: tuple[str, Any], **deploy: Any) -> Runtime:
    """A toy runtime with the installed scheduler plugin (serial + step) instead of the inline serial."""
    manager = make_manager(("scheduler", scheduler_plugin), *plugins, scheduler=False)
    return Runtime.from_model(checkpoint, manager=manager, **deploy)


def engine_outputs(runtime: Runtime, requests: list[dict[str, Any]], scheduler: str = "step", max_batch: int = 4,
                   timeout: float = 60) -> tuple[list[Any], Any]:
    """Submit ``requests`` together to an :class:`~omniloop_scheduler.AsyncEngine` on ``runtime``
    (``scheduler``, ``max_batch``); wait for each (``timeout`` seconds each, twice that in all).
    Returns their outputs in order and the engine (``engine.trace`` lists its decisions)."""
    import asyncio

    from .engine import AsyncEngine

    async def main() -> tuple[list[Any], Any]:
        engine = AsyncEngine(runtime, scheduler, max_batch=max_batch)
        hs = [engine.submit(r) for r in requests]
        async with engine:
            return [await h.result(timeout=timeout) for h in hs], engine

    return asyncio.run(asyncio.wait_for(main(), 2 * timeout))


def family_manager(*plugins: tuple[str, Any], step: bool = False) -> Any:
    """A plugin manager with only ``plugins`` (a family's first; no toy family, no discovery) and the
    inline serial scheduler, or with ``step`` this package's schedulers instead."""
    if step:
        return make_manager(*plugins, ("scheduler", scheduler_plugin), toy=False, scheduler=False)
    return make_manager(*plugins, toy=False)


def family_runtime(checkpoint: Path, *plugins: tuple[str, Any], step: bool = False, **deploy: Any) -> Runtime:
    """A CPU float32 runtime over ``checkpoint`` with :func:`family_manager` (``plugins``, ``step``);
    with ``step`` the deploy runs the ``step`` scheduler with ``max_batch`` 4 unless ``deploy`` says
    otherwise."""
    if step:
        deploy = {"scheduler": "step", "scheduler_options": {"max_batch": 4}, **deploy}
    return Runtime.from_model(checkpoint, manager=family_manager(*plugins, step=step), **deploy)


def req(steps: int = 4, seed: int = 0, *, prompt: str = "a red fox", rid: str | None = None, **diffusion: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"task": "t2v", "prompt": prompt, "diffusion": {"steps": steps, "seed": seed, **diffusion}}
    if rid is not None:
        d["request_id"] = rid
    return d
