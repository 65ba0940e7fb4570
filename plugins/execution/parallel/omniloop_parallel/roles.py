"""Role pools: a deploy's ``placement`` runs some components' stages in worker processes.

::

    placement:
      vae: {devices: [cpu]}          # VAE decode (and encode) in a worker process
      text_encoder: {devices: [cpu]} # same device: the same worker hosts both

:class:`RolePoolRuntime` is a :class:`~omniloop.runtime.Runtime` (every scheduler, the async
engine and the server drive it as usual) whose pipelines have the placed nodes' stages replaced by
:class:`RemoteStage` proxies. A node runs remotely when it is not a loop and every component it
``uses`` is hosted by one worker; the denoise loop stays in the scheduler's process. One worker
process per distinct device (:class:`RoleWorker`): it loads the deployment on its device, keeps only
the weights of the modules it hosts (the others move to the meta device), and runs one node of one request at a time: the node's declared reads (and
the request's RNG state) go in, its writes (and the RNG state) come back, tensors through the
deploy's ``transport`` (``inproc``: pickled bytes; ``shm``: shared memory), moved to the reading
side's device. The same stage code runs on the same inputs, so the result equals the in-process
one.

Overlap: a remote stage is *dispatched* — the step scheduler (omniloop-scheduler) sends the job as
soon as a request reaches the node, parks the request and keeps stepping the others; when the
job is back, the request advances (the stage's ``forward`` collects the result). Any other
scheduler simply calls ``forward``, which dispatches and waits.

Failure: a worker that dies fails the job in flight with :class:`~omniloop_parallel.WorkerDied`
(status ``failed``, the message names the worker, pid and signal); the worker is started again in
the background for the next request. A job with no answer within ``timeout_s`` fails the same way
and its worker is killed and restarted. Nothing waits without a deadline.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from omniloop.deploy import DeployConfig, load_deploy
from omniloop.errors import DeployError, OmniloopError
from omniloop.runtime import Deployment, Runtime

from . import worker as _worker
from .checks import role_device
from .transports import map_tensors, transport_for


class RoleError(OmniloopError):
    """A placed node failed inside its role worker (the worker's error, named)."""


def _worker_died() -> type[OmniloopError]:
    from .pool import WorkerDied

    return WorkerDied


# -- the worker process -------------------------------------------------------------------------------


def role_main(conn: Any, deploy: DeployConfig, hosted: frozenset[str], manager: str | None, threads: int,
              transport: str = "inproc") -> None:
    """One role worker: load the deployment on ``deploy.device``, keep the modules in ``hosted``,
    then run ``("run", job, request, node, payload)`` messages until ``("stop",)`` or the pipe closes;
    payloads cross through ``transport`` (the front's deploy ``transport``)."""
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        runtime = Runtime(deploy, manager=_worker.load_manager(manager))
        comps = runtime.model.components
        for name in [n for n, v in comps.items() if isinstance(v, torch.nn.Module) and n not in hosted]:
            # the denoiser and anything not placed here: weights freed, the module kept on the meta
            # device (a stage may still read its dtype or config, e.g. Wan's text encode)
            comps[name] = comps[name].to("meta")
        carrier = transport_for(transport)
    except Exception as exc:
        conn.send(("error", None, f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        if msg[0] != "run":
            continue
        _, job, request, node_name, payload = msg
        try:
            result = run_node(runtime, request, node_name, carrier.decode(payload))
            out = carrier.encode(result)
        except Exception as exc:
            tb = traceback.format_exc(limit=4).strip().splitlines()
            conn.send(("failed", job, f"{type(exc).__name__}: {exc}", tb[-3:]))
            continue
        conn.send(("done", job, out))


def run_node(runtime: Runtime, request: Any, node_name: str, payload: Mapping[str, Any]) -> dict[str, Any]:
    """Run node ``node_name`` of ``request`` on this worker's runtime with the artifacts in
    ``payload["reads"]`` and the RNG state ``payload["gen"]``; return its writes (on the CPU),
    the RNG state after it, the metrics it added and its seconds."""
    from omniloop.context import StageContext
    from omniloop.runtime import structure_node_params

    execution = runtime.prepare(request)  # the same validation and resolution as the front's
    spec = execution.pipeline.spec
    node = spec.node(node_name)
    state = execution.state
    dev = runtime.device
    for edge, art in payload["reads"].items():
        state.artifacts[edge] = map_tensors(art, lambda t: t.to(dev))
    if payload.get("gen") is not None and state.generator is not None:
        state.generator.set_state(payload["gen"])
    ctx = StageContext(
        request=execution.request, node=node, components=execution.pipeline.components, device=dev,
        dtype=runtime.dtype, params=structure_node_params(spec, execution.request).get(node_name),
        resolved=execution.resolved, options=execution.pipeline.options,
    )
    before = set(state.metrics)
    t0 = time.perf_counter()
    with execution.activated():
        node.stage.forward(ctx, state)
    seconds = time.perf_counter() - t0
    writes = {e: map_tensors(state.artifacts[e], lambda t: t.detach().cpu()) for e in node.writes if e in state.artifacts}
    return {
        "writes": writes,
        "gen": state.generator.get_state() if payload.get("gen") is not None and state.generator is not None else None,
        "metrics": {k: v for k, v in state.metrics.items() if k not in before},
        "seconds": seconds,
    }


# -- the front's view of one worker -------------------------------------------------------------------


class Job:
    """One node of one request sent to a role worker."""

    __slots__ = ("error", "event", "id", "node", "pid", "request_id", "result", "submitted_at", "worker")

    def __init__(self, job_id: int, request_id: str, node: str, worker: RoleWorker) -> None:
        self.id, self.request_id, self.node, self.worker = job_id, request_id, node, worker
        self.event = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.pid: int | None = None
        self.submitted_at = time.perf_counter()

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.event.set()


class RoleWorker:
    """One worker process on one device hosting ``hosted`` components. A reader thread takes its
    answers; a death fails the jobs in flight and starts the process again in the background."""

    def __init__(self, device: str, hosted: frozenset[str], deploy: DeployConfig, *, manager: str | None,
                 threads: int, load_timeout_s: float, wait: bool = True) -> None:
        self.device, self.hosted = device, hosted
        self.deploy = attrs.evolve(deploy, device=device, placement={}, transport="inproc")
        self.transport_name = deploy.transport
        self.manager, self.threads, self.load_timeout_s = manager, threads, load_timeout_s
        self.restarts = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()  # jobs, proc, generation
        self._jobs: dict[int, Job] = {}
        self._ready = threading.Event()
        self._closing = False
        self._gen = 0
        self.proc: Any = None
        self._conn: Any = None
        self.load_error: str | None = None
        self._spawned: tuple[Any, Any] | None = self._spawn()
        if wait:
            self.wait_loaded()

    def wait_loaded(self) -> None:
        """Wait for the first start (``wait=False`` lets the front load its model meanwhile);
        a worker that could not load raises :class:`DeployError`."""
        if self._spawned is not None:
            spawned, self._spawned = self._spawned, None
            self._await(*spawned)
        if self.load_error is not None:
            raise DeployError(f"placement: the role worker on {self.device} could not load the deployment: {self.load_error}")

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def pending(self) -> int:
        return len(self._jobs)

    def _start(self) -> None:
        """Spawn the process and wait until it has loaded (or failed, or died, or timed out)."""
        self._await(*self._spawn())

    def _spawn(self) -> tuple[Any, Any]:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=role_main, name=f"omniloop-role-{self.device}", daemon=True,
                           args=(child, self.deploy, self.hosted, self.manager, self.threads, self.transport_name))
        proc.start()
        child.close()
        return proc, parent

    def _await(self, proc: Any, parent: Any) -> None:
        deadline = time.monotonic() + self.load_timeout_s
        msg: Any = None
        while msg is None:
            try:
                if parent.poll(0.1):
                    msg = parent.recv()
                    break
            except (EOFError, OSError):
                msg = ("error", None, "the process closed its pipe while loading")
                break
            if proc.exitcode is not None:
                msg = ("error", None, f"the process exited while loading ({_how(proc.exitcode)})")
            elif time.monotonic() > deadline:
                _kill(proc)
                msg = ("error", None, f"not loaded within {self.load_timeout_s:g} s")
        if msg[0] != "ready":
            self.load_error = str(msg[2])
            _kill(proc)
            parent.close()
            self._ready.set()  # settled: submit() fails at once with load_error (no process)
            return
        self.load_error = None
        with self._lock:
            self._gen += 1
            gen = self._gen
            self.proc, self._conn = proc, parent
        self._ready.set()
        threading.Thread(target=self._read, args=(gen, proc, parent), name=f"omniloop-role-{self.device}-reader",
                         daemon=True).start()

    def _read(self, gen: int, proc: Any, conn: Any) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                job = self._jobs.pop(msg[1], None)
            if job is None:  # discarded (its request was cancelled or timed out)
                continue
            if msg[0] == "done":
                job.finish(result=msg[2])
            else:
                job.finish(error=RoleError(f"node {job.node!r} failed in the role worker on {self.device}: {msg[2]}"))
        # the pipe closed: the process exited (killed, crashed, stopped by close())
        proc.join(2.0)
        why = f"the role worker on {self.device} (pid {proc.pid}) died ({_how(proc.exitcode)})"
        with self._lock:
            if gen != self._gen:
                return
            self._ready.clear()
            jobs, self._jobs = list(self._jobs.values()), {}
            self.proc, self._conn = None, None
        died = _worker_died()
        for job in jobs:
            job.finish(error=died(f"{why} while running node {job.node!r} of request {job.request_id!r}"))
        try:
            conn.close()
        except OSError:
            pass
        if not self._closing:  # back for the next request, in the background
            self.restarts += 1
            self._start()

    def submit(self, request: Any, node: str, payload: Any) -> Job:
        """Send one job; a worker that is restarting is waited for (up to its load deadline)."""
        job = Job(next(self._ids), request.request_id, node, self)
        if not self._ready.wait(self.load_timeout_s):
            why = self.load_error or f"not back within {self.load_timeout_s:g} s"
            job.finish(error=_worker_died()(f"the role worker on {self.device} is not running: {why}"))
            return job
        with self._lock:
            conn, job.pid = self._conn, self.pid
            if conn is not None:
                self._jobs[job.id] = job
        if conn is None:  # the last start failed
            job.finish(error=_worker_died()(f"the role worker on {self.device} is not running: {self.load_error}"))
            return job
        try:
            conn.send(("run", job.id, request, node, payload))
        except (OSError, AttributeError) as exc:
            with self._lock:
                self._jobs.pop(job.id, None)
            job.finish(error=_worker_died()(f"the role worker on {self.device} could not take node {node!r}: {exc}"))
        return job

    def forget(self, job: Job) -> None:
        with self._lock:
            self._jobs.pop(job.id, None)

    def kill(self) -> None:
        """Kill the process (a stalled worker): its jobs fail, the reader starts it again; until
        then new jobs wait for the restart (none is sent to the dying process)."""
        with self._lock:
            proc = self.proc
            self._ready.clear()
        if proc is not None and proc.pid is not None and proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)

    def close(self) -> None:
        self._closing = True
        if self._spawned is not None:  # never waited for: stop it
            proc, conn = self._spawned
            self._spawned = None
            _kill(proc)
            conn.close()
        with self._lock:
            proc, conn = self.proc, self._conn
        if conn is not None:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        if proc is not None:
            proc.join(5)
            _kill(proc)


def _how(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    return f"signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}"


def _kill(proc: Any) -> None:
    if proc.exitcode is None and proc.pid is not None:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.join(5)


# -- the stage proxy ------------------------------------------------------------------------------------


class RemoteStage:
    """Stands in for a placed node's stage in the front's pipeline.

    The step scheduler's protocol (``remote = True``): ``dispatch(execution)`` sends the job when the
    request reaches the node; ``ready(request_id)`` / ``wait(request_id, timeout)`` tell when it is
    back; ``forward(ctx, state)`` then applies the result (or, never dispatched, sends and waits);
    ``discard(request_id)`` forgets a job whose request was cancelled or failed."""

    remote = True

    def __init__(self, inner: Any, node: Any, workers: list[RoleWorker], transport: Any, device: torch.device,
                 timeout_s: float) -> None:
        self.inner, self.node, self.workers = inner, node, workers
        self.transport, self.device, self.timeout_s = transport, device, timeout_s
        self._jobs: dict[str, Job] = {}

    def __repr__(self) -> str:
        return f"RemoteStage({type(self.inner).__name__} on {', '.join(w.device for w in self.workers)})"

    def dispatch(self, execution: Any) -> None:
        if execution.request_id not in self._jobs:
            self._submit(execution.request, execution.state)

    def dispatched(self, request_id: str) -> bool:
        return request_id in self._jobs

    def ready(self, request_id: str) -> bool:
        job = self._jobs.get(request_id)
        return job is not None and job.event.is_set()

    def wait(self, request_id: str, timeout: float) -> bool:
        job = self._jobs.get(request_id)
        return True if job is None else job.event.wait(timeout)

    def discard(self, request_id: str) -> None:
        job = self._jobs.pop(request_id, None)
        if job is not None:
            job.worker.forget(job)

    def _submit(self, request: Any, state: Any) -> None:
        names = (*self.node.reads, *(e for e in self.node.optional_reads if e not in self.node.reads))
        reads = {e: state.artifacts[e] for e in names if e in state.artifacts}
        gen = state.generator.get_state() if state.generator is not None else None
        payload = self.transport.encode({"reads": map_tensors(reads, lambda t: t.detach().cpu()), "gen": gen})
        worker = min(self.workers, key=lambda w: w.pending)
        self._jobs[request.request_id] = worker.submit(request, self.node.name, payload)

    def forward(self, ctx: Any, state: Any) -> None:
        rid = ctx.request.request_id
        if rid not in self._jobs:
            self._submit(ctx.request, state)
        job = self._jobs.pop(rid)
        if not job.event.wait(self.timeout_s):
            job.worker.forget(job)
            job.worker.kill()  # stalled: it is killed and comes back for the next request
            raise _worker_died()(
                f"no answer from the role worker on {job.worker.device} (pid {job.pid}) for {self.timeout_s:g} s "
                f"while running node {self.node.name!r} of request {rid!r}"
            )
        if job.error is not None:
            raise job.error
        res = self.transport.decode(job.result)
        dev = ctx.device
        for edge, art in res["writes"].items():
            state.write(edge, map_tensors(art, lambda t: t.to(dev)), ctx.node.name)
        if res["gen"] is not None and state.generator is not None:
            state.generator.set_state(res["gen"])
        state.metrics.update(res["metrics"])
        state.metrics.setdefault("roles", {})[ctx.node.name] = {
            "device": job.worker.device, "pid": job.pid, "seconds": round(res["seconds"], 6),
            "turnaround_seconds": round(time.perf_counter() - job.submitted_at, 6),
        }


# -- the runtime ------------------------------------------------------------------------------------------


class RolePoolRuntime(Runtime):
    """A :class:`~omniloop.runtime.Runtime` whose placed components run in role workers (see the module).

    ``manager``: a PluginManager for this process, or ``"module:callable"`` returning one (then the
    workers use it too; otherwise they discover the installed entry points). ``timeout_s``: the
    deadline of one remote node; ``load_timeout_s``: of a worker's load; ``threads``: torch threads
    per worker."""

    def __init__(self, deploy: DeployConfig | Mapping[str, Any] | str | os.PathLike[str], *, manager: Any = None,
                 timeout_s: float = 120.0, load_timeout_s: float = 600.0, threads: int = 1) -> None:
        full = load_deploy(deploy)
        spec = manager if isinstance(manager, str) else None
        pm = _worker.load_manager(spec) if spec is not None else manager
        Deployment(full, manager=pm)  # the whole deploy, placement included, checked before any weight loads
        if not full.placement:
            raise DeployError("placement: RolePoolRuntime needs a deploy with placement (e.g. {vae: {devices: [cpu]}})")
        hosts: dict[str, set[str]] = {}
        for comp, role in full.placement.items():
            for i, name in enumerate(role.devices):
                hosts.setdefault(str(role_device(name, f"placement.{comp}.devices[{i}]")), set()).add(comp)
        self.workers: dict[str, RoleWorker] = {}
        try:  # the workers load while this process loads its own model
            for dev, comps in hosts.items():
                self.workers[dev] = RoleWorker(dev, frozenset(comps), attrs.evolve(full, placement={}), manager=spec,
                                               threads=threads, load_timeout_s=load_timeout_s, wait=False)
            super().__init__(attrs.evolve(full, placement={}, transport="inproc"), manager=pm)
            for w in self.workers.values():
                w.wait_loaded()
        except BaseException:
            self.close()
            raise
        self.deploy = full
        self.timeout_s = timeout_s
        self.role_transport = transport_for(full.transport)

    def _build(self, task: Any) -> Any:
        built = super()._build(task)
        nodes = []
        for node in built.spec.nodes:
            uses = set(node.uses)
            placed = uses & set(self.deploy.placement)
            if node.is_loop and placed:
                comp = sorted(placed)[0]
                raise DeployError(f"placement.{comp}: node {node.name!r} uses it in its loop, which runs in the "
                                  "scheduler's process; it cannot be placed in a role worker")
            hosts = [w for w in self.workers.values() if uses and uses <= w.hosted]
            if node.is_loop or not hosts:
                nodes.append(node)
                continue
            nodes.append(attrs.evolve(node, stage=RemoteStage(node.stage, node, hosts, self.role_transport,
                                                              self.device, self.timeout_s)))
        built.spec = attrs.evolve(built.spec, nodes=nodes)
        return built

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["placement"] = {dev: {"components": sorted(w.hosted), "pid": w.pid, "restarts": w.restarts}
                            for dev, w in self.workers.items()}
        return out

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers.values())

    def close(self) -> None:
        """Stop the role workers."""
        for w in getattr(self, "workers", {}).values():
            w.close()

    def __enter__(self) -> RolePoolRuntime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def runtime_for(deploy: DeployConfig | Mapping[str, Any] | str | os.PathLike[str], *, manager: Any = None,
                **kwargs: Any) -> Any:
    """The runtime of a deploy that needs worker processes (this package's runtime loader,
    ``omniloop_parallel.checks.LOADER``, which ``Runtime.from_deploy`` calls): :class:`RolePoolRuntime` for ``placement``,
    :class:`~omniloop_parallel.ParallelRuntime` for ``parallel`` above one process."""
    cfg = load_deploy(deploy)
    if cfg.placement:
        return RolePoolRuntime(cfg, manager=manager, **kwargs)
    from .pool import ParallelRuntime

    return ParallelRuntime(cfg, manager=manager, **kwargs)
