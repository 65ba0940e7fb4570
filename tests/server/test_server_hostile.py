"""Hostile-input property test (issue 14): >= 1,000 generated requests against a real uvicorn server
on 127.0.0.1 (toy family, CPU), bounded in time.

Bodies mix every accepted field name with hostile values (lone surrogates, huge and non-finite
numbers, deep nesting, paths into a sandbox folder as request ids and input parts, wrong types at
every level), in JSON, OpenAI's multipart form, raw/mangled bytes and wrong Content-Types, on
``POST /v1/videos``, ``POST /v1/images/generations`` and ``POST /v1/images/edits``; chat and
text-completion bodies on ``POST /v1/chat/completions`` / ``/v1/completions`` of a tiny Qwen
server (streamed answers are read to their end). The test fails on any 5xx, on any
request taking over 10 s (the client's timeout), on a connection the server drops, and on any
file created outside the output folder (a sandbox folder the bodies aim at, the working
directory, and the output folder's own listing are checked).

The deploy's limits keep every valid request tiny (<= 4 steps, 32x32, 5 frames), so generated
bodies that happen to be valid run real jobs quickly. ``OMNILOOP_HOSTILE_EXAMPLES`` raises the count.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("OMNILOOP_HOSTILE_EXAMPLES", "1100"))
REQUEST_TIMEOUT = 10.0
OUT_NAME = re.compile(r"^([0-9a-f]{32}(\.mp4|\.thumbnail\.png|\.spritesheet\.png|\.png)|jobs\.jsonl)$")


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()


@pytest.fixture(scope="module")
def hostile(server_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path, Any]]:
    from omniloop_scheduler.testing import make_runtime
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    root = tmp_path_factory.mktemp("hostile")
    out, sandbox, cwd = root / "out", root / "sandbox", root / "cwd"
    sandbox.mkdir()
    cwd.mkdir()
    rt = make_runtime(server_checkpoint, scheduler="step",
                      limits={"max_steps": 4, "max_frames": 5, "max_height": 32, "max_width": 32, "max_queue": 8})
    app = create_app(rt, output_dir=out, shutdown_timeout=0, max_finished_jobs=50)
    old, interval = os.getcwd(), sys.getswitchinterval()
    os.chdir(cwd)
    # client and server share this process: hand the GIL over faster than every 5 ms
    sys.setswitchinterval(0.0005)
    try:
        with serving(app) as url:
            yield url, out, sandbox, app
    finally:
        sys.setswitchinterval(interval)
        os.chdir(old)


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------

ALL_FIELDS = ["prompt", "negative_prompt", "model", "size", "steps", "num_inference_steps", "guidance_scale", "seed",
              "priority", "omniloop", "user", "seconds", "frames", "fps", "image", "input_reference", "n",
              "response_format", "quality", "style", "background", "output_format", "moderation", "strength", "mask"]
OMNI_FIELDS = ["diffusion", "sampling", "outputs", "node_params", "plugin_params", "exact", "priority", "request_id",
               "inputs", "negative_prompt", "task", "schema_version"]
DIFF_FIELDS = ["steps", "guidance_scale", "shift", "height", "width", "frames", "fps", "seed", "bogus"]


def path_strings(sandbox: Path) -> st.SearchStrategy[str]:
    s = str(sandbox)
    return st.sampled_from([
        f"{s}/x", f"{s}/a/b/c", "../sandbox/x", "../../sandbox/y", "../" * 8 + s.lstrip("/") + "/z", f"{s}/v\u0000",
        "../sandbox/p\u0000.mp4", "", ".", "..", "/", "a/b", "a\\b", "~/x", "%2e%2e/sandbox/q", f"file://{s}/w",
        "x" * 200, "CON", "nul", "-rf", ".hidden", "ok_id-1",
    ])


def hostile_strings(sandbox: Path) -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(max_size=20),
        st.text(alphabet=st.characters(exclude_categories=()), max_size=12),  # lone surrogates included
        st.sampled_from(["\ud800", "a\udfffb", "\u0000", "16x16", "32x32", "8x8", "0x0", "99999x99999", "16X16 ",
                         "-16x16", "1e308", "nan", "inf", "-1", "4", "8", "12", "0.0001", "1" * 400, "\ufeff{",
                         "toy", "ckpt", "wan-demo", "b64_json", "url", "png", "data:image/png;base64,AAAA",
                         "data:image/png;base64," + __import__("base64").b64encode(PNG).decode()]),
        path_strings(sandbox),
    )


def leaves(sandbox: Path) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(), st.booleans(),
        st.integers(min_value=-5, max_value=40),
        st.integers(),
        st.integers(min_value=-(2**80), max_value=2**80),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([1e308, -1e308, 1e-300, 5e-324, 0.0, -0.0, 2**63, 2**64, -(2**63) - 1]),
        hostile_strings(sandbox),
    )


def values(sandbox: Path) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves(sandbox),
        lambda ch: st.one_of(st.lists(ch, max_size=4),
                             st.dictionaries(st.one_of(st.sampled_from(ALL_FIELDS + OMNI_FIELDS + DIFF_FIELDS),
                                                       hostile_strings(sandbox)), ch, max_size=4)),
        max_leaves=8,
    )


def omniloop_objects(sandbox: Path) -> st.SearchStrategy[Any]:
    v = values(sandbox)
    part = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["image", "video", "audio", "latents", "text", "bogus"])},
                              optional={"path": path_strings(sandbox), "data_b64": st.one_of(hostile_strings(sandbox), v),
                                        "text": v, "role": v}),
        v,
    )
    diffusion = st.one_of(st.fixed_dictionaries({}, optional={k: v for k in DIFF_FIELDS}), v)
    return st.one_of(
        st.fixed_dictionaries({}, optional={
            "diffusion": diffusion, "request_id": st.one_of(path_strings(sandbox), v), "inputs": st.one_of(st.lists(part, max_size=3), v),
            "outputs": st.one_of(st.fixed_dictionaries({}, optional={"format": v, "return_latents": v, "stream_partial": v}), v),
            "plugin_params": v, "node_params": st.one_of(st.fixed_dictionaries({}, optional={"denoise": v}), v),
            "exact": v, "priority": v, "task": v, "sampling": v, "schema_version": v,
        }),
        v,
    )


def bodies(sandbox: Path) -> st.SearchStrategy[Any]:
    v = values(sandbox)
    small_int = st.one_of(st.integers(min_value=-2, max_value=12), v)
    fields = {
        "prompt": st.one_of(st.text(max_size=30), hostile_strings(sandbox), v),
        "negative_prompt": v, "model": st.one_of(st.sampled_from(["ckpt", "toy", "other"]), v),
        "size": st.one_of(st.sampled_from(["16x16", "32x32", "8x16", "12x12", "64x64", "0x0"]), v),
        "steps": small_int, "num_inference_steps": small_int, "seed": st.one_of(st.integers(), v),
        "guidance_scale": st.one_of(st.floats(), v), "priority": small_int, "frames": small_int,
        "seconds": st.one_of(st.sampled_from(["4", "0.25", "0.5", "1e308", "-1", "nan"]), st.floats(), v),
        "fps": st.one_of(st.floats(), v), "n": small_int, "omniloop": omniloop_objects(sandbox),
        "input_reference": st.one_of(hostile_strings(sandbox), v), "image": v,
        "response_format": v, "output_format": v, "user": v, "extra": v,
        "strength": st.one_of(st.floats(), st.sampled_from(["0.5", "1", "0", "-1", "nan"]), v), "mask": v,
    }
    # a valid body with one field replaced or added (these get past parsing, into validation and jobs)
    valid = {"prompt": "a red fox", "steps": 2, "size": "16x16", "seed": 1}
    mutated = st.builds(lambda extra: {**valid, **extra},
                        st.dictionaries(st.sampled_from(sorted(fields)), st.deferred(lambda: st.one_of(*fields.values())),
                                        max_size=1))
    omni_id = st.builds(lambda rid: {**valid, "omniloop": {"request_id": rid}},
                        st.one_of(path_strings(sandbox), st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]{0,10}", fullmatch=True)))
    return st.one_of(st.fixed_dictionaries({}, optional=fields), v, mutated, omni_id)


def _multipart(fields: list[tuple[str, bytes, str | None]], boundary: str = "hyp0thes1s") -> tuple[bytes, str]:
    out = io.BytesIO()
    for name, data, filename in fields:
        out.write(f"--{boundary}\r\n".encode())
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out.write(f"Content-Disposition: {disp}\r\n".encode("utf-8", "surrogatepass"))
        if filename:
            out.write(b"Content-Type: image/png\r\n")
        out.write(b"\r\n" + data + b"\r\n")
    out.write(f"--{boundary}--\r\n".encode())
    return out.getvalue(), f"multipart/form-data; boundary={boundary}"


def _flatten(prefix: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _flatten(f"{prefix}[{k}]", v)]
    if isinstance(value, list):
        return [item for v in value for item in _flatten(f"{prefix}[]", v)]
    return [(prefix, value)]


def _text(v: Any) -> bytes:
    s = {True: "true", False: "false", None: ""}.get(v, v) if isinstance(v, (bool, type(None))) else str(v)
    return s.encode("utf-8", "surrogatepass")


FORM_PATHS = ("/v1/videos", "/v1/images/edits")
MEDIA_PATHS = ("/v1/videos", "/v1/videos", "/v1/videos", "/v1/images/generations", "/v1/images/edits")


@st.composite
def _requests(draw: Any, body_strategy: st.SearchStrategy[Any],
              paths: tuple[str, ...] = MEDIA_PATHS) -> tuple[str, bytes, str | None]:
    path = draw(st.sampled_from(paths))
    body = draw(body_strategy)
    how = draw(st.sampled_from(["json", "json", "json", "form", "raw", "ctype", "deep"]))
    if how == "json" or (how == "form" and (path not in FORM_PATHS or not isinstance(body, dict))):
        raw = json.dumps(body, ensure_ascii=draw(st.booleans()), allow_nan=True).encode("utf-8", "surrogatepass")
        return path, raw, draw(st.sampled_from(["application/json", "application/json; charset=utf-8"]))
    if how == "form":
        fields: list[tuple[str, bytes, str | None]] = []
        for k, v in body.items():
            if k in ("input_reference", "image", "mask") and draw(st.booleans()):
                fields.append((k, draw(st.sampled_from([PNG, b"", b"not an image", PNG[:40]])), "ref.png"))
                continue
            for name, leaf in _flatten(k, v):
                fields.append((name, _text(leaf), None))
        raw, ctype = _multipart(fields[:80])
        if draw(st.booleans()):
            cut = draw(st.integers(min_value=0, max_value=len(raw)))
            raw = raw[:cut]  # truncated forms
        return path, raw, ctype
    if how == "raw":
        raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
        mangled = draw(st.one_of(st.just(raw[: max(0, len(raw) - 1)]), st.binary(max_size=200),
                                 st.just(b"\xff\xfe" + raw), st.just(raw + b"garbage"), st.just(b"")))
        return path, mangled, "application/json"
    if how == "ctype":
        raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
        ctype = draw(st.sampled_from([None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                      "application/xml", "application/json-seq", "*/*", "multipart/form-data; boundary="]))
        return path, raw, ctype
    depth = draw(st.integers(min_value=30, max_value=3000))
    kind = draw(st.sampled_from(["list", "dict", "omni"]))
    if kind == "list":
        raw = ("[" * depth + "]" * depth).encode()
    elif kind == "dict":
        raw = ('{"a":' * depth + "1" + "}" * depth).encode()
    else:
        raw = ('{"prompt":"x","omniloop":{"diffusion":' + '{"a":' * depth + "1" + "}" * depth + "}}").encode()
    return path, raw, "application/json"


def requests(sandbox: Path) -> st.SearchStrategy[tuple[str, bytes, str | None]]:
    """(path, raw body, content type) — the ways a client can send a body (strategies built once)."""
    return _requests(bodies(sandbox))


# ---------------------------------------------------------------------------------------------
# the test
# ---------------------------------------------------------------------------------------------


def snapshot(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def test_hostile_bodies_never_get_5xx_hang_or_write_outside_the_output_folder(hostile: Any) -> None:
    url, out, sandbox, app = hostile
    root = out.parent
    before = snapshot(root) - snapshot(out)
    statuses: dict[int, int] = {}
    slowest = http_s = 0.0
    t_start = time.monotonic()

    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT) as client:

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(req=requests(sandbox))
        def run(req: tuple[str, bytes, str | None]) -> None:
            nonlocal slowest, http_s
            path, raw, ctype = req
            headers = {"content-type": ctype} if ctype is not None else {}
            t0 = time.monotonic()
            r = client.post(path, content=raw, headers=headers)
            dt = time.monotonic() - t0
            slowest = max(slowest, dt)
            http_s += dt
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (r.status_code, r.text[:500], raw[:300], ctype)
            assert dt < REQUEST_TIMEOUT
            if r.status_code >= 400:
                err = r.json()["error"]
                assert isinstance(err["message"], str) and err["type"]
                assert len(r.content) < 8000, len(r.content)
            else:
                assert r.json().get("object") == "video" or "data" in r.json()
            assert not any(sandbox.iterdir()), sorted(sandbox.rglob("*"))

        run()
        state = app.state.omniloop
        deadline = time.monotonic() + 30
        while state.jobs.in_flight() and time.monotonic() < deadline:  # let accepted jobs write their files
            time.sleep(0.05)
        assert not state.jobs.in_flight(), [j.to_dict() for j in state.jobs.in_flight()]
        health = client.get("/health")
        metrics = client.get("/metrics").text

    took = time.monotonic() - t_start
    total = sum(statuses.values())
    print(f"\nhostile: {total} requests in {took:.1f} s ({http_s:.1f} s in HTTP), slowest {slowest:.2f} s, statuses {sorted(statuses.items())}")
    assert total >= min(EXAMPLES, 1000), statuses
    assert health.status_code == 200
    assert 'omniloop_http_errors_total{code="500"}' not in metrics
    assert re.search(r"omniloop_http_unhandled_exceptions_total 0\b", metrics)
    # no file anywhere but in the output folder, and there only server-made names
    assert snapshot(root) - snapshot(out) == before
    assert not any(Path.cwd().iterdir()), sorted(Path.cwd().iterdir())
    assert not any(sandbox.iterdir())
    bad = [p.name for p in out.iterdir() if not OUT_NAME.match(p.name)]
    assert not bad, bad
    if statuses.get(200):
        assert state.jobs.written > 0  # accepted jobs ran and wrote their mp4s (inside the folder)


def test_hostile_ids_and_query_strings_on_the_other_endpoints(hostile: Any) -> None:
    """Path ids and query parameters a client controls: never a 5xx, never a file outside."""
    url, out, sandbox, _app = hostile
    from urllib.parse import quote

    seg = st.one_of(st.text(max_size=30), path_strings(sandbox), st.sampled_from(["..", "%2e%2e", "%00", "a%2Fb"]))
    query = st.dictionaries(st.sampled_from(["limit", "after", "order", "variant", "x"]),
                            st.one_of(st.text(max_size=20), st.sampled_from(["0", "-1", "101", "1e9", "asc", "thumbnail"])),
                            max_size=3)
    calls: list[int] = []

    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT) as client:

        @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(kind=st.sampled_from(["get", "content", "cancel", "delete", "list", "events", "model"]), vid=seg, q=query)
        def run(kind: str, vid: str, q: dict[str, str]) -> None:
            quoted = quote(vid.encode("utf-8", "surrogatepass"), safe="")
            params = {k: v.encode("utf-8", "surrogatepass").decode("utf-8", "replace") for k, v in q.items()}
            if kind == "list":
                r = client.get("/v1/videos", params=params)
            elif kind == "get":
                r = client.get(f"/v1/videos/{quoted}")
            elif kind == "content":
                r = client.get(f"/v1/videos/{quoted}/content", params=params)
            elif kind == "events":
                r = client.get(f"/v1/videos/{quoted}x/events")  # unknown ids only: a known one streams
            elif kind == "cancel":
                r = client.post(f"/v1/videos/{quoted}/cancel")
            elif kind == "model":
                r = client.get(f"/v1/models/{quoted}")
            else:
                r = client.delete(f"/v1/videos/{quoted}")
            calls.append(r.status_code)
            assert r.status_code < 500, (kind, vid, q, r.text[:300])
            assert not any(sandbox.iterdir())

        run()
    assert len(calls) >= 200
    assert not [p.name for p in out.iterdir() if not OUT_NAME.match(p.name)]


# ---------------------------------------------------------------------------------------------
# chat and text completions on a tiny Qwen server
# ---------------------------------------------------------------------------------------------

TEXT_EXAMPLES = int(os.environ.get("OMNILOOP_HOSTILE_TEXT_EXAMPLES", "400"))
TEXT_PATHS = ("/v1/chat/completions", "/v1/completions")


def text_bodies(sandbox: Path) -> st.SearchStrategy[Any]:
    v = values(sandbox)
    small = st.one_of(st.integers(min_value=-2, max_value=12), v)
    part = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "bogus"])},
                                           optional={"text": st.one_of(st.text(max_size=20), v), "image_url": v}), v)
    content = st.one_of(st.text(max_size=30), hostile_strings(sandbox), st.lists(part, max_size=3), v)
    roles = st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "bogus"]), v)
    message = st.one_of(st.fixed_dictionaries({"role": roles}, optional={
        "content": content, "name": v, "tool_calls": v, "tool_call_id": v, "extra": v}), v)
    fields = {
        "model": st.one_of(st.sampled_from(["tiny-qwen", "qwen", "other"]), v),
        "messages": st.one_of(st.lists(message, max_size=4), v),
        "prompt": st.one_of(st.text(max_size=30), st.lists(st.one_of(st.text(max_size=10), st.integers()), max_size=3), v),
        "max_tokens": small, "max_completion_tokens": small, "top_k": small, "n": small,
        "temperature": st.one_of(st.floats(), v), "top_p": st.one_of(st.floats(), v), "seed": st.one_of(st.integers(), v),
        "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20), v),
        "stream": st.one_of(st.booleans(), v),
        "stream_options": st.one_of(st.fixed_dictionaries({}, optional={"include_usage": st.one_of(st.booleans(), v),
                                                                         "bogus": v}), v),
        "frequency_penalty": st.one_of(st.floats(), v), "logprobs": v, "tools": v, "echo": v, "user": v, "bogus": v,
        "omniloop": omniloop_objects(sandbox),
    }
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
    plain = {"prompt": "hello", "max_tokens": 4}
    valid = st.sampled_from([chat, plain, {**chat, "stream": True, "stream_options": {"include_usage": True}},
                             {**plain, "stream": True}, {**chat, "stop": ["a", "e"], "seed": 3, "temperature": 0.9}])
    mutated = st.builds(lambda base, extra: {**base, **extra}, valid,
                        st.dictionaries(st.sampled_from(sorted(fields)), st.deferred(lambda: st.one_of(*fields.values())),
                                        max_size=1))
    return st.one_of(st.fixed_dictionaries({}, optional=fields), v, mutated, mutated, valid)


@pytest.fixture(scope="module")
def hostile_text(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Any]]:
    pytest.importorskip("transformers")
    pytest.importorskip("omniloop_qwen")
    import omniloop_qwen.plugin as qwen_plugin
    from omniloop_qwen.tiny import build_tiny_checkpoint
    from omniloop_scheduler.testing import make_runtime
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    root = tmp_path_factory.mktemp("hostile-text")
    ckpt = build_tiny_checkpoint(root / "tiny-qwen", arch="qwen2")
    sandbox = root / "sandbox"
    sandbox.mkdir()
    # a small KV pool: a valid request asking for many tokens is refused (422), so none runs long
    rt = make_runtime(ckpt, ("qwen", qwen_plugin), scheduler="step", options={"kv_cache_tokens": 128},
                      limits={"max_queue": 8})
    app = create_app(rt, output_dir=root / "out", shutdown_timeout=0)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        with serving(app) as url:
            yield url, sandbox, app
    finally:
        sys.setswitchinterval(interval)


def test_hostile_chat_and_completion_bodies(hostile_text: Any) -> None:
    url, sandbox, app = hostile_text
    statuses: dict[int, int] = {}
    streamed = 0
    t_start = time.monotonic()

    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT) as client:

        @settings(max_examples=TEXT_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(req=_requests(text_bodies(sandbox), TEXT_PATHS))
        def run(req: tuple[str, bytes, str | None]) -> None:
            nonlocal streamed
            path, raw, ctype = req
            headers = {"content-type": ctype} if ctype is not None else {}
            t0 = time.monotonic()
            r = client.post(path, content=raw, headers=headers)  # reads a streamed answer to its end
            assert time.monotonic() - t0 < REQUEST_TIMEOUT
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (r.status_code, r.text[:500], raw[:300], ctype)
            if r.status_code >= 400:
                err = r.json()["error"]
                assert isinstance(err["message"], str) and err["type"] and len(r.content) < 8000
            elif r.headers["content-type"].startswith("text/event-stream"):
                streamed += 1
                assert r.text.endswith("data: [DONE]\n\n"), r.text[-300:]
            else:
                assert r.json()["object"] in ("chat.completion", "text_completion")
            assert not any(sandbox.iterdir())

        run()
        engine = app.state.omniloop.engine
        deadline = time.monotonic() + 30
        while engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        health = client.get("/health")
        metrics = client.get("/metrics").text
    cache = engine.runtime.model.components["kv_cache"]
    total = sum(statuses.values())
    print(f"\nhostile text: {total} requests in {time.monotonic() - t_start:.1f} s, {streamed} streamed, "
          f"statuses {sorted(statuses.items())}")
    assert total >= TEXT_EXAMPLES * 0.9 and statuses.get(200), statuses
    assert health.status_code == 200
    assert re.search(r"omniloop_http_unhandled_exceptions_total 0\b", metrics)
    assert cache.used_blocks == 0 and cache.reserved_blocks == 0  # every sequence gave its KV blocks back


# ---------------------------------------------------------------------------------------------
# image edits on a tiny FLUX.1 server (the i2i path past the parsing)
# ---------------------------------------------------------------------------------------------

EDIT_EXAMPLES = int(os.environ.get("OMNILOOP_HOSTILE_EDIT_EXAMPLES", "150"))


@st.composite
def edit_requests(draw: Any, sandbox: Path) -> tuple[str, bytes, str | None]:
    import base64

    body: dict[str, Any] = {"prompt": "a red fox", "steps": 2, "size": "32x32", "seed": 1, "strength": 0.5}
    body.update(draw(st.dictionaries(st.sampled_from(ALL_FIELDS), values(sandbox), max_size=2)))
    image = draw(st.sampled_from([PNG, PNG, PNG, b"", b"not an image", PNG[:40]]))
    if draw(st.booleans()):  # multipart, the image as an uploaded file (or two, or image[])
        fields: list[tuple[str, bytes, str | None]] = []
        for k, v in body.items():
            if k in ("image", "mask"):
                continue
            fields.extend((name, _text(leaf), None) for name, leaf in _flatten(k, v))
        key = draw(st.sampled_from(["image", "image[]"]))
        fields += [(key, image, "in.png")] * draw(st.sampled_from([1, 1, 1, 2]))
        if draw(st.integers(0, 5)) == 0:
            fields.append(("mask", PNG, "mask.png"))
        raw, ctype = _multipart(fields[:80])
        return "/v1/images/edits", raw, ctype
    body.setdefault("image", "data:image/png;base64," + base64.b64encode(image).decode())
    return "/v1/images/edits", json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass"), "application/json"


def test_hostile_image_edits_on_an_i2i_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    pytest.importorskip("diffusers")
    pytest.importorskip("omniloop_flux")
    import omniloop_flux.plugin as flux_plugin
    from omniloop_flux.tiny import build_tiny_checkpoint
    from omniloop_scheduler.testing import make_runtime
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    root = tmp_path_factory.mktemp("hostile-edit")
    sandbox = root / "sandbox"
    sandbox.mkdir()
    ckpt = build_tiny_checkpoint(root / "tiny-flux")
    rt = make_runtime(ckpt, ("flux", flux_plugin), scheduler="step",
                      limits={"max_steps": 2, "max_height": 32, "max_width": 32, "max_queue": 16})
    app = create_app(rt, output_dir=root / "out", shutdown_timeout=0)
    statuses: dict[int, int] = {}
    with serving(app) as url, httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT) as client:

        @settings(max_examples=EDIT_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(req=edit_requests(sandbox))
        def run(req: tuple[str, bytes, str | None]) -> None:
            path, raw, ctype = req
            t0 = time.monotonic()
            r = client.post(path, content=raw, headers={"content-type": ctype} if ctype else {})
            assert time.monotonic() - t0 < REQUEST_TIMEOUT
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (r.status_code, r.text[:500], raw[:300])
            if r.status_code >= 400:
                assert isinstance(r.json()["error"]["message"], str)
            else:
                assert r.json()["data"][0]["b64_json"]
            assert not any(sandbox.iterdir())

        run()
        metrics = client.get("/metrics").text
    print(f"\nhostile edits: {sum(statuses.values())} requests, statuses {sorted(statuses.items())}")
    assert statuses.get(200) and sum(statuses.values()) >= EDIT_EXAMPLES * 0.9, statuses
    assert re.search(r"omniloop_http_unhandled_exceptions_total 0\b", metrics)


# ---------------------------------------------------------------------------------------------
# issue 15: a property-based fuzz driven by the server's own /openapi.json
# ---------------------------------------------------------------------------------------------

OPENAPI_EXAMPLES = int(os.environ.get("OMNILOOP_OPENAPI_EXAMPLES", "1050"))


def _resolve_ref(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        node: Any = spec
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def schema_errors(spec: dict[str, Any], schema: dict[str, Any], value: Any, where: str = "$") -> list[str]:
    """Where ``value`` violates ``schema`` (the JSON Schema keywords our generated documents use)."""
    schema = _resolve_ref(spec, schema)
    errs: list[str] = []
    if "anyOf" in schema or "oneOf" in schema:
        options = schema.get("anyOf") or schema.get("oneOf")
        if all(schema_errors(spec, o, value, where) for o in options):
            errs.append(f"{where}: matches none of {len(options)} alternatives")
        return errs
    t = schema.get("type")
    kinds = t if isinstance(t, list) else [t] if t else []
    checks = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
              "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
              "null": lambda v: v is None,
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
    if kinds and not any(checks[k](value) for k in kinds):
        return [f"{where}: expected {kinds}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{where}: {value!r} not in {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for word, bad in (("minimum", lambda b: value < b), ("maximum", lambda b: value > b),
                          ("exclusiveMinimum", lambda b: value <= b), ("exclusiveMaximum", lambda b: value >= b)):
            if word in schema and bad(schema[word]):
                errs.append(f"{where}: {value} violates {word} {schema[word]}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            if k not in value:
                errs.append(f"{where}: missing {k!r}")
        for k, v in value.items():
            if k in props:
                errs += schema_errors(spec, props[k], v, f"{where}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{where}: unexpected {k!r}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errs += schema_errors(spec, schema["additionalProperties"], v, f"{where}.{k}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            errs += schema_errors(spec, schema["items"], v, f"{where}[{i}]")
    return errs


def from_schema(spec: dict[str, Any], schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values that conform to ``schema`` (hypothesis), for the keywords the generated document uses."""
    schema = _resolve_ref(spec, schema)
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(spec, o, depth) for o in (schema.get("anyOf") or schema.get("oneOf"))])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema.get("type")
    if isinstance(t, list):
        return st.one_of([from_schema(spec, {**schema, "type": k}, depth) for k in t])
    if t == "integer":
        lo, hi = schema.get("minimum", -(2**31)), schema.get("maximum", 2**31)
        return st.integers(min_value=lo, max_value=hi)
    if t == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -1e6))
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 1e6))
        return st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema)
    if t == "string":
        return st.text(max_size=12) if "pattern" not in schema else st.from_regex(schema["pattern"], fullmatch=True)
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array":
        if depth > 3:
            return st.just([])
        lo = schema.get("minItems", 0)
        return st.lists(from_schema(spec, schema.get("items", {}), depth + 1), min_size=lo,
                        max_size=min(max(lo, 2), schema.get("maxItems", 2)))
    if t == "object":
        props = schema.get("properties")
        if props is None or depth > 3:
            return st.just({})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(spec, v, depth + 1) for k, v in props.items() if k in required},
            optional={k: from_schema(spec, v, depth + 1) for k, v in props.items() if k not in required},
        )
    return st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=5))


#: refusals of a body the document allows that are rules no JSON Schema keyword of the document
#: states (each documented in the README or omniloop_io.jsonschema): input parts over HTTP carry data,
#: never a server path; a stop string is non-empty; and, for every string, the converter's NUL rule
_RULES_BEYOND_THE_SCHEMA = re.compile(r"^(omniloop\.inputs\.\d+(\.path|\.type)?|omniloop\.sampling\.stop)$")
_CONVERTER_WIDE = "may not contain a NUL character"


@pytest.mark.parametrize("name", ["VideoCreate", "ImageCreate", "ImageEdit", "ChatCompletionCreate", "CompletionCreate",
                                  "SpeechCreate", "AudioGenerationCreate"])
def test_every_body_the_document_allows_passes_the_body_validation(name: str) -> None:
    """The other direction of one source of truth: bodies drawn from /openapi.json's schema of an
    endpoint are accepted by that endpoint's body class (no server, so 200 examples are quick)."""
    from omniloop.errors import RequestError
    from omniloop_server.body_schema import BODY_CLASSES, parse_body
    from omniloop_server.openapi import openapi_document

    spec = json.loads(json.dumps(openapi_document()))
    cls = BODY_CLASSES[name]

    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(body=from_schema(spec, {"$ref": f"#/components/schemas/{name}"}))
    def run(body: dict[str, Any]) -> None:
        try:
            parse_body(body, cls)
        except RequestError as exc:
            if exc.path == "seconds" and isinstance(body.get("seconds"), str):  # text: its range is in the description
                assert "must be > 0 and at most 3600" in exc.message, exc.message
                return
            assert _RULES_BEYOND_THE_SCHEMA.match(exc.path) or _CONVERTER_WIDE in exc.message, (exc.path, exc.message, body)

    run()


def test_openapi_document_drives_a_fuzz_with_no_5xx_and_no_schema_violating_response(hostile: Any) -> None:
    """>= 1,000 bodies generated from the server's own /openapi.json (conforming, or with one field
    replaced by an arbitrary JSON value) on POST /v1/videos and /v1/images/generations: never a 5xx,
    and every response conforms to the schema the document gives for its status."""
    url, _out, _sandbox, app = hostile
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT) as client:
        spec = client.get("/openapi.json").json()
        assert spec["openapi"].startswith("3.1")
        ops = [("/v1/videos", "post"), ("/v1/images/generations", "post")]
        bodies = []
        for path, method in ops:
            op = spec["paths"][path][method]
            body_schema = op["requestBody"]["content"]["application/json"]["schema"]
            valid = from_schema(spec, body_schema).map(lambda b: {**b, "prompt": b.get("prompt") or "x"})
            junk = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                                          st.text(max_size=8)),
                                lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=5), c, max_size=3)),
                                max_leaves=6)
            props = sorted(_resolve_ref(spec, body_schema)["properties"])
            mutated = st.tuples(valid, st.sampled_from(props), junk).map(lambda t: {**t[0], t[1]: t[2]})
            bodies.append(st.tuples(st.just((path, method, op)), st.one_of(valid, valid, mutated)))
        statuses: dict[int, int] = {}

        @settings(max_examples=OPENAPI_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=st.one_of(bodies))
        def run(case: Any) -> None:
            (path, _method, op), body = case
            r = client.post(path, json=body)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (r.status_code, r.text[:300], body)
            documented = op["responses"].get(str(r.status_code)) or op["responses"]["default"]
            schema = documented["content"]["application/json"]["schema"]
            problems = schema_errors(spec, schema, r.json())
            assert not problems, (r.status_code, problems[:3], r.text[:300])

        run()
        state = app.state.omniloop
        deadline = time.monotonic() + 30
        while state.jobs.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
    total = sum(statuses.values())
    print(f"\nopenapi fuzz: {total} requests, statuses {sorted(statuses.items())}")
    assert total >= min(OPENAPI_EXAMPLES, 1000)
    assert statuses.get(200, 0) > 0 and any(s >= 400 for s in statuses)  # both paths exercised


# ---------------------------------------------------------------------------------------------
# WS /v1/videos/stream (issue 21): hostile start messages, bounded
# ---------------------------------------------------------------------------------------------
WS_EXAMPLES = int(os.environ.get("OMNILOOP_HOSTILE_WS_EXAMPLES", "60"))


def test_hostile_websocket_start_messages_get_an_error_or_a_stream_never_a_crash(hostile: Any) -> None:
    """Start messages drawn like the POST bodies above (and raw bytes): each gets an ``error``
    message then a 1008/1009 close, or a stream ending in ``done``; never an internal-error close
    (1011), a hang past the timeout, or a file outside the output folder."""
    websockets = pytest.importorskip("websockets")
    from websockets.sync.client import connect

    url, out, sandbox, _app = hostile
    ws_url = url.replace("http://", "ws://") + "/v1/videos/stream"
    before = snapshot(sandbox)
    seen = {"error": 0, "done": 0}

    @settings(max_examples=WS_EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(msg=st.one_of(bodies(sandbox), st.binary(max_size=64), st.text(max_size=40)))
    def check(msg: Any) -> None:
        with connect(ws_url, max_size=None, open_timeout=REQUEST_TIMEOUT) as ws:
            ws.send(msg if isinstance(msg, (bytes, str)) else json.dumps(msg))
            deadline = time.monotonic() + REQUEST_TIMEOUT
            while True:
                try:
                    got = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
                except websockets.exceptions.ConnectionClosed:
                    assert ws.close_code in (1000, 1008, 1009, 1013), (msg, ws.close_code, ws.close_reason)
                    return
                if isinstance(got, bytes):
                    continue
                doc = json.loads(got)
                if doc["type"] == "error":
                    assert set(doc["error"]) == {"message", "type", "param", "code"}, doc
                    seen["error"] += 1
                elif doc["type"] == "done":
                    assert doc["status"] in ("completed", "failed", "cancelled"), doc
                    seen["done"] += 1
                    return

    check()
    assert seen["error"] and seen["done"], seen  # both refusals and real streams were exercised
    assert httpx.get(f"{url}/health", timeout=REQUEST_TIMEOUT).status_code == 200
    assert snapshot(sandbox) == before
    assert all(OUT_NAME.match(p.name) for p in out.iterdir())
