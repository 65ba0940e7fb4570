"""JSON Schema (2020-12, as OpenAPI 3.1 uses it) generated from the attrs classes of the schema
(omniloop-io; the core's ``omniloop.jsonschema`` until omniloop 0.2, issue 34).

One source of truth (PROPOSAL §6.6): :func:`request_schema` is derived from
:class:`~omniloop.request.OmniRequest` and the field metadata the converter enforces (``ge`` →
``minimum``, ``gt`` → ``exclusiveMinimum``, ``le``/``lt``, ``choices`` → ``enum``, ``max_len``,
``pattern``), so ``omniloop schema``, the server's ``/openapi.json`` and ``omniloop generate``'s
flags cannot drift from what :func:`omniloop.schema.request_from_dict` accepts. :func:`json_schema`
does the same for any params class (node params, plugin params, deploy configs).

Field metadata the schema reads besides the ranges: ``description``; ``json_schema`` — the
schema of a free-form (``Any``) field whose accepted shapes the converter checks with ``check``;
``json_schema_extra`` — keywords added to the generated schema for a rule a ``check`` enforces
(``{"minItems": 1}``).

Rules that are not expressible as a JSON Schema keyword (a ``check`` metadata callable, the
converter's refusal of non-finite numbers) are enforced by the converter only; the schema is a
description of the accepted shape, the converter the judge.
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

import attrs

from omniloop.request import MODAL_PART_TYPES, OmniRequest

DIALECT = "https://json-schema.org/draft/2020-12/schema"

#: request fields :func:`omniloop.schema.request_from_dict` accepts on top of the attrs fields
REQUEST_CONVENIENCES: dict[str, dict[str, Any]] = {
    "prompt": {"type": "string", "description": "Shorthand for a text input part with role 'prompt'."},
    "negative_prompt": {"type": "string", "description": "Shorthand for a text input part with role 'negative_prompt'."},
}


def json_schema(cls: type, *, defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON Schema of attrs class ``cls``. Nested attrs classes go to ``defs`` (``$defs``) and are
    referenced; without ``defs`` the result carries its own ``$defs``."""
    own = defs is None
    table: dict[str, Any] = {} if defs is None else defs
    out = _object(cls, table)
    if own and table:
        out = {**out, "$defs": table}
    return out


def request_schema() -> dict[str, Any]:
    """The JSON Schema of a request body as ``request_from_dict`` accepts it."""
    defs: dict[str, Any] = {}
    body = _object(OmniRequest, defs)
    body["properties"] = {**body["properties"], **REQUEST_CONVENIENCES}
    return {"$schema": DIALECT, "title": "OmniRequest", **body, "$defs": defs}


def _object(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in attrs.fields(cls):
        if "json_schema" in f.metadata:  # a free-form (Any) field that describes its accepted shapes
            prop = dict(f.metadata["json_schema"])
            if f.default is None and prop and not _allows_null(prop):  # its default must be valid too
                prop = {"anyOf": [prop, {"type": "null"}]}
        else:
            prop = _type(hints.get(f.name, Any), defs)
            extra = _constraints(f.metadata, prop)  # (applied inside anyOf for a nullable field)
            prop = {**prop, **extra}
        if "json_schema_extra" in f.metadata:  # keywords stating a rule a ``check`` enforces (minItems ...)
            target = prop["anyOf"][0] if "anyOf" in prop and _allows_null(prop) and "json_schema" not in f.metadata else prop
            target.update(f.metadata["json_schema_extra"])
        if f.metadata.get("description"):
            prop["description"] = f.metadata["description"]
        if f.default is attrs.NOTHING:
            required.append(f.name)
        elif not isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
            default = _jsonable(f.default)
            if default is not _SKIP:
                prop["default"] = default
        props[f.name] = prop
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = required
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    if doc:
        out["description"] = " ".join(doc.split())
    return out


def _allows_null(schema: Mapping[str, Any]) -> bool:
    t = schema.get("type")
    if t == "null" or (isinstance(t, list) and "null" in t):
        return True
    return any(_allows_null(s) for s in schema.get("anyOf", schema.get("oneOf", [])))


def _ref(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    name = cls.__name__
    if name not in defs:
        defs[name] = {}  # placeholder against recursion
        defs[name] = _object(cls, defs)
    return {"$ref": f"#/$defs/{name}"}


def _type(t: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if t is Any or t is object:
        return {}
    if t is type(None):
        return {"type": "null"}
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        nullable = len(members) < len(args)
        if set(members) == set(MODAL_PART_TYPES):
            inner: dict[str, Any] = {
                "oneOf": [_ref(m, defs) for m in members],
                "discriminator": {"propertyName": "type"},
            }
        elif len(members) == 1:
            inner = _type(members[0], defs)
        else:
            inner = {"anyOf": [_type(m, defs) for m in members]}
        return {"anyOf": [inner, {"type": "null"}]} if nullable else inner
    if origin is Literal:
        return {"enum": list(args)}
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return {"type": "string", "enum": [m.value for m in t]}
    if t is bool:
        return {"type": "boolean"}
    if t is int:
        return {"type": "integer"}
    if t is float:
        return {"type": "number"}
    if t is str:
        return {"type": "string"}
    if t is list or origin is list:
        return {"type": "array", "items": _type(args[0], defs) if args else {}}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type(args[0], defs)}
        return {"type": "array", "prefixItems": [_type(a, defs) for a in args], "minItems": len(args),
                "maxItems": len(args)}
    if t is dict or origin in (dict, Mapping):
        return {"type": "object", "additionalProperties": _type(args[1], defs) if len(args) == 2 else {}}
    if isinstance(t, type) and attrs.has(t):
        return _ref(t, defs)
    return {}


def _constraints(md: Mapping[str, Any], prop: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, word in (("ge", "minimum"), ("gt", "exclusiveMinimum"), ("le", "maximum"), ("lt", "exclusiveMaximum"),
                      ("max_len", "maxLength")):
        if key in md:
            out[word] = md[key]
    if "choices" in md:
        out["enum"] = list(md["choices"])
    if "pattern" in md:
        out["pattern"] = f"^(?:{md['pattern']})$"  # the converter matches the whole string
    if not out or "anyOf" not in prop:
        return out
    # a nullable field: the constraints apply to the non-null member
    inner, null = prop["anyOf"]
    prop["anyOf"] = [{**inner, **out}, null]
    return {}


_SKIP = object()


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return _SKIP


__all__ = ["DIALECT", "REQUEST_CONVENIENCES", "json_schema", "request_schema"]
