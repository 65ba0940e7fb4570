"""The server's OpenAPI 3.1 document (``GET /openapi.json``) and a docs page (``GET /docs``).

Generated, not written: every request body's schema is :func:`omniloop_io.jsonschema.json_schema` of
its attrs class in :mod:`.body_schema` — the classes the server validates bodies with (through the
core's converter), whose ``omniloop`` object is generated from ``OmniRequest`` and whose aliases
(``steps`` → ``diffusion.steps``) carry their target's ranges. ``OmniRequest`` and its parts are
:func:`omniloop_io.jsonschema.request_schema`. A field validated and not documented, or documented and
not validated, cannot happen: both come from the same class (``tests/server/test_server_openapi.py``).
"""

from __future__ import annotations

import html
import json
from typing import Any

import attrs

from omniloop_io.jsonschema import json_schema, request_schema

from .audio import audio_paths, audio_schemas
from .body_schema import BODY_CLASSES

OPENAPI_VERSION = "3.1.0"

_STR = {"type": "string"}
_INT = {"type": "integer"}

#: body schema name -> the set of its fields (from the classes)
BODIES: dict[str, frozenset[str]] = {name: frozenset(f.name for f in attrs.fields(cls)) for name, cls in BODY_CLASSES.items()}


def _rebase(node: Any) -> Any:
    """``#/$defs/X`` → ``#/components/schemas/X`` throughout."""
    if isinstance(node, dict):
        return {k: (v.replace("#/$defs/", "#/components/schemas/") if k == "$ref" and isinstance(v, str) else _rebase(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase(v) for v in node]
    return node


def schemas() -> dict[str, Any]:
    """``components.schemas``: the request's classes, the ``omniloop`` object, bodies and replies."""
    req = request_schema()
    out: dict[str, Any] = {name: _rebase(s) for name, s in req["$defs"].items()}
    out["OmniRequest"] = {k: _rebase(v) for k, v in req.items() if k not in ("$defs", "$schema")}
    for name, cls in BODY_CLASSES.items():
        defs: dict[str, Any] = {}
        body = _rebase(json_schema(cls, defs=defs))
        for dname, d in defs.items():  # Omniloop, and the request classes it holds (generated alike)
            d = _rebase(d)
            if out.setdefault(dname, d) != d:
                raise AssertionError(f"two different schemas named {dname}")  # never expected
        out[name] = body
    out["Error"] = {
        "type": "object", "required": ["error"],
        "properties": {
            "error": {"type": "object", "required": ["message", "type"],
                      "properties": {"message": _STR, "type": _STR, "param": {"type": ["string", "null"]},
                                     "code": {"type": ["string", "null"]}}},
            "detail": {"type": "array", "items": {"type": "object"}},
        },
    }
    out["Video"] = {
        "type": "object", "required": ["id", "object", "status"],
        "properties": {"id": _STR, "object": {"enum": ["video"]}, "model": _STR,
                       "status": {"enum": ["queued", "in_progress", "completed", "failed", "cancelled"]},
                       "progress": {"type": "integer", "minimum": 0, "maximum": 100},
                       "created_at": _INT, "completed_at": {"type": ["integer", "null"]},
                       "error": {"anyOf": [{"type": "object"}, {"type": "null"}]}},
    }
    out["VideoList"] = {"type": "object", "required": ["object", "data"],
                        "properties": {"object": {"enum": ["list"]},
                                       "data": {"type": "array", "items": {"$ref": "#/components/schemas/Video"}}}}
    out["VideoDeleted"] = {"type": "object", "required": ["id", "object", "deleted"],
                           "properties": {"id": _STR, "object": {"enum": ["video.deleted"]}, "deleted": {"type": "boolean"}}}
    out["ImagesResponse"] = {"type": "object", "required": ["data"],
                             "properties": {"created": _INT, "data": {"type": "array", "items": {
                                 "type": "object", "properties": {"b64_json": _STR, "url": _STR}}}}}
    out["Model"] = {"type": "object", "required": ["id", "object"],
                    "properties": {"id": _STR, "object": {"enum": ["model"]}, "owned_by": _STR, "created": _INT}}
    out["ModelList"] = {"type": "object", "required": ["object", "data"],
                        "properties": {"object": {"enum": ["list"]},
                                       "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}}}}
    out.update(audio_schemas())
    out["Completion"] = {"type": "object", "required": ["id", "object"],
                         "properties": {"id": _STR, "object": _STR, "choices": {"type": "array"}, "usage": {"type": "object"}}}
    return out


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str, description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


_ERRORS = {"default": {"description": "An error in OpenAI's shape (400 bad body, 404 unknown id, 409 conflict, "
                                       "413 too large, 415 media type, 422 invalid field, 429 queue full, "
                                       "503 shutting down)", "content": {"application/json": {"schema": _ref("Error")}}}}


def _body(name: str, multipart: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": _ref(name)}}
    if multipart:
        content["multipart/form-data"] = {"schema": {"type": "object", "description":
                                                     f"{name} as form fields (bracketed keys nest; files upload images)"}}
    return {"required": True, "content": content}


def _id_param(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def openapi_document(*, title: str = "omniloop", version: str = "0.1.0") -> dict[str, Any]:
    """The whole OpenAPI 3.1 document."""
    vid = [_id_param("video_id")]
    paths: dict[str, Any] = {
        "/v1/videos": {
            "post": {"operationId": "createVideo", "summary": "Create a video job (t2v, or i2v with input_reference)",
                     "requestBody": _body("VideoCreate", multipart=True),
                     "responses": {"200": _json("Video", "The queued job"), **_ERRORS}},
            "get": {"operationId": "listVideos", "summary": "List video jobs",
                    "parameters": [{"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1}},
                                   {"name": "after", "in": "query", "schema": _STR},
                                   {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}}],
                    "responses": {"200": _json("VideoList"), **_ERRORS}},
        },
        "/v1/videos/{video_id}": {
            "get": {"operationId": "getVideo", "parameters": vid, "responses": {"200": _json("Video"), **_ERRORS}},
            "delete": {"operationId": "deleteVideo", "parameters": vid,
                       "responses": {"200": _json("VideoDeleted"), **_ERRORS}},
        },
        "/v1/videos/{video_id}/cancel": {
            "post": {"operationId": "cancelVideo", "parameters": vid, "responses": {"200": _json("Video"), **_ERRORS}}},
        "/v1/videos/{video_id}/content": {
            "get": {"operationId": "getVideoContent",
                    "parameters": [*vid, {"name": "variant", "in": "query",
                                          "schema": {"enum": ["video", "thumbnail", "spritesheet"]}}],
                    "responses": {"200": {"description": "The file", "content": {
                        "video/mp4": {"schema": {"type": "string", "format": "binary"}},
                        "image/png": {"schema": {"type": "string", "format": "binary"}}}}, **_ERRORS}}},
        "/v1/videos/{video_id}/events": {
            "get": {"operationId": "videoEvents", "parameters": vid,
                    "responses": {"200": {"description": "Server-sent progress events",
                                          "content": {"text/event-stream": {"schema": _STR}}}, **_ERRORS}}},
        "/v1/videos/stream": {
            "get": {"operationId": "streamVideo", "x-websocket": True,
                    "summary": "WebSocket: a video streamed chunk by chunk (causal Wan), with session continue",
                    "description": "Upgrade to a WebSocket. The client sends {type: start, ...VideoCreate fields}; "
                                   "the server sends accepted, progress, chunk (JSON metadata {chunk, first_frame, "
                                   "frames, height, width, fps, format: rgb24}, then one binary message of "
                                   "frames*height*width*3 uint8 bytes) and done messages; the client may then send "
                                   "{type: continue, prompt} (same session), {type: cancel} or {type: close}. A bad "
                                   "message: {type: error, error: Error} then close (1008). See omniloop_server.ws.",
                    "responses": {"101": {"description": "Switching protocols (WebSocket)"}, **_ERRORS}}},
        "/v1/images/generations": {
            "post": {"operationId": "createImage", "requestBody": _body("ImageCreate"),
                     "responses": {"200": _json("ImagesResponse"), **_ERRORS}}},
        "/v1/images/edits": {
            "post": {"operationId": "editImage", "requestBody": _body("ImageEdit", multipart=True),
                     "responses": {"200": _json("ImagesResponse"), **_ERRORS}}},
        "/v1/images/files/{name}": {
            "get": {"operationId": "getImageFile", "summary": "An image made with response_format 'url'",
                    "parameters": [_id_param("name")],
                    "responses": {"200": {"description": "The png", "content": {
                        "image/png": {"schema": {"type": "string", "format": "binary"}}}}, **_ERRORS}}},
        **audio_paths(),
        "/openapi.json": {"get": {"operationId": "openapi", "responses": {
            "200": {"description": "This document", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        "/docs": {"get": {"operationId": "docs", "responses": {
            "200": {"description": "The docs page", "content": {"text/html": {"schema": _STR}}}}}},
        "/v1/chat/completions": {
            "post": {"operationId": "createChatCompletion", "requestBody": _body("ChatCompletionCreate"),
                     "responses": {"200": {"description": "A completion, or server-sent chunks with stream: true",
                                           "content": {"application/json": {"schema": _ref("Completion")},
                                                       "text/event-stream": {"schema": _STR}}}, **_ERRORS}}},
        "/v1/completions": {
            "post": {"operationId": "createCompletion", "requestBody": _body("CompletionCreate"),
                     "responses": {"200": {"description": "A completion, or server-sent chunks with stream: true",
                                           "content": {"application/json": {"schema": _ref("Completion")},
                                                       "text/event-stream": {"schema": _STR}}}, **_ERRORS}}},
        "/v1/models": {"get": {"operationId": "listModels", "responses": {"200": _json("ModelList"), **_ERRORS}}},
        "/v1/models/{model_id}": {"get": {"operationId": "getModel", "parameters": [_id_param("model_id")],
                                          "responses": {"200": _json("Model"), **_ERRORS}}},
        "/health": {"get": {"operationId": "health", "responses": {
            "200": {"description": "Serving", "content": {"application/json": {"schema": {"type": "object"}}}},
            "503": {"description": "Not serving", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        "/metrics": {"get": {"operationId": "metrics", "responses": {
            "200": {"description": "Prometheus text", "content": {"text/plain": {"schema": _STR}}}}}},
    }
    return {
        "openapi": OPENAPI_VERSION,
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-style endpoints of an omniloop deployment; every body's `omniloop` object "
                                "takes OmniRequest fields (generated from omniloop's request schema)."},
        "paths": paths,
        "components": {"schemas": schemas()},
    }


def docs_page(spec_url: str = "/openapi.json") -> str:
    """A self-contained docs page (no CDN: servers may run offline) listing the operations and schemas."""
    doc = openapi_document()
    rows = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            ref = body.get("$ref", "").rsplit("/", 1)[-1]
            link = f'<a href="#{html.escape(ref)}">{html.escape(ref)}</a>' if ref else ""
            rows.append(f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}</code></td>"
                        f"<td>{html.escape(op.get('summary', op.get('operationId', '')))}</td><td>{link}</td></tr>")
    schemas_html = "".join(
        f'<h3 id="{html.escape(n)}">{html.escape(n)}</h3><pre>{html.escape(json.dumps(s, indent=2))}</pre>'
        for n, s in doc["components"]["schemas"].items()
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>omniloop API</title>"
        "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}td{padding:.2em .8em}"
        "pre{background:#f4f4f4;padding:.5em;overflow:auto}</style></head><body>"
        f"<h1>omniloop API</h1><p>OpenAPI {OPENAPI_VERSION}: <a href='{html.escape(spec_url)}'>{html.escape(spec_url)}</a></p>"
        f"<table><tr><th>method</th><th>path</th><th>what</th><th>body</th></tr>{''.join(rows)}</table>"
        f"<h2>Schemas</h2>{schemas_html}</body></html>"
    )


__all__ = ["BODIES", "OPENAPI_VERSION", "docs_page", "openapi_document", "schemas"]
