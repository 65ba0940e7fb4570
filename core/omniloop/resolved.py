"""A request's resolved form: what its family makes of it, once, before any compute.

``Runtime.prepare`` structures the request's node and plugin params (the one cattrs converter,
ranges in field metadata) and then calls the family's ``resolve(model, request, limits,
node_params=...)`` exactly once. What comes back is the family's own frozen attrs class following
:class:`Resolved`; it lives on the :class:`~omniloop.execution.Execution` (``execution.resolved``)
and on every :class:`~omniloop.loop.StageContext` (``ctx.resolved``), where stages, policies,
interceptors and schedulers read it. Nothing re-parses ``node_params`` after that.

The scheduler asks the resolved request for its :class:`Workload` (loop steps, forwards per step,
output size) instead of guessing a family's defaults, so a new family needs no scheduler edit.

A family without ``resolve`` gets :class:`GenericResolved`: its ``validate_request`` warnings and a
workload from the request's diffusion/sampling fields over the family's ``task_defaults``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs
from attrs import define, field

from .request import OmniRequest, TaskType


@define(frozen=True)
class Workload:
    """What one request costs, as its family predicts it before it runs.

    ``steps`` loop steps (denoise steps, or decode tokens), each of ``branches`` forwards (guidance
    branches) over an output of ``frames`` x ``height`` x ``width`` (1x1x1 for text)."""

    steps: int = field(metadata={"ge": 0})
    branches: int = field(default=1, metadata={"ge": 1})
    frames: int = field(default=1, metadata={"ge": 1})
    height: int = field(default=1, metadata={"ge": 1})
    width: int = field(default=1, metadata={"ge": 1})
    #: what the deploy's limits bound, as resolved: dimension (``steps``, ``frames``, ``height``,
    #: ``width``) -> (value, the request field it came from, e.g. ``node_params.denoise.steps``).
    #: The runtime checks these once, after resolve (:func:`check_limits`); a family checks none.
    #: Empty: nothing bounded (text decoding has no diffusion limits).
    bounded: Mapping[str, tuple[int, str]] = field(factory=dict, eq=False)

    @property
    def pixels(self) -> int:
        return self.frames * self.height * self.width


#: the deploy limit (``omniloop.deploy.Limits`` field) bounding each workload dimension
LIMITS = {"steps": "max_steps", "frames": "max_frames", "height": "max_height", "width": "max_width"}


def bounds(*, steps: int | None = None, frames: int | None = None, height: int | None = None,
           width: int | None = None, steps_path: str = "diffusion.steps") -> dict[str, tuple[int, str]]:
    """``Workload.bounded`` for a diffusion request: each given dimension with its request field
    (``diffusion.<name>``; ``steps_path`` when a node param set the steps)."""
    got = {"steps": (steps, steps_path), "frames": (frames, "diffusion.frames"),
           "height": (height, "diffusion.height"), "width": (width, "diffusion.width")}
    return {k: (int(v), path) for k, (v, path) in got.items() if v is not None}


def check_limits(bounded: Mapping[str, tuple[int, str]], limits: Any) -> None:
    """The one range check of a request against the deployment's limits (``limits``: an
    ``omniloop.deploy.Limits``, or anything with its ``max_*`` fields): raises
    :class:`~omniloop.errors.RequestError` naming the request field that set the value."""
    from .errors import RequestError

    for name, (value, path) in bounded.items():
        limit = getattr(limits, LIMITS[name])
        if value > limit:
            raise RequestError(path, f"{value} is above this deployment's limit of {limit}")


@runtime_checkable
class Resolved(Protocol):
    """The core's view of any family's resolved request (the family's class adds its own fields)."""

    @property
    def task(self) -> TaskType:
        """The request's task."""
        ...

    @property
    def warnings(self) -> tuple[str, ...]:
        """Soft problems found while resolving (a truncated prompt, an ignored input)."""
        ...

    def workload(self) -> Workload:
        """Steps, forwards per step and output size: the scheduler's cost and memory priors."""
        ...


@define(frozen=True)
class GenericResolved:
    """The resolution of a family that has no ``resolve``: request fields over the task defaults."""

    task: TaskType
    warnings: tuple[str, ...] = ()
    #: the request's validated node params, by node name
    node_params: Mapping[str, Any] = attrs.Factory(dict)
    #: the family's defaults for this task (``Runtime.defaults``)
    defaults: Mapping[str, Any] = attrs.Factory(dict)
    request: OmniRequest | None = None

    def workload(self) -> Workload:
        req, dft = self.request, self.defaults
        if req is None:
            return Workload(steps=int(dft.get("steps", 1) or 1))
        d = req.diffusion
        explicit = bounds(steps=d.steps, frames=d.frames, height=d.height, width=d.width)
        if req.task is TaskType.REASON:
            return Workload(steps=int(req.sampling.max_tokens or dft.get("max_tokens", 1) or 1), bounded=explicit)

        def pick(name: str, fallback: int | float) -> Any:
            value = getattr(d, name)
            return value if value is not None else dft.get(name, fallback)

        frames = 1 if req.task in (TaskType.T2I, TaskType.I2I) else int(pick("frames", 1))
        guidance = float(pick("guidance_scale", 1.0))
        return Workload(
            steps=max(0, int(pick("steps", 1))), branches=2 if guidance > 1.0 else 1, frames=max(1, frames),
            height=max(1, int(pick("height", 1))), width=max(1, int(pick("width", 1))), bounded=explicit,
        )


__all__ = ["LIMITS", "GenericResolved", "Resolved", "Workload", "bounds", "check_limits"]
