"""Scheduler options (``deploy.scheduler_options``), validated like every other config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs
from attrs import define, field

from omniloop.schema import structure_deploy_section


@define(frozen=True)
class SchedulerOptions:
    """Options shared by the ``step`` and ``serial`` engines.

    ``memory_budget_gib`` is the budget for *per-request* memory (latents, activations) on top of
    the loaded weights. ``None``: on CUDA 90% of the memory free after the model loaded, on CPU
    unlimited (requests are still tracked and predicted).
    """

    #: most executions co-batched in one forward
    max_batch: int = field(default=8, metadata={"ge": 1, "le": 256})
    #: most executions admitted (interleaved) at once
    max_running: int = field(default=16, metadata={"ge": 1})
    memory_budget_gib: float | None = field(default=None, metadata={"gt": 0.0})
    #: do not admit a request when one round over the running ones would be predicted longer than this
    max_round_seconds: float | None = field(default=None, metadata={"gt": 0.0})
    #: admit requests that fit now behind a head that waits for memory or cost room
    backfill: bool = False
    #: stop backfilling once the waiting head has waited this long (bounds its starvation)
    backfill_max_wait_s: float = field(default=30.0, metadata={"ge": 0.0})
    #: wait-queue length; None: ``deploy.limits.max_queue``
    max_queue: int | None = field(default=None, metadata={"ge": 1})
    #: fail a request whose loop tensors become NaN/inf (one isfinite per step); a batched step
    #: checks every row whatever this says (one request's NaN fails it alone, never its batch-mates)
    nan_check: bool = False
    #: length of the in-memory decision trace
    trace_len: int = field(default=4096, metadata={"ge": 0})
    #: run one tiny request when the async engine starts
    warmup: bool = False
    #: calibrate the cost and memory models from measured steps
    calibrate: bool = True
    #: EMA weight of a new measurement
    ema_alpha: float = field(default=0.3, metadata={"gt": 0.0, "le": 1.0})
    #: safety factor applied to memory predictions
    memory_margin: float = field(default=1.2, metadata={"ge": 1.0})
    #: which running request takes the next unit: ``round_robin`` (each in turn) or
    #: ``fewest_steps_left`` (the one closest to done first: short requests finish without waiting
    #: for the rounds of long ones), with aging: one that has not run for ``order_max_wait_s`` goes first
    order: Literal["round_robin", "fewest_steps_left"] = "round_robin"
    order_max_wait_s: float = field(default=10.0, metadata={"gt": 0.0})


def parse_options(options: Mapping[str, Any] | SchedulerOptions | None) -> SchedulerOptions:
    return structure_deploy_section(SchedulerOptions, options, "scheduler_options")


def evolve(opts: SchedulerOptions, **changes: Any) -> SchedulerOptions:
    return parse_options({**attrs.asdict(opts), **changes})
