"""One cattrs converter for the request plane, with strict types and dotted-path errors.

* ``request_from_dict`` / ``request_to_dict`` — JSON round trip of :class:`OmniRequest`;
  ``as_request`` / ``validate_request`` — the same rules for an ``OmniRequest`` built in Python
  (``Runtime.prepare`` and ``Deployment.check`` call ``as_request`` on entry).
* ``structure_params(cls, data, path)`` — validate a plugin's or node's parameter dict against
  its attrs schema; ``check_regex`` is a field validator for regex-valued options.
* Errors: unknown keys, wrong types and out-of-range values raise :class:`RequestError` whose
  ``path`` is the dotted field path (``diffusion.steps``, ``inputs.0.text``).

Strictness: ``"5"`` is not an int and ``1`` is not a bool. Ranges come from attrs field metadata
(``ge``, ``gt``, ``le``, ``lt``, ``choices``, and for strings ``pattern``/``max_len``; ``check``: a
callable returning a message for a value of the wrong shape, e.g. a window ``[start, end)``;
``range_hint``/``pattern_hint``: the message for a failed range/pattern).

Refused by the converter itself, for every schema it structures (requests, deploy files, plugin
and node params), so no field can forget it:

* non-finite numbers (NaN, ±Infinity, and JSON's ``1e999``, which parses to infinity), also inside
  free-form ``Any`` values such as ``options`` or a plugin's ``dict`` params;
* integers outside 64 bits (a 5,000-digit seed), reported without printing the number;
* strings that are not valid Unicode (a lone surrogate such as ``"\\ud800"``) or hold a NUL;
* free-form values nested deeper than :data:`MAX_DEPTH` levels.

Error messages never echo a bad value whole: values are cut to a short prefix (:func:`brief`), and
:class:`~omniloop.errors.RequestError` caps its path and message as a backstop.
"""

from __future__ import annotations

import enum
import math
import operator
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError, IterableValidationNote
from cattrs.gen import make_dict_structure_fn, make_mapping_structure_fn
from cattrs.strategies import configure_tagged_union

from .errors import DeployError, RequestError
from .request import (
    MODAL_PART_TYPES,
    AdapterRef,
    ErrorInfo,
    ImagePart,
    ModalPart,
    OmniEvent,
    OmniOutput,
    OmniRequest,
)

T = TypeVar("T")


#: integers must fit in 64 bits (signed): seeds, sizes and counts all do
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
#: how deep free-form values (``Any``: options, plugin params given as dicts) may nest
MAX_DEPTH = 32
#: how many characters of a bad value an error message shows
SHOW_CHARS = 40


def _strict_int(v: Any, cls: Any) -> int:
    if cls is not int and isinstance(cls, type) and issubclass(cls, enum.Enum):
        return _enum(v, cls)  # type: ignore[return-value]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {brief(v)}")
    if not INT_MIN <= v <= INT_MAX:
        raise ValueError(f"integer out of range (must fit in 64 bits), got {brief(v)}")
    return v


def _strict_float(v: Any, _: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"expected a number, got {brief(v)}")
    try:
        f = float(v)
    except OverflowError:  # an int too large for a float
        raise ValueError(f"number out of range, got {brief(v)}") from None
    if not math.isfinite(f):
        raise ValueError(f"must be a finite number, got {brief(v)}")
    return f


def _strict_str(v: Any, cls: Any) -> str:
    if cls is not str and isinstance(cls, type) and issubclass(cls, enum.Enum):
        return _enum(v, cls)  # type: ignore[return-value]
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {brief(v)}")
    _check_text(v)
    return v


def _check_text(v: str) -> None:
    if "\x00" in v:
        raise ValueError(f"a string may not contain a NUL character, got {brief(v)}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"not valid Unicode (a lone surrogate), got {brief(v)}") from None


def _strict_bool(v: Any, _: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected true or false, got {brief(v)}")
    return v


def _free_form(v: Any, _: Any) -> Any:
    """``Any``-typed values pass through, once checked: finite numbers, valid text, bounded depth."""
    check_plain(v)
    return v


class PlainValueError(ValueError):
    """A bad value inside a free-form value; ``where`` is its dotted path inside it ("" at the top)."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(f"{message} (at {_clip(where, 80)})" if where else message)
        self.message, self.where = message, where


def check_plain(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise :class:`PlainValueError` (a ``ValueError``) if a JSON-like value holds a non-finite
    float, an int outside 64 bits, invalid text, or nests deeper than ``max_depth``."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        x, depth, where = stack.pop()
        if isinstance(x, bool) or x is None:
            continue
        if isinstance(x, float):
            if not math.isfinite(x):
                raise PlainValueError(f"must be a finite number, got {brief(x)}", where)
        elif isinstance(x, int):
            if not INT_MIN <= x <= INT_MAX:
                raise PlainValueError(f"integer out of range (must fit in 64 bits), got {brief(x)}", where)
        elif isinstance(x, str):
            try:
                _check_text(x)
            except ValueError as exc:
                raise PlainValueError(str(exc), where) from None
        elif isinstance(x, (Mapping, list, tuple)):
            if depth >= max_depth:
                raise PlainValueError(f"nested more than {max_depth} levels deep", where)
            items = x.items() if isinstance(x, Mapping) else enumerate(x)
            for k, y in items:
                sub = f"{where}.{k}" if where else str(k)
                if isinstance(k, str):
                    try:
                        _check_text(k)
                    except ValueError as exc:
                        raise PlainValueError(f"key: {exc}", where) from None
                stack.append((y, depth + 1, sub))


def _enum(v: Any, cls: type[enum.Enum]) -> enum.Enum:
    if isinstance(v, cls):
        return v
    try:
        return cls(v)
    except (ValueError, TypeError):
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown value {_short_repr(v)}; expected one of {choices}") from None


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: max(n - 3, 1)] + "..."


def _short_repr(v: Any, n: int = SHOW_CHARS) -> str:
    """``repr(v)`` cut to ``n`` characters, without ever building the repr of a huge value."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        digits = int(v.bit_length() * math.log10(2)) + 1
        return f"{'-' if v < 0 else ''}<a {digits}-digit number>"
    if isinstance(v, (str, bytes)):
        return _clip(repr(v[: n + 1]), n)
    if isinstance(v, (list, tuple, dict)) and len(v) > n:
        return f"<a {type(v).__name__} of {len(v)} items>"
    try:
        r = repr(v)
    except Exception:  # a repr that fails (e.g. a nested huge int)
        r = f"<{type(v).__name__}>"
    return _clip(r, n)


def brief(v: Any) -> str:
    """A bad value as error messages show it: its type and a short repr (``str 'abc'``)."""
    return f"{type(v).__name__} {_short_repr(v)}"


_show = brief


def make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    # singledispatch hooks also catch subclasses: str/int-based Enums are routed to _enum inside
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(Any, _free_form)

    def _attrs_factory(cls: type) -> Any:
        inner: Callable[[Any, Any], Any] = make_dict_structure_fn(cls, conv, _cattrs_forbid_extra_keys=True)

        def structure_attrs(v: Any, t: type) -> Any:
            if not isinstance(v, Mapping):
                raise TypeError(f"expected an object, got {_show(v)}")
            return inner(v, t)

        return structure_attrs

    conv.register_structure_hook_factory(attrs.has, _attrs_factory)

    def _is_dict(t: Any) -> bool:
        return t is dict or typing.get_origin(t) in (dict, Mapping)

    def _dict_factory(t: Any) -> Any:
        inner: Callable[[Any, Any], Any] | None = None if t is dict else make_mapping_structure_fn(t, conv)

        def structure_dict(v: Any, tt: Any) -> Any:
            if not isinstance(v, Mapping):
                raise TypeError(f"expected an object, got {brief(v)}")
            if inner is None:  # a bare ``dict``: free-form
                check_plain(v)
                return dict(v)
            return inner(v, tt)

        return structure_dict

    def _list_factory(t: Any) -> Any:
        args = typing.get_args(t)
        item_type = args[0] if args else Any

        def structure_list(v: Any, tt: Any) -> list[Any]:
            if not isinstance(v, (list, tuple)):  # a string is not a list of its characters
                raise TypeError(f"expected a list, got {brief(v)}")
            out = []
            for i, item in enumerate(v):
                try:
                    out.append(conv.structure(item, item_type))
                except Exception as exc:
                    exc.add_note(IterableValidationNote(f"Structuring {tt} @ index {i}", i, item_type))
                    raise IterableValidationError(f"While structuring {tt!r}", [exc], tt) from None
            return out

        return structure_list

    conv.register_structure_hook_factory(_is_dict, _dict_factory)
    def _is_list(t: Any) -> bool:
        return t is list or typing.get_origin(t) is list

    conv.register_structure_hook_factory(_is_list, _list_factory)

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
        extra = sorted(exc.extra_fields)
        keys = ", ".join(_clip(k, SHOW_CHARS) for k in extra[:10]) + (f", ... ({len(extra)} in all)" if len(extra) > 10 else "")
        p = ".".join(path)
        first = _clip(extra[0], SHOW_CHARS)
        cl = getattr(exc, "cl", None)
        known = [f.name for f in attrs.fields(cl)] if isinstance(cl, type) and attrs.has(cl) else []
        hint = f"; known: {', '.join(known)}" if known else ""
        return (f"{p}.{first}" if p else first), f"unknown key{'s' if len(extra) > 1 else ''} ({keys}){hint}"
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        for sub in exc.exceptions:
            note = _note_of(sub)
            return _first_error(sub, path + ([note] if note else []))
    if isinstance(exc, KeyError):
        name = str(exc.args[0]) if exc.args else "?"
        return ".".join(path), f"missing required field {name!r}" if not path else "missing required field"
    if isinstance(exc, PlainValueError):
        inner = [exc.where] if exc.where else []
        return ".".join(path + inner), exc.message
    msg = str(exc) or type(exc).__name__
    literal = _LITERAL_ERROR.match(msg)
    if literal:  # cattrs: "gif not in literal typing.Literal['mp4', 'png']"
        return ".".join(path), f"must be one of {literal.group(2)}, got {_short_repr(literal.group(1))}"
    return ".".join(path), msg


_LITERAL_ERROR = re.compile(r"^(.*) not in literal typing\.Literal\[(.*)\]$", re.DOTALL)


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
    except (TypeError, ValueError, KeyError, ArithmeticError) as exc:
        p, msg = _first_error(exc, base)
        raise RequestError(p, msg) from None
    except RecursionError:
        raise RequestError(path, f"nested too deeply (more than {MAX_DEPTH} levels)") from None
    check_ranges(obj, path)
    return obj


#: range metadata: (key, the rule as written, "the value breaks it")
_RANGES = (("ge", ">=", operator.lt), ("gt", ">", operator.le), ("le", "<=", operator.gt), ("lt", "<", operator.ge))


def check_ranges(obj: Any, path: str = "") -> None:
    """Apply ``ge``/``gt``/``le``/``lt``/``choices``/``pattern``/``max_len``/``check`` field metadata recursively."""
    if not attrs.has(type(obj)):
        return
    for f in attrs.fields(type(obj)):
        v = getattr(obj, f.name)
        p = f"{path}.{f.name}" if path else f.name
        md = f.metadata
        if v is not None and md:
            if isinstance(v, float) and not math.isfinite(v):  # objects built in Python skip the converter
                raise RequestError(p, f"must be a finite number, got {_short_repr(v)}")
            for key, op, bad in _RANGES:
                if key in md and bad(v, md[key]):
                    # range_hint: one message for a two-sided range ("must be between 1 and 10")
                    rule = md.get("range_hint") or f"must be {op} {md[key]}"
                    raise RequestError(p, f"{rule}, got {_short_repr(v)}")
            if "choices" in md and v not in md["choices"]:
                raise RequestError(p, f"must be one of {', '.join(map(repr, md['choices']))}, got {_short_repr(v)}")
            if "max_len" in md and len(v) > md["max_len"]:
                raise RequestError(p, f"must be at most {md['max_len']} characters, got {len(v)}")
            if "pattern" in md and not re.fullmatch(md["pattern"], v):
                hint = md.get("pattern_hint", f"must match {md['pattern']}")
                raise RequestError(p, f"{hint}, got {_short_repr(v)}")
            if "check" in md:  # a shape rule ranges cannot say: check(value) -> message or None
                try:
                    problem = md["check"](v)
                except (TypeError, ValueError, ArithmeticError) as exc:  # a check that chokes on the value
                    problem = f"invalid value {_short_repr(v)} ({type(exc).__name__})"
                if problem:
                    raise RequestError(p, str(problem))
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
    inputs = d.get("inputs", [])
    if inputs is None:
        inputs = []
    if not isinstance(inputs, list):
        raise RequestError("inputs", f"expected a list of input parts, got {_show(inputs)}")
    inputs = list(inputs)
    for role in ("prompt", "negative_prompt"):
        if role in d:
            text = d.pop(role)
            if not isinstance(text, str):
                raise RequestError(role, f"expected a string, got {_show(text)}")
            inputs.append({"type": "text", "text": text, "role": role})
    tags = [_part_tag(c) for c in MODAL_PART_TYPES]
    for i, part in enumerate(inputs):
        if not isinstance(part, Mapping):
            raise RequestError(f"inputs.{i}", f"expected an object, got {_show(part)}")
        if part.get("type") not in tags:
            raise RequestError(
                f"inputs.{i}.type", f"unknown input type {_short_repr(part.get('type'))}; expected one of {', '.join(tags)}"
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


_REQUEST_HINTS = typing.get_type_hints(OmniRequest)


def validate_request(req: OmniRequest) -> None:
    """Hold an :class:`OmniRequest` built in Python (which skipped the converter) to every rule
    :func:`request_from_dict` enforces — types, ranges, patterns (``request_id``), finite numbers,
    valid text, the image-part rule — by passing its JSON form through the converter: one rule set,
    the same :class:`RequestError` naming the dotted field (``diffusion.steps``) as the CLI and HTTP."""
    if not isinstance(req, OmniRequest):
        raise RequestError("", f"expected an OmniRequest or a JSON object, got {_show(req)}")
    for name, want in _REQUEST_HINTS.items():  # a nested field holding the wrong kind of object
        v = getattr(req, name)
        if isinstance(want, type) and attrs.has(want) and not isinstance(v, want):
            raise RequestError(name, f"expected {want.__name__}, got {_show(v)}")
    for name, kinds in (("inputs", MODAL_PART_TYPES), ("adapters", (AdapterRef,))):
        items = getattr(req, name)
        if not isinstance(items, (list, tuple)):
            raise RequestError(name, f"expected a list, got {_show(items)}")
        for i, item in enumerate(items):
            if not isinstance(item, kinds):
                names = ", ".join(k.__name__ for k in kinds)
                raise RequestError(f"{name}.{i}", f"expected {'one of ' if len(kinds) > 1 else ''}{names}, got {_show(item)}")
    try:
        data = request_to_dict(req)
    except Exception as exc:  # something in it the converter cannot even read back
        raise RequestError("", f"not a request the schema can read ({type(exc).__name__}: {_clip(str(exc), 200)})") from None
    request_from_dict(data)


def as_request(request: OmniRequest | Mapping[str, Any]) -> OmniRequest:
    """The entry check of every request (``Runtime.prepare``, ``Deployment.check``): a JSON-like
    dict through :func:`request_from_dict`, an ``OmniRequest`` object through :func:`validate_request`
    (returned as it is). Raises :class:`RequestError` naming the dotted field."""
    if isinstance(request, OmniRequest):
        validate_request(request)
        return request
    return request_from_dict(request)


def structure_params(cls: type[T], data: Mapping[str, Any] | None, path: str) -> T:
    """Validate a parameter dict against an attrs schema (``None`` → all defaults)."""
    return structure(dict(data or {}), cls, path)


def structure_config(cls: type[T], data: Mapping[str, Any] | T | None, path: str) -> T:
    """A plugin's config as ``cls``: an instance passes through with its ranges checked, a mapping
    is validated (``None`` → all defaults); a bad value raises :class:`RequestError` naming ``path``
    and the field."""
    if isinstance(data, cls):
        check_ranges(data, path)
        return data
    return structure_params(cls, data, path)  # type: ignore[arg-type]


def structure_deploy_section(cls: type[T], data: Mapping[str, Any] | T | None, path: str) -> T:
    """A deploy section (``server:``, ``scheduler_options:`` ...) as ``cls``: an instance passes
    through, a mapping is validated (``None`` → all defaults); a bad value is one
    :class:`~omniloop.errors.DeployError` naming ``path`` and the field."""
    if isinstance(data, cls):
        return data
    try:
        return structure_params(cls, data, path)  # type: ignore[arg-type]
    except RequestError as exc:
        raise DeployError(f"deploy config: {exc}") from None


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
        "metrics": jsonable(out.metrics),
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


def jsonable(v: Any) -> Any:
    """``v`` as JSON-safe values (mappings, lists, scalars; enums by value; other objects as a
    float when they convert, else their ``str``): what output metrics are reported as."""
    if isinstance(v, Mapping):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
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
    "PlainValueError",
    "as_request",
    "brief",
    "check_plain",
    "check_ranges",
    "check_regex",
    "converter",
    "event_to_dict",
    "jsonable",
    "output_to_dict",
    "request_from_dict",
    "request_to_dict",
    "structure",
    "structure_config",
    "structure_params",
    "validate_request",
]
