"""One cattrs converter for the request plane, with strict types and dotted-path errors.

* ``request_from_dict`` / ``request_to_dict`` — JSON round trip of :class:`OmniRequest`.
* ``structure_params(cls, data, path)`` — validate a plugin's or node's parameter dict against
  its attrs schema; ``check_regex`` is a field validator for regex-valued options.
* Errors: unknown keys, wrong types and out-of-range values raise :class:`RequestError` whose
  ``path`` is the dotted field path (``diffusion.steps``, ``inputs.0.text``).

Strictness: ``"5"`` is not an int and ``1`` is not a bool. Ranges come from attrs field metadata
(``ge``, ``gt``, ``le``, ``lt``, ``choices``).
"""

from __future__ import annotations

import enum
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.gen import make_dict_structure_fn
from cattrs.strategies import configure_tagged_union

from .errors import RequestError
from .request import (
    MODAL_PART_TYPES,
    ErrorInfo,
    ImagePart,
    ModalPart,
    OmniEvent,
    OmniOutput,
    OmniRequest,
)

T = TypeVar("T")


def _strict_int(v: Any, cls: Any) -> int:
    if cls is not int and isinstance(cls, type) and issubclass(cls, enum.Enum):
        return _enum(v, cls)  # type: ignore[return-value]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {_show(v)}")
    return v


def _strict_float(v: Any, _: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"expected a number, got {_show(v)}")
    return float(v)


def _strict_str(v: Any, cls: Any) -> str:
    if cls is not str and isinstance(cls, type) and issubclass(cls, enum.Enum):
        return _enum(v, cls)  # type: ignore[return-value]
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {_show(v)}")
    return v


def _strict_bool(v: Any, _: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected true or false, got {_show(v)}")
    return v


def _enum(v: Any, cls: type[enum.Enum]) -> enum.Enum:
    if isinstance(v, cls):
        return v
    try:
        return cls(v)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown value {v!r}; expected one of {choices}") from None


def _show(v: Any) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) < 40 else r[:37] + '...'}"


def make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    # singledispatch hooks also catch subclasses: str/int-based Enums are routed to _enum inside
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(Any, lambda v, _: v)

    def _attrs_factory(cls: type) -> Any:
        inner: Callable[[Any, Any], Any] = make_dict_structure_fn(cls, conv, _cattrs_forbid_extra_keys=True)

        def structure_attrs(v: Any, t: type) -> Any:
            if not isinstance(v, Mapping):
                raise TypeError(f"expected an object, got {_show(v)}")
            return inner(v, t)

        return structure_attrs

    conv.register_structure_hook_factory(attrs.has, _attrs_factory)

    conv.register_structure_hook_func(lambda t: isinstance(t, type) and issubclass(t, enum.Enum), _enum)
    conv.register_unstructure_hook_func(lambda t: isinstance(t, type) and issubclass(t, enum.Enum), lambda e: e.value)
    configure_tagged_union(ModalPart, conv, tag_name="type", tag_generator=_part_tag)
    return conv


def _part_tag(cls: type) -> str:
    return str(attrs.fields_dict(cls)["type"].default)


converter = make_converter()


# --------------------------------------------------------------------------------------------
# Error translation
# --------------------------------------------------------------------------------------------


def _first_error(exc: BaseException, path: list[str]) -> tuple[str, str]:
    """Walk a cattrs exception group to the first leaf error; return (dotted path, message)."""
    if isinstance(exc, ForbiddenExtraKeysError):
        keys = ", ".join(sorted(exc.extra_fields))
        p = ".".join(path)
        first = sorted(exc.extra_fields)[0]
        return (f"{p}.{first}" if p else first), f"unknown key{'s' if len(exc.extra_fields) > 1 else ''} ({keys})"
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        for sub in exc.exceptions:
            note = _note_of(sub)
            return _first_error(sub, path + ([note] if note else []))
    if isinstance(exc, KeyError):
        name = str(exc.args[0]) if exc.args else "?"
        return ".".join(path), f"missing required field {name!r}" if not path else "missing required field"
    msg = str(exc) or type(exc).__name__
    literal = _LITERAL_ERROR.match(msg)
    if literal:  # cattrs: "gif not in literal typing.Literal['mp4', 'png']"
        return ".".join(path), f"must be one of {literal.group(2)}, got {literal.group(1)!r}"
    return ".".join(path), msg


_LITERAL_ERROR = re.compile(r"^(.*) not in literal typing\.Literal\[(.*)\]$")


def _note_of(exc: BaseException) -> str | None:
    for note in getattr(exc, "__notes__", []) or []:
        # cattrs notes look like: "Structuring class X @ attribute y" / "@ index 2" / "@ key 'k'"
        if hasattr(note, "name"):
            return str(note.name)
        if hasattr(note, "index"):
            return str(note.index)
        s = str(note)
        if "@ attribute " in s:
            return s.rsplit("@ attribute ", 1)[1].strip()
        if "@ index " in s:
            return s.rsplit("@ index ", 1)[1].strip()
        if "@ key " in s:
            return s.rsplit("@ key ", 1)[1].strip().strip("'\"")
    return None


def structure(data: Any, cls: type[T], path: str = "") -> T:
    """Structure ``data`` into ``cls`` or raise :class:`RequestError` naming the dotted path."""
    base = [path] if path else []
    if attrs.has(cls) and not isinstance(data, Mapping):
        raise RequestError(path, f"expected an object, got {_show(data)}")
    try:
        obj = converter.structure(data, cls)
    except (ClassValidationError, IterableValidationError, ForbiddenExtraKeysError) as exc:
        p, msg = _first_error(exc, base)
        raise RequestError(p, msg) from None
    except (TypeError, ValueError, KeyError) as exc:
        p, msg = _first_error(exc, base)
        raise RequestError(p, msg) from None
    check_ranges(obj, path)
    return obj


def check_ranges(obj: Any, path: str = "") -> None:
    """Apply ``ge``/``gt``/``le``/``lt``/``choices`` field metadata recursively."""
    if not attrs.has(type(obj)):
        return
    for f in attrs.fields(type(obj)):
        v = getattr(obj, f.name)
        p = f"{path}.{f.name}" if path else f.name
        md = f.metadata
        if v is not None and md:
            if "ge" in md and v < md["ge"]:
                raise RequestError(p, f"must be >= {md['ge']}, got {v!r}")
            if "gt" in md and v <= md["gt"]:
                raise RequestError(p, f"must be > {md['gt']}, got {v!r}")
            if "le" in md and v > md["le"]:
                raise RequestError(p, f"must be <= {md['le']}, got {v!r}")
            if "lt" in md and v >= md["lt"]:
                raise RequestError(p, f"must be < {md['lt']}, got {v!r}")
            if "choices" in md and v not in md["choices"]:
                raise RequestError(p, f"must be one of {', '.join(map(repr, md['choices']))}, got {v!r}")
        if attrs.has(type(v)):
            check_ranges(v, p)
        elif isinstance(v, list):
            for i, item in enumerate(v):
                check_ranges(item, f"{p}.{i}")


def check_regex(_inst: object, attr: Any, value: str | None) -> None:
    """attrs field validator: ``value`` is ``None`` or a valid regular expression.

    Use as ``field(default=None, validator=check_regex)``; a bad pattern raises ``ValueError``
    naming the field, which :func:`structure` reports at the field's dotted path."""
    if value is not None:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"{attr.name}: invalid regular expression {value!r}: {exc}") from None


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def request_from_dict(data: Mapping[str, Any]) -> OmniRequest:
    """Turn a JSON-like dict into a validated :class:`OmniRequest`.

    Accepts two conveniences on top of the canonical form: ``prompt`` and ``negative_prompt``
    top-level strings become ``TextPart`` inputs.
    """
    if not isinstance(data, Mapping):
        raise RequestError("", f"a request must be a JSON object, got {_show(data)}")
    d = dict(data)
    if "task" not in d:
        raise RequestError("task", "missing required field (declare the task, e.g. \"t2v\")")
    inputs = list(d.get("inputs", []) or [])
    for role in ("prompt", "negative_prompt"):
        if role in d:
            text = d.pop(role)
            if not isinstance(text, str):
                raise RequestError(role, f"expected a string, got {_show(text)}")
            inputs.append({"type": "text", "text": text, "role": role})
    if not isinstance(inputs, list):
        raise RequestError("inputs", f"expected a list of input parts, got {_show(inputs)}")
    tags = [_part_tag(c) for c in MODAL_PART_TYPES]
    for i, part in enumerate(inputs):
        if not isinstance(part, Mapping):
            raise RequestError(f"inputs.{i}", f"expected an object, got {_show(part)}")
        if part.get("type") not in tags:
            raise RequestError(
                f"inputs.{i}.type", f"unknown input type {part.get('type')!r}; expected one of {', '.join(tags)}"
            )
    if inputs:
        d["inputs"] = inputs
    req = structure(d, OmniRequest)
    _check_request(req)
    return req


def _check_request(req: OmniRequest) -> None:
    for i, part in enumerate(req.inputs):
        if isinstance(part, ImagePart):
            if (part.path is None) == (part.data_b64 is None):
                raise RequestError(f"inputs.{i}", "an image part needs exactly one of path or data_b64")
    for name, params in req.node_params.items():
        if not isinstance(params, Mapping):
            raise RequestError(f"node_params.{name}", "expected an object of parameters")
    for name, params in req.plugin_params.items():
        if not isinstance(params, Mapping):
            raise RequestError(f"plugin_params.{name}", "expected an object of parameters")


def request_to_dict(req: OmniRequest) -> dict[str, Any]:
    return typing.cast(dict[str, Any], converter.unstructure(req))


def structure_params(cls: type[T], data: Mapping[str, Any] | None, path: str) -> T:
    """Validate a parameter dict against an attrs schema (``None`` → all defaults)."""
    return structure(dict(data or {}), cls, path)


def output_to_dict(out: OmniOutput) -> dict[str, Any]:
    """A JSON-safe summary of an output (artifact shapes, not tensors)."""
    arts = {}
    for name, art in out.artifacts.items():
        describe = getattr(art, "describe", None)
        arts[name] = describe() if describe else {"type": type(art).__name__}
    return {
        "request_id": out.request_id,
        "status": out.status.value,
        "artifacts": arts,
        "metrics": _jsonable(out.metrics),
        "error": attrs.asdict(out.error) if isinstance(out.error, ErrorInfo) else None,
    }


def event_to_dict(ev: OmniEvent) -> dict[str, Any]:
    d: dict[str, Any] = {
        "request_id": ev.request_id,
        "kind": ev.kind.value,
        "node": ev.node,
        "step": ev.step,
        "total": ev.total,
        "message": ev.message,
        "artifact": ev.artifact,
    }
    if ev.output is not None:
        d["output"] = output_to_dict(ev.output)
    return {k: v for k, v in d.items() if v is not None}


def _jsonable(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if isinstance(v, enum.Enum):
        return v.value
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


__all__ = [
    "MODAL_PART_TYPES",
    "check_ranges",
    "check_regex",
    "converter",
    "event_to_dict",
    "output_to_dict",
    "request_from_dict",
    "request_to_dict",
    "structure",
    "structure_params",
]
