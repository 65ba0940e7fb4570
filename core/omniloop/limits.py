"""What a checkpoint supports: its declared size/frame range, and the effective limits of a deployment.

A deploy's ``limits`` bound what the *machine* will run (2048x2048, 257 frames by default). A
checkpoint knows what it was *trained* for: a small demo trained at 64x64 gives noise at 256x256.
Any checkpoint folder may declare its range in its ``omniloop.json``::

    {"limits": {"min_height": 64, "max_height": 64, "min_width": 64, "max_width": 64,
                "max_frames": 17, "note": "trained at 17x64x64"}}

Every key is optional. ``enforce`` says what happens to a request outside the range:

* ``"refuse"`` (the default; the shipped demo models): the deployment's effective limits are its
  deploy limits *tightened* by the declared maxima, so the runtime's one range check
  (:meth:`omniloop.runtime.Deployment.check`, before any compute) refuses the request with one
  line naming the field and the model's range;
* ``"warn"`` (a real model that merely degrades outside its training range): the request runs,
  bounded by the deploy's limits as always, with one warning naming the field and the range
  (``OmniOutput.metrics["warnings"]``; ``omniloop generate`` prints it before the run).

The core reads the declaration for every family (:func:`declared`); nothing here is family code.

A checkpoint folder may also declare the tasks it does (``{"tasks": ["t2v"]}``, :func:`declared_tasks`):
``Deployment.supported_tasks`` uses it when the family has no config-only view of the checkpoint
(``inspect``), so a T2V checkpoint of a family that also does I2V is not advertised as I2V before
its weights load (``omniloop schema --model``, ``omniloop models``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import attrs
from attrs import define, field

from .errors import DeployError, RequestError

#: the request fields a declaration may bound, in the order they are checked
FIELDS = ("height", "width", "frames", "steps")


@define(frozen=True)
class ModelLimits:
    """A checkpoint's declared range (``omniloop.json`` ``limits``); None: not declared."""

    min_height: int | None = field(default=None, metadata={"ge": 1})
    max_height: int | None = field(default=None, metadata={"ge": 1})
    min_width: int | None = field(default=None, metadata={"ge": 1})
    max_width: int | None = field(default=None, metadata={"ge": 1})
    min_frames: int | None = field(default=None, metadata={"ge": 1})
    max_frames: int | None = field(default=None, metadata={"ge": 1})
    max_steps: int | None = field(default=None, metadata={"ge": 1})
    #: ``refuse``: outside is refused before compute; ``warn``: outside runs with a warning
    enforce: Literal["refuse", "warn"] = "refuse"
    #: a short human reason shown with the range ("trained at 17x64x64")
    note: str | None = None

    def range_of(self, name: str) -> tuple[int | None, int | None]:
        return (getattr(self, f"min_{name}", None), getattr(self, f"max_{name}", None))

    def describe(self, name: str) -> str:
        """``height 64..64`` / ``frames up to 17`` / ``steps up to 50``."""
        lo, hi = self.range_of(name)
        if lo is not None and hi is not None:
            return f"{name} {lo}..{hi}"
        if hi is not None:
            return f"{name} up to {hi}"
        return f"{name} from {lo}"

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


def _declaration(model_path: str | Path | None, key: str) -> tuple[Path, Any] | None:
    """``(file, value)`` of ``key`` in a checkpoint folder's ``omniloop.json``, or None when the
    folder, the file or the key is absent (or the file is unreadable: the family reports a bad
    ``omniloop.json`` when it reads it)."""
    if model_path is None:
        return None
    f = Path(model_path) / "omniloop.json"
    if not f.is_file():
        return None
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or key not in meta:
        return None
    return f, meta[key]


def declared(model_path: str | Path | None) -> ModelLimits | None:
    """The ``limits`` a checkpoint folder declares in its ``omniloop.json``, or None.

    Raises :class:`DeployError` naming the file and the field when the declaration is malformed
    (a checkpoint is a boundary too)."""
    found = _declaration(model_path, "limits")
    if found is None:
        return None
    f, value = found
    from .schema import structure

    try:
        got = structure(value, ModelLimits, "limits")
    except RequestError as exc:
        raise DeployError(f"{f}: {exc}") from None
    for name in FIELDS:
        lo, hi = got.range_of(name)
        if lo is not None and hi is not None and lo > hi:
            raise DeployError(f"{f}: limits.min_{name}: {lo} is above limits.max_{name} {hi}")
    return got


def declared_tasks(model_path: str | Path | None) -> frozenset[str] | None:
    """The ``tasks`` a checkpoint folder declares in its ``omniloop.json``, or None.

    Raises :class:`DeployError` naming the file when the key is malformed."""
    found = _declaration(model_path, "tasks")
    if found is None:
        return None
    f, tasks = found
    from .request import TaskType

    known = {t.value for t in TaskType}
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) and t in known for t in tasks):
        raise DeployError(f"{f}: tasks: expected a non-empty list of task names ({', '.join(sorted(known))}), "
                          f"got {str(tasks)[:80]}")
    return frozenset(tasks)


def tighten(limits: Any, model: ModelLimits | None) -> Any:
    """The deploy's :class:`~omniloop.deploy.Limits` with the maxima of a ``refuse`` declaration
    applied (the smaller of the two wins); unchanged for ``warn`` or no declaration."""
    if model is None or model.enforce != "refuse":
        return limits
    changes = {}
    for name in FIELDS:
        _, hi = model.range_of(name)
        current = getattr(limits, f"max_{name}")
        if hi is not None and hi < current:
            changes[f"max_{name}"] = hi
    return attrs.evolve(limits, **changes) if changes else limits


def outside(model: ModelLimits, values: dict[str, int | None], model_name: str) -> list[tuple[str, str]]:
    """``(field path, message)`` for each given value outside the declared range."""
    out = []
    why = f" ({model.note})" if model.note else ""
    for name in FIELDS:
        value = values.get(name)
        if value is None:
            continue
        lo, hi = model.range_of(name)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            out.append((f"diffusion.{name}", f"{value} is outside what model {model_name} supports: "
                        f"{model.describe(name)}{why}, declared in its omniloop.json limits"))
    return out
