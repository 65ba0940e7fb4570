"""Flow shift policies: which shift (or resolution exponent ``mu``) a request's sampler uses.

* :class:`ConstantShift` [``constant``] — the request's ``shift`` if given, else ``default``, else
  the checkpoint's shift (the sampler's config).
* :class:`ResolutionShift` [``resolution``] — diffusers' resolution-dependent shift
  (``calculate_shift`` in the Flux/SD3 pipelines): ``mu`` linear in the latent token count between
  ``(base_seq_len, base_shift)`` and ``(max_seq_len, max_shift)``. An explicit request shift wins.

Both are stateless: :meth:`resolve` returns a :class:`ShiftValue` the sampler's ``init`` takes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

from attrs import define

from .errors import PolicyError


@define(frozen=True)
class ShiftValue:
    """``shift`` (None: keep the checkpoint's) or ``mu`` (resolution exponent), never both."""

    shift: float | None = None
    mu: float | None = None


@runtime_checkable
class ShiftPolicy(Protocol):
    @property
    def name(self) -> str: ...

    def resolve(self, *, requested: float | None = None, seq_len: int | None = None) -> ShiftValue: ...


def _check_shift(policy: str, value: float | None, what: str = "shift") -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PolicyError(f"shift {policy!r}: {what} must be a finite number > 0, got {value!r}")
    return float(value)


@define(frozen=True, kw_only=True)
class ConstantShift:
    """A constant shift: request > ``default`` > checkpoint."""

    name: ClassVar[str] = "constant"

    default: float | None = None

    def __attrs_post_init__(self) -> None:
        _check_shift(self.name, self.default, "default")

    def resolve(self, *, requested: float | None = None, seq_len: int | None = None) -> ShiftValue:
        requested = _check_shift(self.name, requested)
        return ShiftValue(shift=requested if requested is not None else self.default)


def calculate_shift(
    seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """diffusers' ``calculate_shift`` (pipeline_flux.py): ``mu`` for ``seq_len`` latent tokens."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return seq_len * m + b


@define(frozen=True, kw_only=True)
class ResolutionShift:
    """Resolution-dependent shift from the latent token count (``mu``, exponential time shift).

    ``seq_len`` is the number of latent tokens the transformer sees (after patchifying)."""

    name: ClassVar[str] = "resolution"

    base_seq_len: int = 256
    max_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15

    def __attrs_post_init__(self) -> None:
        if not (0 < self.base_seq_len < self.max_seq_len):
            raise PolicyError(
                f"shift {self.name!r}: need 0 < base_seq_len < max_seq_len, got {self.base_seq_len}, {self.max_seq_len}"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None = None, **overrides: Any) -> ResolutionShift:
        """Take ``base_image_seq_len`` / ``max_image_seq_len`` / ``base_shift`` / ``max_shift`` from a
        scheduler config (FlowMatchEulerDiscreteScheduler keys)."""
        cfg = dict(config or {})
        kw: dict[str, Any] = {}
        for ours, theirs in (
            ("base_seq_len", "base_image_seq_len"),
            ("max_seq_len", "max_image_seq_len"),
            ("base_shift", "base_shift"),
            ("max_shift", "max_shift"),
        ):
            if cfg.get(theirs) is not None:
                kw[ours] = cfg[theirs]
        kw.update(overrides)
        return cls(**kw)

    def resolve(self, *, requested: float | None = None, seq_len: int | None = None) -> ShiftValue:
        requested = _check_shift(self.name, requested)
        if requested is not None:
            return ShiftValue(shift=requested)
        if seq_len is None or seq_len < 1:
            raise PolicyError(f"shift {self.name!r}: needs the latent token count (seq_len), got {seq_len!r}")
        return ShiftValue(
            mu=calculate_shift(seq_len, self.base_seq_len, self.max_seq_len, self.base_shift, self.max_shift)
        )


SHIFT_CLASSES: dict[str, type] = {ConstantShift.name: ConstantShift, ResolutionShift.name: ResolutionShift}
