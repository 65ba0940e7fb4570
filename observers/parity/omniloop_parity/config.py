"""Deploy-level configuration of the ``parity`` observer (``plugins: {parity: {...}}``)."""

from __future__ import annotations

from attrs import define, field

from omniloop.errors import OmniloopError
from omniloop.schema import check_regex


class ParityError(OmniloopError):
    """A recording is missing, malformed, or a parity run could not be made."""


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
    taps: str = field(default=".*", validator=check_regex)
    blocks: str | None = field(default=None, validator=check_regex)
    final: bool = True
    keep: int = field(default=4, metadata={"ge": 1})
