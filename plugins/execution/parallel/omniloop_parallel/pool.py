"""The front end of the worker pool: :class:`ParallelRuntime`.

It validates the deploy with :class:`omniloop.runtime.Deployment` (``parallel: {sp, cfg}`` and
everything else, no weights read), checks each request the same way before sending it, spawns the
``sp * cfg`` workers and talks to rank 0 through a pipe. While it waits it watches every worker:
one that exits (killed, out of memory, crashed) fails the request in flight with
:class:`WorkerDied`'s message (status ``failed``), the remaining workers are stopped and the pool
is started again for the next request. Every wait has a deadline; nothing hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from omniloop.deploy import DeployConfig, load_deploy
from omniloop.errors import DeployError, OmniloopError
from omniloop.request import ErrorInfo, EventKind, OmniEvent, OmniOutput, OmniRequest, Status
from omniloop.runtime import Deployment
from omniloop.schema import request_from_dict
from omniloop.streams import final_output

from . import worker
from .group import backend_for, free_port
from .transports import transport_for


class WorkerDied(OmniloopError):
    """A worker process of the pool exited while it was needed."""


#: the worker processes' names (``omniloop-parallel-rank0`` ...)
WORKER_NAME = "omniloop-parallel-rank"
MAIN_GUARD_HINT = (
    "the workers are spawned processes that import your script again: build the runtime under "
    "`if __name__ == \"__main__\":` (or in a function called from there), never at the script's top level"
)


def _script_without_guard() -> bool:
    """Whether the main module is a script file whose top level builds a runtime (it has no
    ``if __name__ == "__main__":`` guard): then a spawned worker re-runs it and dies."""
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return False
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return "__name__" not in text or "__main__" not in text


class ParallelRuntime:
    """A deployment whose compute runs in ``parallel.sp * parallel.cfg`` worker processes.

    ``manager``: ``"module:callable"`` returning the PluginManager the workers use (the workers are
    fresh processes; default: the installed entry points), or a PluginManager object (used for the
    front's checks only; the workers then discover the installed entry points). ``timeout_s``: the deadline of every
    wait for rank 0 during a request (one unit of work, i.e. one step): a worker that stalls longer
    fails the request and the pool restarts. ``load_timeout_s``: the deadline for loading the model
    and the collectives' own timeout (ranks may load at different speeds). Requests run one at a
    time (callers from several threads are serialised)."""

    def __init__(self, deploy: DeployConfig | Mapping[str, Any] | str | os.PathLike[str], *,
                 manager: Any = None, timeout_s: float = 120.0, load_timeout_s: float = 600.0,
                 threads: int = 1, tick_s: float = 0.5) -> None:
        if mp.current_process().name.startswith(WORKER_NAME):  # a worker re-importing its parent's script
            raise RuntimeError(MAIN_GUARD_HINT)
        self.deploy = load_deploy(deploy)
        self.manager_spec = manager if isinstance(manager, str) else None  # what the workers load
        pm = worker.load_manager(manager) if isinstance(manager, str) else manager
        self.deployment = Deployment(self.deploy, manager=pm)  # validates; no weights
        self.world = self.deploy.parallel.world_size
        self.backend = backend_for(self.deploy.device)
        self.timeout_s, self.threads, self.tick_s = timeout_s, threads, tick_s
        self.load_timeout_s = max(load_timeout_s, timeout_s)
        self._lock = threading.Lock()
        self.restarts = 0
        self.transport = transport_for(self.deploy.transport)
        self._procs: list[Any] = []
        self._conn: Any = None
        self._start()

    @property
    def supported_tasks(self) -> frozenset[Any]:
        """The tasks the checkpoint can do, as far as is known without loading it here (the
        workers load it): what front ends advertise (``Runtime.supported_tasks``)."""
        return self.deployment.supported_tasks

    # -- pool lifecycle --------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        parent, child = ctx.Pipe(duplex=True)
        self._procs = []
        for rank in range(self.world):
            p = ctx.Process(
                target=worker.main, name=f"{WORKER_NAME}{rank}", daemon=True,
                args=(rank, self.world, port, self.backend, self.load_timeout_s, self.deploy, self.manager_spec,
                      self.threads, self.tick_s, child if rank == 0 else None),
            )
            p.start()
            self._procs.append(p)
        child.close()
        self._conn = parent
        msg = self._recv(time.monotonic() + self.load_timeout_s, "loading the model", self.load_timeout_s)
        if msg[0] != "ready":
            self._stop_procs()
            raise DeployError(f"parallel: the workers could not load the deployment: {msg[1]}")

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, rank by rank."""
        return [int(p.pid) for p in self._procs]

    def _dead(self) -> str | None:
        for rank, p in enumerate(self._procs):
            if p.exitcode is not None:
                how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                return f"worker rank {rank} (pid {p.pid}) died ({how})"
        return None

    def _recv(self, deadline: float, what: str, limit: float | None = None) -> Any:
        while True:
            dead = self._dead()
            if dead is not None:
                hint = f"; {MAIN_GUARD_HINT}" if what == "loading the model" and _script_without_guard() else ""
                raise WorkerDied(f"{dead} while {what}{hint}")
            try:
                if self._conn.poll(0.1):
                    return self._conn.recv()
            except (EOFError, OSError):
                time.sleep(0.2)  # rank 0's end closed: it is exiting; name it on the next pass
                if self._dead() is None:
                    raise WorkerDied(f"worker rank 0 closed its pipe while {what}") from None
                continue
            if time.monotonic() > deadline:
                raise WorkerDied(f"no answer from the workers for {limit or self.timeout_s:g} s while {what}")

    def _stop_procs(self) -> None:
        for p in self._procs:
            if p.exitcode is None:
                p.terminate()
        for p in self._procs:
            p.join(2)
            if p.exitcode is None and p.pid is not None:  # stopped or ignoring SIGTERM
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._procs = []

    def _restart(self) -> None:
        self._stop_procs()
        self.restarts += 1
        self._start()

    def close(self) -> None:
        """Stop the workers (rank 0 is asked; any left after 5 s are terminated)."""
        if self._conn is not None and self._dead() is None:
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
            for p in self._procs:
                p.join(5)
        self._stop_procs()

    def __enter__(self) -> ParallelRuntime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- requests ---------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """Cancel ``request_id``: every rank cancels it at the next step boundary."""
        if self._conn is not None:
            self._conn.send(("abort", request_id))

    def describe(self) -> list[dict[str, Any]]:
        """Every rank's ``Runtime.describe()`` plus its self-attention processor, rank by rank."""
        if self._dead() is not None or self._conn is None:
            self._restart()
        self._conn.send(("describe",))
        msg = self._recv(time.monotonic() + self.timeout_s, "describing the workers")
        return list(msg[1])

    def stream(self, request: OmniRequest | Mapping[str, Any]) -> Iterator[OmniEvent]:
        """Run ``request`` through the pool (one at a time; see :meth:`_stream`)."""
        with self._lock:
            yield from self._stream(request)

    def _stream(self, request: OmniRequest | Mapping[str, Any]) -> Iterator[OmniEvent]:
        """Check ``request`` (no weights needed, before the workers see it), run it on every rank,
        yield rank 0's events and a final event. A worker dying fails it (status ``failed``) and
        restarts the pool."""
        req = request if isinstance(request, OmniRequest) else request_from_dict(request)
        req = self.deployment.check(req)
        if self._dead() is not None or self._conn is None:
            self._restart()
        self._conn.send(("run", req))
        while True:
            try:
                msg = self._recv(time.monotonic() + self.timeout_s, f"running request {req.request_id!r}")
            except WorkerDied as exc:
                yield self._failed(req, str(exc))
                return
            if msg[0] == "events":
                try:
                    yield from msg[2]
                except GeneratorExit:  # the caller left mid-request: abort it on every rank, then drain
                    self._abandon(req)
                    raise
            elif msg[0] == "refused":
                raise DeployError(f"parallel: the workers refused the request: {msg[1]}")
            elif msg[0] == "crash":  # rank 0 left its loop, most often because a peer died mid-collective
                dead = self._wait_dead(2.0)
                why = dead or f"worker rank 0 failed: {msg[1].strip().splitlines()[-1]}"
                yield self._failed(req, f"{why} while running request {req.request_id!r}")
                return
            elif msg[0] == "output":
                out = self.transport.decode(msg[2])
                if not out.ok:  # a collective failed inside a step because a peer died: name the death
                    dead = self._wait_dead(0.5)
                    if dead is not None:
                        yield self._failed(req, f"{dead} while running request {req.request_id!r}")
                        return
                yield OmniEvent(request_id=req.request_id, kind=EventKind.FINAL, output=out)
                return

    def _abandon(self, req: OmniRequest) -> None:
        """The stream of ``req`` was closed early: abort it (every rank, next step boundary) and read
        what it still sends until its output, so the next request starts on a clean pipe."""
        try:
            self.abort(req.request_id)
            deadline = time.monotonic() + self.timeout_s
            while True:
                msg = self._recv(deadline, f"aborting request {req.request_id!r}")
                if msg[0] in ("output", "refused"):
                    return
                if msg[0] == "crash":
                    raise WorkerDied(msg[1])
                deadline = time.monotonic() + self.timeout_s
        except (WorkerDied, OSError):
            self._stop_procs()
            self.restarts += 1
            self._start()

    def _wait_dead(self, seconds: float) -> str | None:
        deadline = time.monotonic() + seconds
        while True:
            dead = self._dead()
            if dead is not None or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    def _failed(self, req: OmniRequest, message: str) -> OmniEvent:
        """Fail ``req`` with ``message`` (WorkerDied), stop what is left of the pool and start it again."""
        self._stop_procs()
        out = OmniOutput(request_id=req.request_id, status=Status.FAILED,
                         error=ErrorInfo(type="WorkerDied", message=message))
        self.restarts += 1
        self._start()  # the pool is back for the next request
        return OmniEvent(request_id=req.request_id, kind=EventKind.FINAL, output=out)

    def generate(self, request: OmniRequest | Mapping[str, Any]) -> OmniOutput:
        return final_output(self.stream(request))
