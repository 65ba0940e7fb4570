"""Deploy-level configuration of the ``profiler`` observer (``plugins: {profiler: {...}}``)."""

from __future__ import annotations

from attrs import define, field

from omniloop.schema import check_regex


def _window(_inst: object, _attr: object, value: list[int] | None) -> None:
    if value is not None and (len(value) != 2 or value[0] < 0 or value[1] < value[0]):
        raise ValueError(f"trace_steps must be [first, last] with 0 <= first <= last, got {value!r}")


@define(frozen=True)
class ProfilerConfig:
    """What the profiler measures.

    * ``json`` — write each request's report to this file (``{request_id}`` is replaced).
    * ``sync`` — synchronize the CUDA device at every measured boundary, so wall times are device
      times too (slows the run; off by default: only CUDA events are recorded, read at the end).
    * ``device_time`` — record CUDA events per node, step and block (GPU only).
    * ``blocks`` — regex of block names (``blocks.3``) to time; needs eager block execution.
    * ``memory`` — peak memory per node (CUDA max allocated on GPU; process peak RSS on CPU).
    * ``trace_steps`` — ``[first, last]`` loop steps to capture with ``torch.profiler`` into
      ``trace_out`` (a chrome trace; ``{request_id}`` is replaced).
    * ``nvtx`` — NVTX ranges per node and step (and marks per block) on CUDA.
    * ``keep`` — how many reports to keep in memory for :meth:`Profiler.get_report`.
    """

    json: str | None = None
    sync: bool = False
    device_time: bool = True
    blocks: str | None = field(default=None, validator=check_regex)
    memory: bool = True
    trace_steps: list[int] | None = field(default=None, validator=_window)
    trace_out: str = "omniloop-profile-{request_id}.json"
    nvtx: bool = False
    keep: int = field(default=32, metadata={"ge": 1})
