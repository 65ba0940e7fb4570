"""The SPMD worker pool on CPU (gloo, 2 processes) running tiny Wan with parallel: {cfg: 2} / {sp: 2}.

Each pool start spawns 2 processes that import torch/diffusers and load the tiny checkpoint
(~10 s on a loaded 2-core machine), so the pools are module-scoped and shared. Every wait in the
pool has a deadline (``timeout_s``); the tests also run under pytest's own time.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from omniloop.errors import RequestError
from omniloop.request import Status
from omniloop.runtime import Runtime
from omniloop_parallel import ParallelRuntime

from .conftest import MANAGER, wan_request

#: Ulysses sp=2 vs one process, fp32 CPU: the attention is the same math per head; the linear layers
#: multiply L/2-row instead of L-row matrices, which the BLAS may sum in another order. Observed 0.0
#: on the tiny model (torch 2.13 CPU); the contract is this bound.
SP_ATOL = 1e-5


def _pool(ckpt, **parallel):
    # a tiny step takes milliseconds: 10 s without a word from rank 0 means a stalled worker
    return ParallelRuntime({"model": {"path": str(ckpt)}, "parallel": parallel}, manager=MANAGER,
                           timeout_s=10, load_timeout_s=120)


@pytest.fixture(scope="module")
def cfg_pool(wan_ckpt):
    with _pool(wan_ckpt, cfg=2) as pool:
        yield pool


#: cache-dit settings of the sp pool (requests turn caching off with residual_diff_threshold: 0)
CACHE = {"Fn": 1, "Bn": 1, "residual_diff_threshold": 0.5, "max_warmup_steps": 2}
NO_CACHE = {"plugin_params": {"cache-dit": {"residual_diff_threshold": 0.0}}}


@pytest.fixture(scope="module")
def sp_pool(wan_ckpt):
    """sp=2 over shm with cache-dit enabled (one pool start serves the sp, transport and cache tests)."""
    pytest.importorskip("omniloop_cache_dit")
    deploy = {"model": {"path": str(wan_ckpt)}, "parallel": {"sp": 2}, "transport": "shm",
              "plugins": {"cache-dit": CACHE}}
    with ParallelRuntime(deploy, manager="omniloop_parallel.testing:wan_cache_manager", timeout_s=10,
                         load_timeout_s=120) as pool:
        yield pool


def _latents(out):
    assert out.status is Status.COMPLETED, out.error
    return out.artifacts["latents"].tensor


def test_cfg2_equals_one_process_exactly(cfg_pool, reference):
    ranks = cfg_pool.describe()
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    out = cfg_pool.generate(wan_request())
    ref = reference()
    assert torch.equal(_latents(out), _latents(ref))
    assert torch.equal(out.artifacts["video"].frames, ref.artifacts["video"].frames)
    # rank 0 ran only the cond branch's forwards (rank 1 the uncond ones): the work was split
    par = out.metrics["parallel"]
    assert par["cfg"] == 2 and par["rank"] == 0 and par["forwards"] == {"cond": 3}


def test_request_refused_before_the_workers(cfg_pool):
    with pytest.raises(RequestError, match=r"diffusion\.steps"):
        cfg_pool.generate(wan_request(steps=10_000))


def test_abort_reaches_every_rank_at_a_step_boundary(cfg_pool, reference):
    events = cfg_pool.stream(wan_request(steps=150, seed=5))
    final = None
    for ev in events:
        if ev.output is not None:
            final = ev.output
        elif ev.node == "denoise" and final is None and ev.step is not None:
            cfg_pool.abort(ev.request_id)
    assert final is not None and final.status is Status.CANCELLED
    # every rank left the request at the same boundary: the pool runs the next one exactly
    assert torch.equal(_latents(cfg_pool.generate(wan_request())), _latents(reference()))


def test_a_stream_left_early_is_aborted_and_the_pool_stays_clean(cfg_pool, reference):
    restarts = cfg_pool.restarts
    stream = cfg_pool.stream(wan_request(steps=150, seed=13))
    for ev in stream:
        if ev.node == "denoise" and ev.step is not None:
            break  # the client goes away mid-request
    stream.close()
    assert torch.equal(_latents(cfg_pool.generate(wan_request())), _latents(reference()))
    assert cfg_pool.restarts == restarts


def test_killed_worker_fails_its_request_and_the_pool_restarts(cfg_pool, reference):
    before = cfg_pool.restarts
    victim = cfg_pool.pids[1]
    final = None
    for ev in cfg_pool.stream(wan_request(steps=150, seed=7)):
        if ev.output is not None:
            final = ev.output
        elif ev.node == "denoise" and ev.step is not None and victim in cfg_pool.pids:
            os.kill(victim, signal.SIGKILL)
    assert final is not None and final.status is Status.FAILED
    assert final.error.type == "WorkerDied"
    assert f"worker rank 1 (pid {victim}) died (signal 9)" in final.error.message
    assert cfg_pool.restarts == before + 1 and victim not in cfg_pool.pids
    # the next request succeeds on the restarted pool, still equal to one process
    assert torch.equal(_latents(cfg_pool.generate(wan_request())), _latents(reference()))


def test_stalled_worker_fails_its_request_within_the_deadline(cfg_pool, reference):
    before = cfg_pool.restarts
    victim = cfg_pool.pids[1]
    final = None
    try:
        for ev in cfg_pool.stream(wan_request(steps=150, seed=9)):
            if ev.output is not None:
                final = ev.output
            elif ev.node == "denoise" and ev.step is not None and victim in cfg_pool.pids:
                os.kill(victim, signal.SIGSTOP)  # alive but never answers: nothing may hang
    finally:
        if victim in cfg_pool.pids:
            os.kill(victim, signal.SIGCONT)
    assert final is not None and final.status is Status.FAILED and final.error.type == "WorkerDied"
    assert cfg_pool.restarts == before + 1 and victim not in cfg_pool.pids
    assert torch.equal(_latents(cfg_pool.generate(wan_request())), _latents(reference()))


def test_sp2_within_tolerance_of_one_process(sp_pool, reference):
    out = sp_pool.generate({**wan_request(), **NO_CACHE})
    assert out.metrics["plugins"]["cache-dit"]["cond"]["num_cached_steps"] == 0
    ranks = sp_pool.describe()  # the Ulysses processors go in at the first forward
    assert all("ulysses2" in r["self_attention"] for r in ranks), ranks
    ref = reference()
    diff = (_latents(out) - _latents(ref)).abs().max().item()
    print(f"sp=2 vs one process: max |d latents| = {diff:.3g}")
    assert diff <= SP_ATOL
    assert out.metrics["parallel"]["sp"] == 2
    # transport shm: the latents arrive in shared memory (mapped, not copied through the pipe)
    assert out.artifacts["latents"].tensor.is_shared()


def test_inproc_transport_copies(cfg_pool):
    out = cfg_pool.generate(wan_request(steps=1))
    assert out.ok and not out.artifacts["latents"].tensor.is_shared()


# -- cache-dit under sp: 2 -----------------------------------------------------------------------
def test_cache_dit_under_sp2_same_decisions_on_every_rank(sp_pool, wan_ckpt):
    from omniloop_parallel.testing import wan_cache_manager

    req = wan_request(steps=8, seed=11)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = Runtime.from_model(wan_ckpt, manager=wan_cache_manager(), plugins={"cache-dit": CACHE}).generate(req)
    finally:
        torch.set_num_threads(threads)
    out = sp_pool.generate(req)
    assert out.ok, out.error
    ranks = out.metrics["ranks"]
    decisions = [{b: m["cached_steps"] for b, m in r["plugins"]["cache-dit"].items()} for r in ranks]
    assert len(decisions) == 2 and decisions[0] == decisions[1]  # the residual comparison was reduced
    want = {b: m["cached_steps"] for b, m in single.metrics["plugins"]["cache-dit"].items()}
    assert decisions[0] == want and any(want.values())  # as one unsharded run, and it did cache
    diff = (_latents(out) - _latents(single)).abs().max().item()
    assert diff <= SP_ATOL


def test_sp2_refuses_a_token_count_it_cannot_split(sp_pool, reference):
    # 9 frames at 48x48: 3 x 3 x 3 = 27 latent tokens; every rank refuses at the denoise init
    out = sp_pool.generate({**wan_request(height=48, width=48), **NO_CACHE})
    assert out.status is Status.FAILED and out.error.type == "RequestError"
    assert out.error.message.startswith("diffusion.height: this size gives 27 latent tokens, not divisible by parallel.sp=2")
    restarts = sp_pool.restarts
    assert (_latents(sp_pool.generate({**wan_request(), **NO_CACHE})) - _latents(reference())).abs().max() <= SP_ATOL
    assert sp_pool.restarts == restarts  # a refused request leaves the pool as it was
