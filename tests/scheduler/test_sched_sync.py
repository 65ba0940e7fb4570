"""The ``step`` scheduler through the synchronous runtime API, and the cost/memory models."""

from __future__ import annotations

from typing import Any

import torch

from omniloop.request import EventKind
from omniloop_scheduler import StepScheduler
from omniloop_scheduler.models import CostModel, MemoryModel, RequestShape
from omniloop_scheduler.testing import make_runtime, req


def test_runtime_generate_with_scheduler_step_matches_serial(sched_checkpoint: Any, runtime: Any) -> None:
    step_rt = make_runtime(sched_checkpoint, scheduler="step", scheduler_options={"max_batch": 4})
    assert isinstance(step_rt.scheduler, StepScheduler)
    r = req(5, seed=7)
    a, b = step_rt.generate(r), runtime.generate(r)
    assert a.ok and torch.equal(a.artifacts["video"].frames, b.artifacts["video"].frames)


def test_two_streams_iterated_side_by_side_interleave(sched_checkpoint: Any) -> None:
    rt = make_runtime(sched_checkpoint, scheduler="step")
    s1, s2 = rt.stream(req(20, rid="one")), rt.stream(req(3, rid="two", height=32))
    ev2 = []
    for ev in s2:  # driving stream two also advances stream one, round-robin
        ev2.append(ev)
    assert ev2[-1].kind is EventKind.FINAL and ev2[-1].output.ok
    steps_one = [d for d in rt.scheduler.trace if d.action == "step" and d.request_ids == ("one",)]
    assert 0 < len(steps_one) < 20
    final1 = [ev for ev in s1][-1]
    assert final1.output.ok and final1.output.metrics["steps"] == 20


def test_abandoned_stream_cancels_its_request(sched_checkpoint: Any) -> None:
    rt = make_runtime(sched_checkpoint, scheduler="step")
    s = rt.stream(req(50, rid="gone"))
    for ev in s:
        if ev.step == 2:
            break
    s.close()
    assert any(d.action == "cancel" for d in rt.scheduler.trace)
    assert rt.scheduler.pool.idle


def test_cost_model_calibrates_from_measurements() -> None:
    cm = CostModel(alpha=0.5)
    small = RequestShape("m", "t2v", 1, 16, 16, 4, 2)
    big = RequestShape("m", "t2v", 4, 64, 64, 4, 2)
    prior = cm.step_seconds(small)
    cm.observe(small, 0.01)
    assert cm.step_seconds(small) == 0.01 != prior
    cm.observe(small, 0.02)
    assert abs(cm.step_seconds(small) - 0.015) < 1e-12  # EMA
    # an unseen shape scales from the per-model coefficient, not the prior
    assert cm.step_seconds(big) > cm.step_seconds(small)
    assert abs(cm.step_seconds(big) / cm.step_seconds(small) - cm.units(big) / cm.units(small)) < 1e-6
    cm.observe(small, 0.004, batch=4)
    assert cm.step_seconds(small, batch=4) == 0.004


def test_memory_model_predicts_resident_and_peak_and_calibrates() -> None:
    mm = MemoryModel(alpha=1.0, margin=1.0)
    s = RequestShape("m", "t2v", 3, 16, 16, 4, 2)
    prior = mm.predict(s)
    assert prior.resident > 0 and prior.peak > 0
    mm.observe_resident(s, 1000)
    mm.observe_peak(s, 5000)
    est = mm.predict(s)
    assert (est.resident, est.peak) == (1000, 5000)
    bigger = RequestShape("m", "t2v", 6, 16, 16, 4, 2)
    assert mm.predict(bigger).resident == 2000  # per-pixel coefficient from the calibration


def test_cuda_peak_memory_calibration_uses_max_memory_allocated_deltas(runtime: Any, monkeypatch: Any) -> None:
    """The CUDA path (no GPU here): peak bytes per step = max_memory_allocated - memory_allocated
    before the step, divided among the members of a batch, fed to the memory model."""
    from omniloop.schema import request_from_dict
    from omniloop_scheduler.models import shape_of
    from omniloop_scheduler.options import parse_options
    from omniloop_scheduler.step import build_pool

    fake = {"allocated": 1_000, "peak": 0}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: fake.update(peak=fake["allocated"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: fake["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: fake["peak"] + 4096)
    pool = build_pool(runtime, "step", parse_options({"memory_margin": 1.0}))
    pool._cuda = True
    r = request_from_dict(req(4, seed=1))
    shape = shape_of(runtime, r)
    prior = pool.memory.predict(shape).peak
    done: list[Any] = []
    pool.submit(pool.make_ticket(runtime.prepare(r), shape, done.extend))
    for _ in range(100):
        if not pool.tick():
            break
    assert done[-1].kind is EventKind.FINAL and done[-1].output.ok
    # refined shape (branches from the loop) holds the measurement: 4096 bytes per step
    measured = pool.memory.snapshot()["peak_bytes"]
    assert list(measured.values()) == [4096.0] and prior != 4096
