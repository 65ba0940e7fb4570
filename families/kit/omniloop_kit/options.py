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


def choice_option(options: Any, key: str, choices: tuple[str, ...]) -> str:
    """``options[key]``, one of ``choices`` (unset: the first); anything else is one
    :class:`DeployError` naming ``options.<key>`` and the choices."""
    value = options.get(key) if options is not None else None
    if value is None:
        return choices[0]
    if value not in choices:
        raise DeployError(f"options.{key}: must be one of {', '.join(choices)}, not {value!r}")
    return str(value)


__all__ = ["DTYPES", "choice_option", "dtype_option"]
