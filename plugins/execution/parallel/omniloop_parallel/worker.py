"""The worker process: one rank of the SPMD pool.

Every rank loads the deploy's model once and then follows rank 0's decisions, broadcast with
``broadcast_object_list`` over the process group:

* ``("tick",)`` — nothing to do (rank 0 broadcasts one every ``tick_s`` while idle, so an idle
  pool never reaches the collective timeout and a dead peer shows up within a tick);
* ``("run", request)`` — every rank prepares the request; then after each unit
  (``Execution.advance``) rank 0 broadcasts ``go``, ``done`` or ``abort`` (an abort from the front
  end reaches every rank at the next step boundary, and each cancels its execution);
* ``("stop",)`` — leave.

Only rank 0 talks to the front end (a pipe): it forwards each unit's events and the output.
"""

from __future__ import annotations

import importlib
import os
import traceback
from typing import Any

import attrs
import torch
import torch.distributed as dist

from .group import init_group
from .transports import transport_for


def load_manager(spec: str | None) -> Any:
    """``"module:callable"`` → the PluginManager it returns; None → the installed entry points."""
    if spec is None:
        return None
    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)()


def _bcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main(rank: int, world: int, port: int, backend: str, timeout_s: float, deploy: Any, manager: str | None,
         threads: int, tick_s: float, conn: Any) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    init_group(rank, world, port, backend, timeout_s)
    lead = rank == 0
    try:
        from omniloop.runtime import Runtime

        if str(deploy.device).startswith("cuda"):
            torch.cuda.set_device(rank)
            deploy = attrs.evolve(deploy, device=f"cuda:{rank}")
        err = None
        try:
            runtime = Runtime(deploy, manager=load_manager(manager))
            runtime.transport = transport_for(deploy.transport)  # how rank 0 hands the output over
        except Exception as exc:  # reported by rank 0 (every rank fails the same way)
            err = f"{type(exc).__name__}: {exc}"
        errors: list[Any] = [None] * world
        dist.all_gather_object(errors, err)
        bad = next((e for e in errors if e), None)
        if lead:
            conn.send(("error", bad) if bad else ("ready", os.getpid()))
        if bad:
            return
        while True:
            cmd = None
            if lead:
                cmd = conn.recv() if conn.poll(tick_s) else ("tick",)
            cmd = _bcast(cmd)
            op = cmd[0]
            if op == "tick":
                continue
            if op == "stop":
                return
            if op == "describe":  # every rank's view, gathered (tests, diagnostics)
                views: list[Any] = [None] * world
                dist.all_gather_object(views, _describe(runtime, rank))
                if lead:
                    conn.send(("describe", views))
                continue
            if op == "run":
                _run(runtime, cmd[1], lead, conn)
    except Exception:
        if lead:
            try:
                conn.send(("crash", traceback.format_exc(limit=8)))
            except Exception:
                pass
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _run(runtime: Any, request: Any, lead: bool, conn: Any) -> None:
    try:
        execution = runtime.prepare(request)
        err = None
    except Exception as exc:
        execution, err = None, exc
    if execution is None:
        if lead:
            conn.send(("refused", f"{type(err).__name__}: {err}"))
        return
    rid = execution.request_id
    aborted = False
    while True:
        events = execution.advance()
        decision = None
        if lead:
            if events:
                conn.send(("events", rid, [e for e in events if e.output is None]))
            while not aborted and conn.poll(0):
                msg = conn.recv()
                if msg[0] == "abort" and msg[1] == rid:
                    aborted = True
                    decision = "abort"
            if decision is None:
                decision = "done" if execution.done else "go"
        decision = _bcast(decision)
        if decision == "abort" and not execution.done:
            execution.cancel()
            aborted = True
        if decision == "done":
            break
    # every rank's view of the request (its plugins' metrics: e.g. cache-dit's decisions per rank)
    out = execution.output
    mine = {"rank": dist.get_rank(), "status": str(out.status), "plugins": out.metrics.get("plugins", {}),
            "parallel": out.metrics.get("parallel")}
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    if lead:
        out.metrics["ranks"] = views
        conn.send(("output", rid, runtime.transport.encode(out)))


def _describe(runtime: Any, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": rank, "pid": os.getpid(), **runtime.describe()}
    tf = runtime.model.components.get("transformer")
    blocks = getattr(tf, "blocks", None)
    if blocks is not None and len(blocks):
        out["self_attention"] = repr(blocks[0].attn1.processor)
    return out
