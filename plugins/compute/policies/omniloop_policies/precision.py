"""Precision policy: compute dtype and autocast per component, and the dtypes of the loop math.

Declared once per model (from the deploy's dtype and the family's knowledge), read by the family:

* ``dtype_for("transformer")`` — the dtype a component's weights/inputs use;
* ``autocast_for("transformer", device)`` — a context manager (a no-op unless an autocast dtype
  is declared for that component);
* ``step_dtype`` — the dtype of the scheduler step math (float32 by default; ``None`` runs the
  diffusers scheduler on the tensors as given, which reproduces diffusers pipelines bit for bit);
* ``combine_dtype`` — the dtype of the CFG combine (``None``: the predictions' dtype, as diffusers);
* ``latents_dtype`` — the dtype the loop keeps its latents in between steps (float32, as diffusers'
  Wan pipeline).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from attrs import define, field

from .errors import PolicyError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def parse_dtype(value: torch.dtype | str | None, *, what: str = "dtype") -> torch.dtype | None:
    """``"bf16"`` / ``"bfloat16"`` / ``torch.bfloat16`` → ``torch.bfloat16``; None and "native" stay None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.lower().removeprefix("torch.")
        if key in ("native", "none", "auto"):
            return None
        if key in _DTYPES:
            return _DTYPES[key]
    raise PolicyError(f"precision: {what}={value!r} is not a dtype; use one of {sorted(set(_DTYPES))} or 'native'")


def _dtype_map(value: Mapping[str, torch.dtype | str] | None) -> dict[str, torch.dtype]:
    out: dict[str, torch.dtype] = {}
    for k, v in (value or {}).items():
        d = parse_dtype(v, what=f"{k} dtype")
        if d is not None:
            out[str(k)] = d
    return out


def _opt_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    return parse_dtype(value)


def _dtype(value: torch.dtype | str) -> torch.dtype:
    d = parse_dtype(value)
    if d is None:
        raise PolicyError("precision: latents_dtype cannot be 'native'")
    return d


@define(frozen=True, kw_only=True)
class PrecisionPolicy:
    name: ClassVar[str] = "precision"

    #: compute dtype per component; components not listed use ``default_dtype``
    dtypes: dict[str, torch.dtype] = field(factory=dict, converter=_dtype_map)
    default_dtype: torch.dtype = field(default=torch.float32, converter=_dtype)
    #: autocast dtype per component (absent: no autocast)
    autocast: dict[str, torch.dtype] = field(factory=dict, converter=_dtype_map)
    step_dtype: torch.dtype | None = field(default=torch.float32, converter=_opt_dtype)
    combine_dtype: torch.dtype | None = field(default=None, converter=_opt_dtype)
    latents_dtype: torch.dtype = field(default=torch.float32, converter=_dtype)

    def dtype_for(self, component: str) -> torch.dtype:
        return self.dtypes.get(component, self.default_dtype)

    def autocast_for(self, component: str, device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
        dtype = self.autocast.get(component)
        if dtype is None:
            return contextlib.nullcontext()
        device_type = torch.device(device).type
        return torch.autocast(device_type=device_type, dtype=dtype)

    def to_model(self, component: str, value: torch.Tensor) -> torch.Tensor:
        """Cast an input tensor to the component's compute dtype (a no-op when it already is)."""
        return value.to(self.dtype_for(component))
