"""``scheduler_options.order``: ``fewest_steps_left`` gives the next unit to the running request
closest to done; aging (``order_max_wait_s``) bounds how long another waits. Toy family, CPU."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from omniloop.errors import DeployError
from omniloop_scheduler import AsyncEngine
from omniloop_scheduler.testing import req

T = 60.0


def _steps(engine: AsyncEngine) -> list[str]:
    return [d.request_ids[0] for d in engine.trace if d.action == "step"]


def _run(runtime: Any, reqs: list[dict], **options: Any) -> tuple[AsyncEngine, list[Any]]:
    async def main() -> tuple[AsyncEngine, list[Any]]:
        engine = AsyncEngine(runtime, "step", max_batch=1, **options)
        hs = [engine.submit(r) for r in reqs]
        async with engine:
            outs = [await h.result(timeout=T) for h in hs]
        return engine, outs

    return asyncio.run(asyncio.wait_for(main(), 120))


def test_fewest_steps_left_runs_the_short_request_through_first(runtime: Any) -> None:
    reqs = [req(8, rid="long"), req(3, seed=1, rid="short", height=32)]
    engine, outs = _run(runtime, reqs, order="fewest_steps_left")
    assert _steps(engine) == ["short"] * 3 + ["long"] * 8
    alone = [runtime.generate(r) for r in reqs]  # the order changes nothing in the results
    for o, a in zip(outs, alone, strict=True):
        assert torch.equal(o.artifacts["video"].frames, a.artifacts["video"].frames)
    assert any("fewest steps left" in d.reason for d in engine.trace if d.action == "step")


def test_aging_lets_a_waiting_request_run(runtime: Any) -> None:
    # every unit waits longer than order_max_wait_s for the other request: strict alternation
    engine, _ = _run(runtime, [req(4, rid="long"), req(3, seed=1, rid="short", height=32)],
                     order="fewest_steps_left", order_max_wait_s=1e-9)
    assert _steps(engine)[:4] == ["long", "short", "long", "short"]
    assert any("order_max_wait_s" in d.reason for d in engine.trace if d.action == "step")


def test_round_robin_is_the_default_and_unknown_orders_are_refused(runtime: Any) -> None:
    engine, _ = _run(runtime, [req(4, rid="a"), req(4, seed=1, rid="b", height=32)])
    assert _steps(engine)[:4] == ["a", "b", "a", "b"]
    with pytest.raises(DeployError, match=r"scheduler_options\.order"):
        AsyncEngine(runtime, "step", order="shortest")
