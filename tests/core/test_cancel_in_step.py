"""Cancel inside a long step (issue 42, finding 1): ``Execution.cancel()`` from another thread
stops a running step before its next transformer block (``run_blocks`` checks the flag), the
request ends ``cancelled`` with interceptors closed, and the runtime stays usable."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from omniloop.cancel import check_cancelled, watching
from omniloop.errors import CancelledError
from omniloop.interceptors import run_blocks
from omniloop.request import Status
from omniloop.testing import toy_request, toy_runtime
from omniloop.testing.toy import build_toy_checkpoint


def test_check_outside_a_unit_does_nothing() -> None:
    check_cancelled()
    with watching(lambda: False):
        check_cancelled()


def test_run_blocks_checks_before_every_block() -> None:
    seen: list[int] = []
    flag = {"on": False}

    def call(block: Any, hidden: torch.Tensor) -> torch.Tensor:
        seen.append(block)
        if block == 2:
            flag["on"] = True  # cancelled while block 2 runs
        return hidden + 1

    with watching(lambda: flag["on"]):
        try:
            run_blocks([0, 1, 2, 3, 4], torch.zeros(1), None, call)
            raise AssertionError("not cancelled")
        except CancelledError:
            pass
    assert seen == [0, 1, 2]  # block 3 never started


class _SlowBlocks:
    """Patches the toy transformer's blocks: each sleeps, and the test cancels mid-step."""

    def __init__(self, runtime: Any, seconds: float) -> None:
        self.started = threading.Event()
        self.calls = 0
        self.seconds = seconds
        tr = runtime.model.components["transformer"]
        self.blocks = tr.blocks
        self.originals = [b.forward for b in self.blocks]
        for b in self.blocks:
            b.forward = self._wrap(b.forward)

    def _wrap(self, fn: Any) -> Any:
        def slow(*a: Any, **k: Any) -> Any:
            self.calls += 1
            self.started.set()
            time.sleep(self.seconds)
            return fn(*a, **k)
        return slow

    def restore(self) -> None:
        for b, f in zip(self.blocks, self.originals, strict=True):
            b.forward = f


def test_cancel_from_another_thread_stops_inside_the_step(tmp_path: Path) -> None:
    rt = toy_runtime(build_toy_checkpoint(tmp_path / "ck"))
    n_blocks = len(rt.model.components["transformer"].blocks)
    slow = _SlowBlocks(rt, 0.05)
    ex = rt.prepare(toy_request(steps=50))
    ex.advance()  # text encode
    def cancel_later() -> None:
        slow.started.wait(5)
        ex.cancel()
    t = threading.Thread(target=cancel_later)
    t.start()
    events = ex.advance()  # the loop's init + first step: cancelled in its first forward
    t.join()
    slow.restore()
    assert ex.done and ex.output.status is Status.CANCELLED
    assert events[-1].kind.value == "final"
    assert slow.calls < n_blocks * 2  # stopped within the first forward, not after a whole step
    assert ex.loop is None  # the loop was closed (interceptors closed, observers told)
    out = rt.generate(toy_request(steps=2))  # the runtime is still usable
    assert out.ok


def test_step_engine_cancel_interrupts_a_running_step(tmp_path: Path) -> None:
    import asyncio

    from omniloop_scheduler.engine import AsyncEngine

    rt = toy_runtime(build_toy_checkpoint(tmp_path / "ck"))
    slow = _SlowBlocks(rt, 0.2)

    async def main() -> Any:
        async with AsyncEngine(rt) as engine:
            h = engine.submit(toy_request(steps=200))
            while not slow.started.is_set():
                await asyncio.sleep(0.01)
            calls = slow.calls
            assert h.cancel()
            out = await h.result()
            # the cancel landed inside the running forward: at most one more block started
            assert slow.calls <= calls + 1, (calls, slow.calls)
            slow.restore()
            again = await engine.submit(toy_request(steps=2)).result()
            return out, again

    out, again = asyncio.run(main())
    assert out.status is Status.CANCELLED
    assert again.ok
