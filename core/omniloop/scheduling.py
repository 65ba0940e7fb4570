"""What a scheduler reports about its decisions (the ``omniloop_schedule_decision`` event payload)."""

from __future__ import annotations

from attrs import define


@define
class ScheduleDecision:
    """What a scheduler ran and why (the ``omniloop_schedule_decision`` event payload)."""

    scheduler: str
    action: str  # "stage" | "step" | "batched_step" | "admit" | "wait" | "refuse" | "cancel"
    request_ids: tuple[str, ...]
    node: str | None = None
    reason: str = ""


__all__ = ["ScheduleDecision"]
