"""Expert routing: which transformer runs a step.

* :class:`SingleExpert` [``single``] — one transformer for every step.
* :class:`BoundaryRouter` [``boundary``] — Wan2.2's two experts: ``high`` while
  ``timestep >= boundary_ratio * num_train_timesteps``, ``low`` after (diffusers'
  ``WanPipeline``: ``transformer`` for the high-noise stage, ``transformer_2`` for the low-noise).

Routers are stateless; they read the step's timestep as a host float (``SamplerState.
timestep_values``), so routing costs no device sync. The chosen name goes into
``StepContext.expert``, which is how the adaptive CFG gate sees the switch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

from attrs import define

from omniloop.loop import StepContext

from .errors import PolicyError


@runtime_checkable
class ExpertRouter(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def experts(self) -> tuple[str, ...]:
        """Every expert (component name) the router may return."""

    def active_expert(self, step: StepContext | float) -> str: ...


def _timestep(step: StepContext | float) -> float:
    return float(step.timestep) if isinstance(step, StepContext) else float(step)


@define(frozen=True, kw_only=True)
class SingleExpert:
    name: ClassVar[str] = "single"

    expert: str = "transformer"

    @property
    def experts(self) -> tuple[str, ...]:
        return (self.expert,)

    def active_expert(self, step: StepContext | float) -> str:
        return self.expert


@define(frozen=True, kw_only=True)
class BoundaryRouter:
    """Switch from ``high`` to ``low`` at ``boundary_ratio * num_train_timesteps``."""

    name: ClassVar[str] = "boundary"

    boundary_ratio: float
    high: str = "transformer"
    low: str = "transformer_2"
    num_train_timesteps: int = 1000

    def __attrs_post_init__(self) -> None:
        r = self.boundary_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 0.0 < r < 1.0:
            raise PolicyError(f"router {self.name!r}: boundary_ratio must be in (0, 1), got {r!r}")
        if self.high == self.low:
            raise PolicyError(f"router {self.name!r}: high and low experts must differ, both are {self.high!r}")
        if self.num_train_timesteps < 1:
            raise PolicyError(f"router {self.name!r}: num_train_timesteps must be >= 1")

    @classmethod
    def from_config(
        cls, pipeline_config: Mapping[str, Any], *, num_train_timesteps: int = 1000, **kw: Any
    ) -> BoundaryRouter | None:
        """From a diffusers ``model_index.json``: None when it has no ``boundary_ratio`` (Wan2.1)."""
        ratio = pipeline_config.get("boundary_ratio")
        if ratio is None:
            return None
        return cls(boundary_ratio=float(ratio), num_train_timesteps=num_train_timesteps, **kw)

    @property
    def experts(self) -> tuple[str, ...]:
        return (self.high, self.low)

    @property
    def boundary_timestep(self) -> float:
        return self.boundary_ratio * self.num_train_timesteps

    def active_expert(self, step: StepContext | float) -> str:
        return self.high if _timestep(step) >= self.boundary_timestep else self.low


ROUTER_CLASSES: dict[str, type] = {SingleExpert.name: SingleExpert, BoundaryRouter.name: BoundaryRouter}
