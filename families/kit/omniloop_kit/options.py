"""Family options the diffusers-format families share (``options.vae_dtype``, ...)."""

from __future__ import annotations

from typing import Any

import torch

from omniloop.errors import DeployError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_option(value: Any, what: str) -> torch.dtype:
    """A dtype family option (a name in :data:`DTYPES`, or a ``torch.dtype``); a bad value is one
    :class:`DeployError` naming ``options.<what>``."""
    if isinstance(value, torch.dtype):
        return value
    if value not in DTYPES:
        raise DeployError(f"options.{what}: must be one of {', '.join(DTYPES)}, not {value!r}")
    return DTYPES[value]


__all__ = ["DTYPES", "dtype_option"]
