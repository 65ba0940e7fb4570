"""Role pools (deploy ``placement``) on CPU: a tiny Wan whose VAE (and text encoder) run in a worker process.

One role-pool runtime is shared by the module (a worker start imports torch/diffusers and loads the
tiny checkpoint: seconds on a loaded 2-core machine). Bit-exactness holds because the worker runs
the same stage code on the same inputs with the same thread count (1) as the reference.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest
import torch

from omniloop.errors import DeployError
from omniloop.request import Status, TaskType
from omniloop.runtime import Deployment, Runtime
from omniloop_parallel import RemoteStage, RolePoolRuntime
from omniloop_parallel.testing import wan_manager
from omniloop_scheduler import AsyncEngine

from .conftest import MANAGER, wan_request


def _deploy(ckpt, placement, **extra):
    return {"model": {"path": str(ckpt)}, "placement": placement, **extra}


@pytest.fixture(scope="module")
def roles(wan_ckpt):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rt = RolePoolRuntime(_deploy(wan_ckpt, {"vae": {"devices": ["cpu"]}, "text_encoder": {"devices": ["cpu"]}}),
                         manager=MANAGER, timeout_s=60, load_timeout_s=180)
    try:
        yield rt
    finally:
        rt.close()
        torch.set_num_threads(threads)


def _equal(a, b):
    assert a.ok, a.error
    assert torch.equal(a.artifacts["video"].frames, b.artifacts["video"].frames)
    assert torch.equal(a.artifacts["latents"].tensor, b.artifacts["latents"].tensor)


def test_placed_nodes_run_in_the_worker_and_equal_in_process(roles, reference):
    pipe = roles.pipeline(TaskType.T2V)
    remote = {n.name for n in pipe.spec.nodes if isinstance(n.stage, RemoteStage)}
    assert remote == {"text_encode", "vae_decode"}  # denoise stays here; one worker hosts both (same device)
    assert list(roles.describe()["placement"]) == ["cpu"]
    out = roles.generate(wan_request())
    _equal(out, reference())
    worker_pid = roles.workers["cpu"].pid
    assert out.metrics["roles"]["vae_decode"]["pid"] == worker_pid != os.getpid()
    assert out.metrics["roles"]["text_encode"]["pid"] == worker_pid


def test_step_scheduler_overlaps_and_stays_exact(roles, reference):
    """Through the async engine (step scheduler): requests are dispatched and parked, results equal."""

    async def run():
        async with AsyncEngine(roles, "step") as engine:
            hs = [engine.submit(wan_request(steps=s, seed=seed)) for s, seed in ((4, 5), (2, 6), (3, 3))]
            outs = await asyncio.gather(*(h.result(timeout=120) for h in hs))
            return outs, [d for d in engine.pool.trace if d.action == "dispatch"]

    outs, dispatched = asyncio.run(run())
    for out, (s, seed) in zip(outs, ((4, 5), (2, 6), (3, 3)), strict=True):
        _equal(out, reference(steps=s, seed=seed))
    assert {d.node for d in dispatched} == {"text_encode", "vae_decode"}
    assert len(dispatched) == 6  # each request: text encode and decode sent to the worker once


def test_dying_vae_worker_fails_the_request_and_the_next_succeeds(roles, reference, monkeypatch):
    worker = roles.workers["cpu"]
    pid = worker.pid
    decode = next(n.stage for n in roles.pipeline(TaskType.T2V).spec.nodes if n.name == "vae_decode")
    send = decode._submit

    sent = threading.Event()

    def held(request, state):  # stop the worker just before the decode is sent: it is in flight when it dies
        os.kill(pid, signal.SIGSTOP)
        send(request, state)
        sent.set()

    monkeypatch.setattr(decode, "_submit", held)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("out", roles.generate(wan_request())))
    try:
        t.start()
        assert sent.wait(60)
        assert worker.pending == 1
        os.kill(pid, signal.SIGKILL)
    finally:
        t.join(120)
    monkeypatch.undo()
    out = box["out"]
    assert out.status is Status.FAILED
    assert out.error.type == "WorkerDied" and out.error.node == "vae_decode"
    assert out.error.message.startswith(f"the role worker on cpu (pid {pid}) died (signal 9) while running node 'vae_decode'")
    nxt = roles.generate(wan_request())  # the worker is started again for it
    _equal(nxt, reference())
    assert worker.pid != pid and worker.restarts >= 1


def test_a_node_failing_in_the_worker_is_a_role_error_and_the_worker_stays(roles, reference):
    from omniloop_parallel import RoleError

    worker = roles.workers["cpu"]
    pid = worker.pid
    job = worker.submit(roles.prepare(wan_request()).request, "vae_decode",
                        roles.role_transport.encode({"reads": {}, "gen": None}))  # no latents to decode
    assert job.event.wait(60)
    assert isinstance(job.error, RoleError)
    assert str(job.error).startswith("node 'vae_decode' failed in the role worker on cpu: GraphError: artifact 'denoised'")
    _equal(roles.generate(wan_request()), reference())
    assert worker.pid == pid  # an exception in a node does not cost the worker


def test_a_stalled_worker_times_out_and_comes_back(roles, reference, monkeypatch):
    worker = roles.workers["cpu"]
    pid = worker.pid
    decode = next(n.stage for n in roles.pipeline(TaskType.T2V).spec.nodes if n.name == "vae_decode")
    send = decode._submit

    def held(request, state):
        os.kill(pid, signal.SIGSTOP)  # alive but silent
        send(request, state)

    monkeypatch.setattr(decode, "_submit", held)
    monkeypatch.setattr(decode, "timeout_s", 2.0)
    out = roles.generate(wan_request())
    monkeypatch.undo()
    assert out.status is Status.FAILED and out.error.type == "WorkerDied"
    assert out.error.message.startswith(f"no answer from the role worker on cpu (pid {pid}) for 2 s while running node 'vae_decode'")
    _equal(roles.generate(wan_request()), reference())  # killed and started again
    assert worker.pid != pid


@pytest.mark.parametrize(("placement", "extra", "message"), [
    ({"transformer": {"devices": ["cpu"]}}, {},
     "placement.transformer: family 'wan' cannot run 'transformer' in a role worker (placeable: image_encoder, text_encoder, vae)"),
    ({"image_encoder": {"devices": ["cpu"]}}, {}, "placement.image_encoder: the checkpoint at"),
    ({"vae": {"devices": []}}, {}, "placement.vae.devices: give at least one device"),
    ({"vae": {"devices": ["meta"]}}, {}, "placement.vae.devices[0]: role workers run on cpu or cuda devices, not 'meta'"),
    ({"vae": {"devices": ["tpu"]}}, {}, "placement.vae.devices[0]: 'tpu' is not a device (use cpu, cuda or cuda:N)"),
    ({"vae": {"devices": ["cuda:7"]}}, {}, "placement.vae.devices[0]: 'cuda:7' requested but this machine has"),
    ({"vae": {"devices": ["cpu", "cpu"]}}, {}, "placement.vae.devices[1]: 'cpu' is listed twice"),
    ({"vae": {"devices": ["cpu"]}}, {"parallel": {"cfg": 2}}, "placement: role workers do not combine with parallel"),
    ({"vae": {"device": ["cpu"]}}, {}, "placement.vae.device: unknown key (device); known: devices"),
    ({"vae": {"devices": "cpu"}}, {}, "placement.vae.devices: expected a list"),
])
def test_bad_placement_is_one_line_before_weights(wan_ckpt, monkeypatch, placement, extra, message):
    from omniloop_wan.family import WanFamily

    def no_load(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(WanFamily, "load", no_load)
    for load in (lambda d: Deployment(d, manager=wan_manager()), lambda d: Runtime.from_deploy(d, manager=wan_manager())):
        with pytest.raises(DeployError) as exc:
            load(_deploy(wan_ckpt, placement, **extra))
        text = str(exc.value)
        assert message in text and "\n" not in text


def test_plain_runtime_refuses_placement(wan_ckpt, monkeypatch):
    with pytest.raises(DeployError, match=r"^placement: vae run in role worker processes: load the deploy with Runtime\.from_deploy"):
        Runtime(_deploy(wan_ckpt, {"vae": {"devices": ["cpu"]}}), manager=wan_manager())


def test_transport_shm_needs_workers(wan_ckpt):
    with pytest.raises(DeployError, match=r"set parallel: \{sp, cfg\} or placement"):
        Deployment({"model": {"path": str(wan_ckpt)}, "transport": "shm"}, manager=wan_manager())
    Deployment(_deploy(wan_ckpt, {"vae": {"devices": ["cpu"]}}, transport="shm"), manager=wan_manager())


def test_shm_transport_carries_the_role_payloads_exactly(wan_ckpt, reference):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with RolePoolRuntime(_deploy(wan_ckpt, {"vae": {"devices": ["cpu"]}}, transport="shm"), manager=MANAGER,
                             timeout_s=60, load_timeout_s=180) as rt:
            assert type(rt.role_transport).__name__ == "ShmTransport"
            _equal(rt.generate(wan_request()), reference())
    finally:
        torch.set_num_threads(threads)
