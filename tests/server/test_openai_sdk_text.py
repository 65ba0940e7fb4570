"""The official ``openai`` SDK's ``chat.completions`` and ``completions`` against a real server on
127.0.0.1 serving a tiny random Qwen2 checkpoint through the ``step`` scheduler (issues 20, 23).

The text the server returns — plain and streamed — equals the Python API's text for the same
request (greedy, and seeded sampling), because a request's tokens do not depend on its batch.
Concurrent requests are co-batched (``batched_step`` decode units) and each still equals itself
alone. The server README's chat snippets are copied from here.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("omniloop_qwen")

from openai import OpenAI  # noqa: E402

T = 60.0
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def python_api(tiny_family_runtime: Any) -> Any:
    """The reference: the Python API on its own runtime (serial scheduler)."""
    rt = tiny_family_runtime("qwen")

    def text(inputs: list[dict[str, Any]], **sampling: Any) -> Any:
        return rt.generate({"task": "reason", "inputs": inputs, "sampling": sampling})

    return text


def chat_inputs(messages: list[dict[str, str]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": m["content"], "role": m["role"]} for m in messages]


@pytest.fixture(scope="module")
def text_server(tiny_family_runtime: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    rt = tiny_family_runtime("qwen", scheduler="step", limits={"max_queue": 32})
    app = create_app(rt, output_dir=tmp_path_factory.mktemp("qwen-out"), shutdown_timeout=0)
    with serving(app) as url:
        yield url, app


@pytest.fixture
def client(text_server: tuple[str, Any]) -> Iterator[OpenAI]:
    url, _ = text_server
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=T)
    try:
        yield client
    finally:
        client.close()


def test_chat_completion_equals_the_python_api(client: OpenAI, python_api: Any) -> None:
    completion = client.chat.completions.create(
        model="tiny-qwen",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}],
        max_tokens=12,
        temperature=0,
    )
    ref = python_api(chat_inputs(MESSAGES), max_tokens=12, temperature=0)
    choice = completion.choices[0]
    assert choice.message.content == ref.artifacts["text"].text and choice.message.role == "assistant"
    assert choice.finish_reason == ref.metrics["finish_reason"] == "length"
    assert completion.usage is not None and completion.usage.model_dump(exclude_none=True) == ref.metrics["usage"]
    assert completion.usage.completion_tokens == 12 and completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-") and completion.model == "tiny-qwen"


def test_chat_stream_equals_the_python_api(client: OpenAI, python_api: Any) -> None:
    stream = client.chat.completions.create(
        model="tiny-qwen",
        messages=[{"role": "user", "content": "hello"}],
        max_completion_tokens=10,
        temperature=0.8,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ref = python_api([{"type": "text", "text": "hello", "role": "user"}], max_tokens=10, temperature=0.8, seed=5)
    assert text == ref.artifacts["text"].text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.metrics["finish_reason"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump(exclude_none=True) == ref.metrics["usage"]
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    # the same request without streaming gives the same text (seeded sampling, reproducible)
    plain = client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": "hello"}],
                                           max_completion_tokens=10, temperature=0.8, seed=5)
    assert plain.choices[0].message.content == text


def test_stop_strings_and_multi_turn(client: OpenAI, python_api: Any) -> None:
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi!"},
                {"role": "user", "content": "0 1 2 3"}]
    full = python_api(chat_inputs(messages), max_tokens=16, temperature=0).artifacts["text"].text
    stop = full[5:7]
    assert stop.strip(), full  # a stop string from the middle of the greedy text
    out = client.chat.completions.create(model="tiny-qwen", messages=messages, max_tokens=16, temperature=0, stop=stop)
    assert out.choices[0].message.content == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny-qwen", messages=messages, max_tokens=16, temperature=0, stop=[stop], stream=True) if c.choices)
    assert streamed == full[: full.index(stop)]


def test_completions_plain_and_streamed(client: OpenAI, python_api: Any) -> None:
    completion = client.completions.create(model="tiny-qwen", prompt="the quick brown fox", max_tokens=8, temperature=0)
    ref = python_api([{"type": "text", "text": "the quick brown fox"}], max_tokens=8, temperature=0)
    assert completion.choices[0].text == ref.artifacts["text"].text and completion.object == "text_completion"
    assert completion.usage is not None and completion.usage.prompt_tokens == ref.metrics["usage"]["prompt_tokens"]
    stream = client.completions.create(model="tiny-qwen", prompt="the quick brown fox", max_tokens=8, temperature=0,
                                       stream=True)
    pieces = list(stream)
    assert "".join(p.choices[0].text for p in pieces) == ref.artifacts["text"].text
    assert pieces[-1].choices[0].finish_reason == "length"


def test_concurrent_requests_are_batched_and_each_equals_itself_alone(
        client: OpenAI, python_api: Any, text_server: tuple[str, Any]) -> None:
    _, app = text_server
    engine = app.state.omniloop.engine
    batched: list[int] = []

    def listen(decision: Any) -> None:
        if decision.action == "batched_step" and decision.node == "decode":
            batched.append(len(decision.request_ids))

    engine.decision_listeners.append(listen)
    prompts = ["hello", "the quick brown fox", "0 1 2 3", "write a short story about a cat"]
    results: dict[str, str] = {}

    def run(p: str) -> None:
        out = client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": p}],
                                             max_tokens=64, temperature=0)
        results[p] = out.choices[0].message.content or ""

    try:
        threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(T)
    finally:
        engine.decision_listeners.remove(listen)
    for p in prompts:
        ref = python_api([{"type": "text", "text": p, "role": "user"}], max_tokens=64, temperature=0)
        assert results[p] == ref.artifacts["text"].text, p
    assert batched and max(batched) >= 2, batched  # decode steps of several sequences ran as one forward


def test_a_client_that_leaves_a_stream_cancels_its_request(client: OpenAI, text_server: tuple[str, Any]) -> None:
    _, app = text_server
    engine = app.state.omniloop.engine
    cache = engine.runtime.model.components["kv_cache"]
    before = engine.stats()["finished"]["cancelled"]
    stream = client.chat.completions.create(  # greedy: no EOS for 1000+ tokens
        model="tiny-qwen", messages=[{"role": "user", "content": "write a short story about a cat"}],
        max_tokens=1500, temperature=0, stream=True)
    for _ in zip(range(3), stream, strict=False):
        pass
    stream.close()
    deadline = time.monotonic() + T
    while engine.stats()["finished"]["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats()["finished"]["cancelled"] == before + 1
    while cache.used_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cache.used_blocks == 0 and cache.reserved_blocks == 0  # its KV blocks came back


def test_a_client_that_leaves_before_the_answer_cancels_its_request(text_server: tuple[str, Any]) -> None:
    """A non-streaming chat whose client closes the connection while it runs is cancelled."""
    import socket
    from urllib.parse import urlparse

    url, app = text_server
    engine = app.state.omniloop.engine
    before, submitted = engine.stats()["finished"]["cancelled"], engine.stats()["submitted"]
    body = json.dumps({"model": "tiny-qwen", "messages": [{"role": "user", "content": "write a short story about a cat"}],
                       "max_tokens": 1500, "temperature": 0}).encode()
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=T) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + T
        while engine.stats()["submitted"] == submitted and time.monotonic() < deadline:
            time.sleep(0.01)  # the request reached the engine; now the client goes away
    while engine.stats()["finished"]["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats()["finished"]["cancelled"] == before + 1


def test_typed_errors(client: OpenAI, text_server: tuple[str, Any]) -> None:
    _, app = text_server
    submitted = app.state.omniloop.engine.stats()["submitted"]
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": "hi"}], n=2)
    assert exc.value.body["param"] == "n" and "only n=1" in exc.value.message
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"temperature": -1}, "temperature", ">= 0"),
        ({"top_p": 0}, "top_p", "> 0"),
        ({"max_tokens": 100_000}, "max_tokens", "context"),
        ({"seed": -1}, "seed", ">= 0"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ({"logprobs": True}, "logprobs", "not supported"),
        ({"model": "gpt-4o"}, "model", "unknown model 'gpt-4o'"),
        ({"messages": []}, "messages", "at least one"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "a"}]}, "messages.0.role", "tool"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages.0.content.0.type", "only text"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
        ({"extra_body": {"top_k": -1}}, "top_k", ">= 0"),
        ({"extra_body": {"omniloop": {"node_params": {"decode": {"chat": "yes"}}}}}, "omniloop.node_params.decode.chat", ""),
    ]
    for extra, param, fragment in cases:
        kw: dict[str, Any] = {"model": "tiny-qwen", "messages": [{"role": "user", "content": "hi"}], **extra}
        with pytest.raises(openai.UnprocessableEntityError) as exc:
            client.chat.completions.create(**kw)
        assert exc.value.body["param"] == param, (extra, exc.value.body)
        assert fragment in exc.value.message, (extra, exc.value.message)
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.completions.create(model="tiny-qwen", prompt=[1, 2, 3])
    assert exc.value.body["param"] == "prompt"
    with pytest.raises(openai.UnprocessableEntityError) as exc:  # a text model makes no image
        client.images.generate(model="tiny-qwen", prompt="a cat")
    assert exc.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as exc:
        client.post("/chat/completions", cast_to=object, body=None, options={"headers": {"Content-Type": "application/json"}})
    assert "empty" in exc.value.message
    assert app.state.omniloop.engine.stats()["submitted"] == submitted  # nothing reached the engine


def test_chat_on_a_video_model_is_a_clear_422(sdk: Any) -> None:
    client, _ = sdk
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["param"] == "model" and "does not generate text" in exc.value.message


@pytest.fixture
def sdk(server: Any) -> Iterator[tuple[OpenAI, Any]]:
    url, app = server
    with OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=T) as client:
        yield client, app


@pytest.mark.parametrize("grace", [30.0, 0.0])
def test_a_stream_in_flight_at_shutdown_finishes_within_the_grace_period(tiny_family_runtime: Any, tmp_path: Path,
                                                                         python_api: Any, grace: float) -> None:
    """Draining gives chat requests the video jobs' grace period (then cancels them: an error event)."""
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    rt = tiny_family_runtime("qwen", scheduler="step")
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=grace)
    state = app.state.omniloop
    with serving(app) as url, OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=T) as client:
        # greedy "hello" ends (EOS) after 266 tokens; this prompt's greedy text runs past 1000 without one
        prompt = "hello" if grace else "write a short story about a cat"
        stream = client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=400 if grace else 1500, temperature=0, stream=True)
        it = iter(stream)
        first = next(it)
        assert state.loop is not None
        state.loop.call_soon_threadsafe(state.begin_drain)  # what SIGTERM does under omniloop serve
        if grace:
            chunks = [first, *it]
            ref = python_api([{"type": "text", "text": "hello", "role": "user"}], max_tokens=400, temperature=0)
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.artifacts["text"].text
            assert chunks[-1].choices[0].finish_reason == ref.metrics["finish_reason"]
            with pytest.raises(openai.InternalServerError) as exc:  # 503: no new work while draining
                client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": "x"}])
            assert exc.value.status_code == 503
        else:
            with pytest.raises(openai.APIError) as err:
                list(it)
            assert "cancelled" in str(err.value)
