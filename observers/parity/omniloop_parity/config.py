"""Deploy-level configuration of the ``parity`` observer (``plugins: {parity: {...}}``)."""

from __future__ import annotations

import hashlib
import re
import string
from pathlib import Path
from typing import Any

from attrs import define, field

from omniloop.errors import OmniloopError
from omniloop.schema import check_regex


class ParityError(OmniloopError):
    """A recording is missing, malformed, or a parity run could not be made."""


#: what ``{request_id}`` becomes in a file name: request ids are validated identifiers (for
#: requests built in Python too), and anything else is still replaced here, as a second line
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:@+=-]")


def check_out_template(_inst: object, attr: Any, value: str | None) -> None:
    """attrs validator of ``out``: a path whose only placeholder is ``{request_id}``, in the file
    name (never in a folder name: the folder is the deploy's choice, not a request's)."""
    if value is None:
        return
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(value) if f is not None]
    except ValueError as exc:
        raise ValueError(f"{attr.name}: malformed template {value!r}: {exc}") from None
    bad = [f for f in fields if f != "request_id"]
    if bad:
        raise ValueError(f"{attr.name}: the only placeholder allowed is {{request_id}}, got {{{bad[0]}}}")
    if "{request_id}" in str(Path(value).parent):
        raise ValueError(f"{attr.name}: {{request_id}} may only appear in the file name, not in a folder: {value!r}")


def out_path(template: str, request_id: str) -> Path:
    """The recording file of ``request_id`` under the ``out`` template: the id reduced to safe
    characters (never ``/``, never a leading ``.``), and checked to land in the template's folder.

    The core refuses such ids on every entry (``omniloop.schema.as_request``), so this is a second
    line: an id that had to be changed gets ``-<8 hex digits of its SHA-256>`` appended, so two
    different ids never share a file (``a/b`` and ``a_b``)."""
    safe = _UNSAFE.sub("_", request_id)[:128].lstrip(".") or "request"
    if safe != request_id:
        digest = hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        safe = f"{safe[:119]}-{digest}"
    path = Path(template.format(request_id=safe))
    folder = Path(template).parent
    if path.parent.resolve() != folder.resolve():
        raise ParityError(f"parity: the recording path {path} of request {safe!r} is outside {folder}")
    return path


@define(frozen=True)
class ParityConfig:
    """What the recorder keeps and where it writes it.

    * ``out`` — write each completed request's recording to this safetensors file (``{request_id}``
      in the file name is replaced by the request id reduced to safe characters; the folder is
      fixed); ``None`` keeps recordings in memory (``ParityRecorder.take(request_id)``).
    * ``taps`` — regex over tap names to record (``noise_pred``, ``guided``, ``latents``, ...).
      Block outputs are never recorded through this pattern, only through ``blocks``.
    * ``blocks`` — regex over block module names (``blocks.3``) whose outputs to record; setting it
      makes the observer need eager block execution.
    * ``final`` — also record the request's output artifacts (``final/video``, ``final/latents``).
    * ``keep`` — how many in-memory recordings to retain (oldest dropped first).
    """

    out: str | None = field(default=None, validator=check_out_template)
    taps: str = field(default=".*", validator=check_regex)
    blocks: str | None = field(default=None, validator=check_regex)
    final: bool = True
    keep: int = field(default=4, metadata={"ge": 1})
