"""Property: whatever JSON-like value arrives, the schema answers with one short RequestError (or a
valid request) — never another exception, never an echo of a huge value (issue 14).

Values mix the request's own field names and shapes with hostile leaves: NaN/Infinity, 5,000-digit
integers, lone surrogates, NUL, long strings, deep nesting. Bounded: a few hundred examples, no
deadline per example, no database (the CI box is shared)."""

from __future__ import annotations

import math
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from omniloop.deploy import deploy_from_dict  # noqa: E402
from omniloop.errors import DeployError, RequestError  # noqa: E402
from omniloop.request import OmniRequest  # noqa: E402
from omniloop.schema import request_from_dict  # noqa: E402

SETTINGS = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

FIELDS = ["task", "prompt", "negative_prompt", "inputs", "diffusion", "sampling", "outputs", "node_params",
          "plugin_params", "exact", "priority", "request_id", "schema_version", "type", "text", "role", "path",
          "data_b64", "values", "steps", "guidance_scale", "shift", "height", "width", "frames", "fps", "seed",
          "temperature", "top_p", "top_k", "max_tokens", "format", "stream_progress", "return_latents"]

leaves = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    # by index: hypothesis would print the strategy, and Python refuses to print 5,000 digits
    st.integers(0, 3).map(lambda i: [10**5000, -(10**5000), 2**63, -(2**63) - 1][i]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e-300, 1e308]),
    st.text(max_size=20),
    st.sampled_from(["t2v", "t2i", "i2v", "text", "image", "action", "\ud800", "a\x00b",
                     "../../etc/passwd", "/abs/x", "", "1e308", "NaN"]),
    st.integers(1, 2).map(lambda i: "x" * (100_000 * i)),
)
keys = st.one_of(st.sampled_from(FIELDS), st.text(max_size=8), st.sampled_from(["\ud800", "a\x00"]),
                 st.just(1).map(lambda _: "k" * 100_000))
values = st.recursive(leaves, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                     st.dictionaries(keys, kids, max_size=5)), max_leaves=25)


def _deep(n: int) -> Any:
    v: Any = []
    for _ in range(n):
        v = [v]
    return v


bodies = st.one_of(
    st.dictionaries(keys, values, max_size=8),
    st.fixed_dictionaries({"task": st.sampled_from(["t2v", "t2i"]), "prompt": st.one_of(st.text(max_size=10), leaves)},
                          optional={k: values for k in ("diffusion", "inputs", "node_params", "plugin_params",
                                                        "request_id", "outputs", "sampling", "priority")}),
    values,
    st.builds(lambda n: {"task": "t2v", "node_params": {"n": _deep(n)}}, st.integers(1, 2000)),
)


def _short_and_printable(text: str) -> None:
    assert len(text) < 2500, text[:300]
    text.encode("utf-8")


@SETTINGS
@given(bodies)
def test_any_body_gives_a_request_or_one_short_request_error(body: Any) -> None:
    try:
        req = request_from_dict(body)
    except RequestError as exc:
        _short_and_printable(str(exc))
        return
    assert isinstance(req, OmniRequest)
    for name in ("guidance_scale", "shift", "fps"):
        v = getattr(req.diffusion, name)
        assert v is None or math.isfinite(v)


@SETTINGS
@given(st.one_of(st.dictionaries(keys, values, max_size=8),
                 st.fixed_dictionaries({}, optional={k: values for k in ("model", "plugins", "options", "limits",
                                                                          "policies", "scheduler_options", "device")})))
def test_any_deploy_gives_a_config_or_one_short_deploy_error(data: Any) -> None:
    try:
        deploy_from_dict(data)
    except DeployError as exc:
        _short_and_printable(str(exc))
