"""Issue 15: the server serves OpenAPI 3.1 at /openapi.json (generated from the request schema's
attrs classes and the body field sets) and a docs page at /docs; one source of truth for fields.

The property-based fuzz driven by this document is in test_server_hostile.py (>= 1,000 cases)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from omniloop.errors import RequestError
from omniloop_io.jsonschema import json_schema, request_schema
from omniloop_server.bodies import IMAGE_FIELDS, OMNILOOP_FIELDS, VIDEO_FIELDS
from omniloop_server.body_schema import BODY_CLASSES, parse_body
from omniloop_server.chat import CHAT_FIELDS, COMPLETION_FIELDS
from omniloop_server.images import EDIT_FIELDS
from omniloop_server.openapi import BODIES, openapi_document


@pytest.fixture(scope="module")
def served_app(server_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from omniloop_scheduler.testing import make_runtime
    from omniloop_server import create_app

    rt = make_runtime(server_checkpoint, scheduler="step")
    return create_app(rt, output_dir=tmp_path_factory.mktemp("out"), shutdown_timeout=0)


@pytest.fixture(scope="module")
def served(served_app: Any) -> Iterator[str]:
    from omniloop_server.testing import serving

    with serving(served_app) as url:
        yield url


def test_openapi_json_is_served_and_is_valid_openapi_3_1(served: str) -> None:
    doc = httpx.get(f"{served}/openapi.json").json()
    assert doc["openapi"] == "3.1.0" and doc == json.loads(json.dumps(openapi_document()))
    validator = pytest.importorskip("openapi_spec_validator", reason="the full validator is optional")
    validator.validate(doc)


def test_every_ref_resolves_and_every_operation_documents_its_errors() -> None:
    doc = openapi_document()
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    names = set(doc["components"]["schemas"])
    assert refs and all(r.startswith("#/components/schemas/") and r.rsplit("/", 1)[1] in names for r in refs)
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert ("101" if op.get("x-websocket") else "200") in op["responses"], (path, method)
            if path not in ("/health", "/metrics", "/openapi.json", "/docs"):
                assert op["responses"]["default"]["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/Error"}


def test_docs_page(served: str) -> None:
    r = httpx.get(f"{served}/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/videos" in r.text and "/openapi.json" in r.text and "VideoCreate" in r.text


# -- one source of truth: a field in one view and not another fails here ---------------------------
def test_the_omniloop_object_is_the_request_schema() -> None:
    doc = openapi_document()
    req = request_schema()
    comp = doc["components"]["schemas"]
    assert OMNILOOP_FIELDS <= set(req["properties"]), sorted(OMNILOOP_FIELDS - set(req["properties"]))
    assert set(comp["Omniloop"]["properties"]) == OMNILOOP_FIELDS
    for name in req["$defs"]:  # DiffusionParams, SamplingParams, input parts ... as generated
        assert json.dumps(comp[name]).replace("#/components/schemas/", "#/$defs/") == json.dumps(req["$defs"][name])
    assert set(comp["OmniRequest"]["properties"]) == set(req["properties"])


def test_every_body_is_documented_by_the_class_it_is_validated_with() -> None:
    comp = openapi_document()["components"]["schemas"]
    assert set(BODIES) == set(BODY_CLASSES)
    for name, cls in BODY_CLASSES.items():
        assert json.dumps(comp[name]) == json.dumps(json_schema(cls, defs={})).replace("#/$defs/", "#/components/schemas/")
        assert set(comp[name]["properties"]) == set(BODIES[name])
    # the endpoints' field sets are the classes' fields
    assert VIDEO_FIELDS == BODIES["VideoCreate"] and IMAGE_FIELDS == BODIES["ImageCreate"]
    assert EDIT_FIELDS == BODIES["ImageEdit"]
    assert CHAT_FIELDS == BODIES["ChatCompletionCreate"] and COMPLETION_FIELDS == BODIES["CompletionCreate"]
    # the omniloop object carries each OmniRequest field's own schema (nullable: null = not given)
    req = request_schema()["properties"]
    for field, prop in comp["Omniloop"]["properties"].items():
        if field == "request_id":  # this server's job names are narrower: 1-64 characters
            assert prop["anyOf"][0]["maxLength"] == 64
            continue
        want = {k: v for k, v in req[field].items() if k not in ("default", "description")}
        if {"type": "null"} in want.get("anyOf", []):  # an optional OmniRequest field (audio): its schema as is
            inner = json.dumps({k: v for k, v in prop.items() if k not in ("default", "description")})
        else:
            inner = json.dumps(prop["anyOf"][0])
        assert json.loads(inner.replace("#/components/schemas/", "#/$defs/")) == want, field


@pytest.mark.parametrize(("name", "field", "value"), [
    ("VideoCreate", "steps", 0), ("VideoCreate", "fps", 1e-300), ("VideoCreate", "seed", -1),
    ("VideoCreate", "priority", 101), ("VideoCreate", "size", "big"), ("ImageCreate", "n", 11),
    ("ImageCreate", "response_format", "gif"), ("ImageEdit", "strength", 0),
    ("ChatCompletionCreate", "temperature", -1), ("ChatCompletionCreate", "top_p", 0),
    ("CompletionCreate", "top_k", -1), ("CompletionCreate", "max_tokens", 0),
])
def test_a_value_the_schema_excludes_is_refused_by_the_validation(name: str, field: str, value: Any) -> None:
    """The document's constraint and the validation's refusal are the same rule (one class)."""
    comp = openapi_document()["components"]["schemas"]
    prop = comp[name]["properties"][field]
    inner = prop["anyOf"][0] if "anyOf" in prop else prop
    assert inner.keys() & {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern", "enum"}, prop
    base = {"ImageEdit": {"prompt": "x", "image": "x"}, "ChatCompletionCreate": {"messages": []}}.get(name, {"prompt": "x"})
    with pytest.raises(RequestError) as err:
        parse_body({**base, field: value}, BODY_CLASSES[name])
    assert err.value.path == field


def test_every_route_of_the_app_is_documented(served_app: Any) -> None:
    from starlette.routing import Route, WebSocketRoute

    doc = openapi_document()
    routes = {(r.path, m.lower()) for r in served_app.routes if isinstance(r, Route) for m in (r.methods or ())
              if m != "HEAD"}
    routes |= {(r.path, "get") for r in served_app.routes if isinstance(r, WebSocketRoute)}  # the upgrade is a GET
    documented = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented, sorted(routes ^ documented)


def _allows(schema: dict[str, Any], comp: dict[str, Any], value: Any) -> bool:
    """Whether ``value`` (a default: None or a scalar) may stand where ``schema`` is (the keywords used)."""
    if "$ref" in schema:
        return _allows(comp[schema["$ref"].rsplit("/", 1)[1]], comp, value)
    if "anyOf" in schema or "oneOf" in schema:
        return any(_allows(s, comp, value) for s in schema.get("anyOf", schema.get("oneOf", [])))
    if "enum" in schema:
        return value in schema["enum"]
    t = schema.get("type")
    kinds = {"null": type(None), "boolean": bool, "integer": int, "number": (int, float), "string": str,
             "array": list, "object": dict}
    return t is None or any(isinstance(value, kinds[k]) for k in (t if isinstance(t, list) else [t]))


def test_every_default_is_valid_under_its_own_schema() -> None:
    """OpenAPI 3.1 validators check defaults (openapi-spec-validator refused a `seconds` default of
    null once); this checks it without the optional validator installed."""
    comp = openapi_document()["components"]["schemas"]
    bad = [(name, field) for name, s in comp.items() for field, prop in (s.get("properties") or {}).items()
           if "default" in prop and not _allows({k: v for k, v in prop.items() if k != "default"}, comp, prop["default"])]
    assert not bad, bad
