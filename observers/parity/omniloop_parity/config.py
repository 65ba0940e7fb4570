"""Deploy-level configuration of the ``parity`` observer (``plugins: {parity: {...}}``)."""

from __future__ import annotations

import re
from typing import Any

from attrs import define, field

from omniloop.errors import OmniloopError


class ParityError(OmniloopError):
    """A recording is missing, malformed, or a parity run could not be made."""


def _regex(_inst: object, attr: Any, value: str | None) -> None:
    if value is None:
        return
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"{attr.name}: invalid regular expression {value!r}: {exc}") from None


@define(frozen=True)
class ParityConfig:
    """What the recorder keeps and where it writes it.

    * ``out`` — write each completed request's recording to this safetensors file (``{request_id}``
      is replaced); ``None`` keeps recordings in memory (``ParityRecorder.take(request_id)``).
    * ``taps`` — regex over tap names to record (``noise_pred``, ``guided``, ``latents``, ...).
      Block outputs are never recorded through this pattern, only through ``blocks``.
    * ``blocks`` — regex over block module names (``blocks.3``) whose outputs to record; setting it
      makes the observer need eager block execution.
    * ``final`` — also record the request's output artifacts (``final/video``, ``final/latents``).
    * ``keep`` — how many in-memory recordings to retain (oldest dropped first).
    """

    out: str | None = None
    taps: str = field(default=".*", validator=_regex)
    blocks: str | None = field(default=None, validator=_regex)
    final: bool = True
    keep: int = field(default=4, metadata={"ge": 1})
