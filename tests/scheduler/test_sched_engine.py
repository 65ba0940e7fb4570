"""AsyncEngine + step policy on the toy family (CPU). Every wait is bounded by a timeout."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
import torch

from omniloop.errors import RequestError
from omniloop.request import EventKind, Status
from omniloop_scheduler import AdmissionRefused, AsyncEngine, QueueFull
from omniloop_scheduler.models import shape_of, total_estimate
from omniloop_scheduler.testing import req

T = 60.0  # seconds: generous bound for any single await on 2 CPU cores


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


async def _finish_order(engine: AsyncEngine, handles: list[Any]) -> list[str]:
    """The order in which the engine delivered the handles' final outputs.

    Recorded where the output is delivered (in the loop, in the worker thread's order), not where
    an awaiting task wakes: a request that finished before its waiter first ran would otherwise be
    counted in the order the waiters were created (a race the fast toy family loses on CI)."""
    assert not any(h.done() for h in handles), "call this before the engine has delivered anything"
    order: list[str] = []
    for h in handles:
        def finish(output: Any, h: Any = h, inner: Any = h._finish) -> None:
            order.append(h.request_id)
            inner(output)

        h._finish = finish
    await asyncio.gather(*(h.result(timeout=T) for h in handles))
    return order


# -- interleaving ---------------------------------------------------------------------------------
def test_short_request_submitted_after_a_long_one_finishes_first(runtime: Any) -> None:
    async def main() -> list[str]:
        engine = AsyncEngine(runtime, "step")
        long = engine.submit(req(50, rid="long"))
        short = engine.submit(req(4, rid="short"))
        async with engine:
            return await _finish_order(engine, [long, short])

    assert run(main()) == ["short", "long"]


def test_serial_policy_runs_requests_to_completion_in_order(runtime: Any) -> None:
    async def main() -> tuple[list[str], AsyncEngine]:
        engine = AsyncEngine(runtime, "serial")
        hs = [engine.submit(req(30, rid="long")), engine.submit(req(4, rid="short"))]
        async with engine:
            return await _finish_order(engine, hs), engine

    order, engine = run(main())
    assert order == ["long", "short"]
    units = [d for d in engine.trace if d.action in ("stage", "step", "batched_step")]
    first_short = next(i for i, d in enumerate(units) if d.request_ids == ("short",))
    assert all(d.request_ids == ("long",) for d in units[:first_short])  # never interleaved


def test_round_robin_alternates_steps_of_running_requests(runtime: Any) -> None:
    async def main() -> AsyncEngine:
        engine = AsyncEngine(runtime, "step", max_batch=1)
        hs = [engine.submit(req(6, rid="a")), engine.submit(req(6, seed=1, rid="b", height=32))]
        async with engine:
            await _finish_order(engine, hs)
        return engine

    engine = run(main())
    steps = [d.request_ids[0] for d in engine.trace if d.action == "step"]
    assert steps[:6] == ["a", "b", "a", "b", "a", "b"]


# -- batching -------------------------------------------------------------------------------------
def test_same_size_requests_run_batched_and_match_running_alone(runtime: Any) -> None:
    reqs = [req(6, seed=i, prompt=f"a cat number {i}", rid=f"r{i}", height=32, width=32, frames=5) for i in range(8)]
    alone = {r["request_id"]: runtime.generate(r) for r in reqs}  # serial, unbatched

    async def main() -> tuple[list[Any], AsyncEngine]:
        engine = AsyncEngine(runtime, "step", max_batch=8)
        hs = [engine.submit(r) for r in reqs]
        async with engine:
            return [await h.result(timeout=T) for h in hs], engine

    outs, engine = run(main())
    batched = [d for d in engine.trace if d.action == "batched_step"]
    assert batched and max(len(d.request_ids) for d in batched) == 8
    assert engine.stats()["batched_forwards"] == len(batched)
    # The toy's step_batch stacks the 8 latents into one matmul: float32 reduction order differs
    # from the unbatched forward, so latents agree to 1e-5 (measured ~1e-6) and frames to 1 level.
    for o in outs:
        a = alone[o.request_id]
        assert o.status is Status.COMPLETED
        torch.testing.assert_close(o.artifacts["latents"].tensor, a.artifacts["latents"].tensor, atol=1e-5, rtol=1e-4)
        diff = (o.artifacts["video"].frames.int() - a.artifacts["video"].frames.int()).abs().max().item()
        assert diff <= 1


def test_different_sizes_are_not_batched_together(runtime: Any) -> None:
    async def main() -> AsyncEngine:
        engine = AsyncEngine(runtime, "step")
        hs = [engine.submit(req(4, rid="s16")), engine.submit(req(4, rid="s32", height=32, width=32))]
        async with engine:
            await _finish_order(engine, hs)
        return engine

    assert not [d for d in run(main()).trace if d.action == "batched_step"]


def test_unbatched_interleaving_is_bitwise_equal_to_serial(runtime: Any) -> None:
    reqs = [req(5, seed=3, rid="x", height=32), req(9, seed=4, rid="y")]
    alone = {r["request_id"]: runtime.generate(r) for r in reqs}

    async def main() -> list[Any]:
        engine = AsyncEngine(runtime, "step")
        hs = [engine.submit(r) for r in reqs]
        async with engine:
            return [await h.result(timeout=T) for h in hs]

    for o in run(main()):
        assert torch.equal(o.artifacts["video"].frames, alone[o.request_id].artifacts["video"].frames)


# -- cancellation ---------------------------------------------------------------------------------
def test_cancel_mid_run_returns_cancelled_and_releases_state(probe_runtime: Any) -> None:
    rt, probe = probe_runtime

    async def main() -> tuple[Any, AsyncEngine, Any]:
        async with AsyncEngine(rt, "step") as engine:
            h = engine.submit(req(200, rid="victim"))
            other = engine.submit(req(6, rid="other"))
            async for ev in h.events():
                if ev.kind is EventKind.PROGRESS and ev.total and (ev.step or 0) >= 3:
                    assert engine.cancel("victim")
                    break
            out = await h.result(timeout=T)
            await other.result(timeout=T)
            return out, engine, other

    out, engine, other = run(main())
    assert out.status is Status.CANCELLED
    assert 3 <= out.metrics["steps"] < 200
    assert "latents" not in out.artifacts  # only complete artifacts come back
    assert sorted(b for r, b in probe.closed if r == "victim") == ["cond", "uncond"]  # interceptor state released
    assert sorted(probe.opened) == sorted(probe.closed)
    assert other.output.ok
    assert "victim" not in engine.pool and not engine.pool.running
    assert any(d.action == "cancel" and d.request_ids == ("victim",) for d in engine.trace)
    assert engine.stats()["finished"] == {"completed": 1, "failed": 0, "cancelled": 1}


def test_cancel_a_queued_request(runtime: Any) -> None:
    async def main() -> tuple[Any, Any]:
        engine = AsyncEngine(runtime, "step", max_running=1)
        first = engine.submit(req(40, rid="first"))
        queued = engine.submit(req(4, rid="queued"))
        async with engine:
            assert engine.cancel("queued")
            return await queued.result(timeout=T), await first.result(timeout=T)

    queued, first = run(main())
    assert queued.status is Status.CANCELLED and queued.metrics["steps"] == 0
    assert first.ok


def test_cancel_unknown_or_finished_request_returns_false(runtime: Any) -> None:
    async def main() -> tuple[bool, bool]:
        async with AsyncEngine(runtime, "step") as engine:
            h = engine.submit(req(2))
            await h.result(timeout=T)
            return engine.cancel("nope"), engine.cancel(h.request_id)

    assert run(main()) == (False, False)


# -- failure isolation ----------------------------------------------------------------------------
def test_an_exception_in_one_step_fails_only_that_request(probe_runtime: Any) -> None:
    rt, probe = probe_runtime
    probe.fail_at["bad"] = 2

    async def main() -> tuple[dict[str, Any], AsyncEngine, Any]:
        async with AsyncEngine(rt, "step") as engine:
            hs = [engine.submit(req(6, seed=i, rid=rid)) for i, rid in enumerate(["a", "bad", "b", "c"])]
            outs = {h.request_id: await h.result(timeout=T) for h in hs}
            after = await engine.submit(req(3, rid="after")).result(timeout=T)
            return outs, engine, after

    outs, engine, after = run(main())
    bad = outs.pop("bad")
    assert bad.status is Status.FAILED
    assert bad.error.node == "denoise" and bad.error.step == 2 and "injected failure" in bad.error.message
    assert "text_encode" in bad.metrics["node_seconds"]  # partial progress is reported
    assert all(o.ok for o in outs.values()) and after.ok  # others and later requests are unaffected
    assert sorted(b for r, b in probe.closed if r == "bad") == ["cond", "uncond"]
    assert engine.stats()["finished"]["failed"] == 1


def test_nan_check_fails_the_request_whose_latents_go_non_finite(probe_runtime: Any) -> None:
    rt, probe = probe_runtime
    probe.nan_at["nan"] = 1

    async def main(nan_check: bool) -> dict[str, Any]:
        async with AsyncEngine(rt, "step", nan_check=nan_check) as engine:
            hs = [engine.submit(req(5, seed=i, rid=rid)) for i, rid in enumerate(["nan", "ok"])]
            return {h.request_id: await h.result(timeout=T) for h in hs}

    outs = run(main(True))
    assert outs["nan"].status is Status.FAILED and "non-finite" in outs["nan"].error.message
    assert outs["nan"].error.node == "denoise"
    assert outs["ok"].ok
    unchecked = run(main(False))  # without the check the NaN goes through silently
    assert unchecked["nan"].ok


# -- admission ------------------------------------------------------------------------------------
def _one_request_budget(engine: AsyncEngine, runtime: Any, r: dict[str, Any], factor: float) -> float:
    from omniloop.schema import request_from_dict

    est = engine.pool.memory.predict(shape_of(runtime, request_from_dict(r)))
    return total_estimate([est], engine.options.max_batch) * factor / 1024**3


def test_requests_over_the_memory_budget_wait_instead_of_failing(runtime: Any) -> None:
    r = req(5, height=32, width=32)
    probe_engine = AsyncEngine(runtime, "step", calibrate=False)
    budget = _one_request_budget(probe_engine, runtime, r, 1.5)  # one fits, two do not

    async def main() -> tuple[list[Any], AsyncEngine, list[int]]:
        engine = AsyncEngine(runtime, "step", memory_budget_gib=budget, calibrate=False)
        concurrent: list[int] = []
        engine.decision_listeners.append(
            lambda d: concurrent.append(len(engine.pool.running)) if d.action in ("step", "stage") else None
        )
        hs = [engine.submit({**r, "diffusion": {**r["diffusion"], "seed": i}}) for i in range(3)]
        async with engine:
            return [await h.result(timeout=T) for h in hs], engine, concurrent

    outs, engine, concurrent = run(main())
    assert all(o.ok for o in outs)
    assert max(concurrent) == 1
    waits = [d for d in engine.trace if d.action == "wait"]
    assert waits and "memory" in waits[0].reason


def _backfill_case(runtime: Any, **options: Any) -> tuple[list[str], AsyncEngine]:
    """A large request runs; a second large one cannot fit beside it, a small one can.
    Returns the admission order and the engine."""
    from omniloop.schema import request_from_dict

    large, small = req(6, height=64, width=64), req(2, height=16, width=16)
    probe = AsyncEngine(runtime, "step", calibrate=False)
    est = {k: probe.pool.memory.predict(shape_of(runtime, request_from_dict(r))) for k, r in
           (("large", large), ("small", small))}
    fits = total_estimate([est["large"], est["small"]], probe.options.max_batch)
    assert total_estimate([est["large"], est["large"]], probe.options.max_batch) > fits * 1.05
    budget = fits * 1.02 / 1024**3

    async def main() -> AsyncEngine:
        engine = AsyncEngine(runtime, "step", memory_budget_gib=budget, calibrate=False, **options)
        hs = [engine.submit({**r, "request_id": rid}) for rid, r in
              (("large1", large), ("large2", large), ("small", small))]
        async with engine:
            outs = [await h.result(timeout=T) for h in hs]
        assert all(o.ok for o in outs)
        return engine

    engine = run(main())
    return [d.request_ids[0] for d in engine.trace if d.action == "admit"], engine


def test_backfill_admits_what_fits_behind_a_head_waiting_for_memory(runtime: Any) -> None:
    order, engine = _backfill_case(runtime)  # default: strict head-of-line
    assert order == ["large1", "large2", "small"]
    order, engine = _backfill_case(runtime, backfill=True)
    assert order == ["large1", "small", "large2"]
    admit = next(d for d in engine.trace if d.action == "admit" and d.request_ids == ("small",))
    assert admit.reason.startswith("backfilled behind large2;")
    # the head's wait bounds backfilling: with a zero bound it is head-of-line again
    order, _ = _backfill_case(runtime, backfill=True, backfill_max_wait_s=0.0)
    assert order == ["large1", "large2", "small"]


def test_a_request_that_can_never_fit_is_refused_at_submit(runtime: Any) -> None:
    async def main() -> AsyncEngine:
        engine = AsyncEngine(runtime, "step", memory_budget_gib=1e-6)
        with pytest.raises(AdmissionRefused, match="memory budget"):
            engine.submit(req(4, height=256, width=256))
        return engine

    engine = run(main())
    assert engine.stats()["rejected"]["refused"] == 1 and engine.stats()["submitted"] == 0


def test_max_round_seconds_bounds_admission_with_the_cost_model(runtime: Any) -> None:
    async def main() -> AsyncEngine:
        engine = AsyncEngine(runtime, "step", max_round_seconds=1e-9)
        hs = [engine.submit(req(3, seed=i)) for i in range(3)]
        async with engine:
            await asyncio.gather(*(h.result(timeout=T) for h in hs))
        return engine

    engine = run(main())
    assert any(d.action == "wait" and "cost" in d.reason for d in engine.trace)
    assert not [d for d in engine.trace if d.action == "batched_step"]


def test_queue_full_raises(runtime: Any) -> None:
    async def main() -> AsyncEngine:
        engine = AsyncEngine(runtime, "step", max_queue=2)
        engine.submit(req(2))
        engine.submit(req(2))
        with pytest.raises(QueueFull, match="queue is full"):
            engine.submit(req(2))
        async with engine:
            pass  # drains the two
        return engine

    stats = run(main()).stats()
    assert stats["rejected"]["queue_full"] == 1 and stats["finished"]["completed"] == 2


def test_invalid_request_is_rejected_at_submit_with_its_field_path(runtime: Any) -> None:
    async def main() -> None:
        engine = AsyncEngine(runtime, "step")
        with pytest.raises(RequestError) as err:
            engine.submit(req(10_000))
        assert err.value.path == "diffusion.steps"
        with pytest.raises(RequestError) as err:
            engine.submit({"task": "t2v", "prompt": "x", "plugin_params": {"probe": {}}})
        assert err.value.path == "plugin_params.probe"  # not enabled in this deployment
        assert engine.stats()["rejected"]["invalid"] == 2

    run(main())


# -- priorities -----------------------------------------------------------------------------------
def test_priority_then_fifo_decides_admission_order(runtime: Any) -> None:
    async def main() -> list[str]:
        engine = AsyncEngine(runtime, "step", max_running=1)
        hs = [
            engine.submit({**req(3, rid=rid), "priority": prio})
            for rid, prio in [("low", -5), ("mid1", 0), ("high", 10), ("mid2", 0)]
        ]
        async with engine:
            return await _finish_order(engine, hs)

    assert run(main()) == ["high", "mid1", "mid2", "low"]


# -- events, tracing, lifecycle -------------------------------------------------------------------
def test_events_stream_progress_then_final(runtime: Any) -> None:
    async def main() -> list[Any]:
        async with AsyncEngine(runtime, "step") as engine:
            h = engine.submit(req(4))
            return [ev async for ev in h.events()]

    evs = run(main())
    steps = [ev.step for ev in evs if ev.kind is EventKind.PROGRESS and ev.total]
    assert steps == [1, 2, 3, 4]
    assert evs[-1].kind is EventKind.FINAL and evs[-1].output.ok


def test_decisions_reach_the_observer_bus(sched_checkpoint: Any) -> None:
    from omniloop_scheduler.testing import DecisionRecorder, make_runtime

    rec = DecisionRecorder()
    rt = make_runtime(sched_checkpoint, ("recorder", rec), plugins={"recorder": {}})

    async def main() -> AsyncEngine:
        async with AsyncEngine(rt, "step") as engine:
            await engine.submit(req(3)).result(timeout=T)
        return engine

    engine = run(main())
    assert Counter(d.action for d in rec.decisions) == Counter(d.action for d in engine.trace)
    assert {d.action for d in rec.decisions} >= {"admit", "stage", "step"}


def test_trace_is_bounded(runtime: Any) -> None:
    async def main() -> AsyncEngine:
        async with AsyncEngine(runtime, "step", trace_len=5) as engine:
            await engine.submit(req(8)).result(timeout=T)
        return engine

    assert len(run(main()).trace) == 5


def test_shutdown_without_drain_cancels_everything(runtime: Any) -> None:
    async def main() -> list[Any]:
        engine = AsyncEngine(runtime, "step", max_running=2)
        await engine.start()
        hs = [engine.submit(req(200, seed=i)) for i in range(4)]
        await asyncio.sleep(0.05)
        await engine.shutdown(drain=False, timeout=T)
        return [await h.result(timeout=T) for h in hs]

    outs = run(main())
    assert all(o.status is Status.CANCELLED for o in outs)


def test_warmup_runs_a_tiny_request_and_calibrates(runtime: Any) -> None:
    async def main() -> AsyncEngine:
        engine = AsyncEngine(runtime, "step", warmup=True)
        async with engine:
            pass
        return engine

    engine = run(main())
    assert engine.stats()["submitted"] == 0  # not counted as traffic
    assert engine.pool.cost.snapshot()["seconds_per_unit"]  # calibrated from the warmup


def test_metrics_add_up(probe_runtime: Any) -> None:
    rt, probe = probe_runtime
    probe.fail_at["f"] = 1

    async def main() -> dict[str, Any]:
        async with AsyncEngine(rt, "step") as engine:
            hs = [engine.submit(req(4, rid=rid)) for rid in ["a", "f", "c"]]
            engine.cancel("c")
            await asyncio.gather(*(h.result(timeout=T) for h in hs))
            return engine.stats()

    s = run(main())
    assert s["submitted"] == sum(s["finished"].values()) + s["waiting"] + s["running"] == 3
    assert s["finished"] == {"completed": 1, "failed": 1, "cancelled": 1}


def test_shutdown_before_start_cancels_what_was_submitted(runtime: Any) -> None:
    async def main() -> tuple[Any, dict[str, Any]]:
        engine = AsyncEngine(runtime, "step")
        h = engine.submit(req(4))
        await engine.shutdown()
        return await h.result(timeout=T), engine.stats()

    out, stats = run(main())
    assert out.status is Status.CANCELLED
    assert stats["submitted"] == stats["finished"]["cancelled"] == 1 and stats["waiting"] == 0
