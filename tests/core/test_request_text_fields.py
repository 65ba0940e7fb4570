"""The request fields text families read: ``sampling.seed``, ``sampling.stop``, chat roles."""

from __future__ import annotations

import pytest

from omniloop.errors import RequestError
from omniloop.request import OmniRequest, TextPart
from omniloop.schema import request_from_dict, request_to_dict


def _req(**sampling: object) -> OmniRequest:
    return request_from_dict({"task": "reason", "prompt": "hi", "sampling": sampling})


def test_seed_and_stop_round_trip() -> None:
    r = _req(seed=7, stop=["\n\n", "END"], max_tokens=4)
    assert r.sampling.seed == 7 and r.sampling.stop == ["\n\n", "END"]
    assert request_from_dict(request_to_dict(r)) == r
    d = _req()
    assert d.sampling.seed is None and d.sampling.stop == []


@pytest.mark.parametrize(("sampling", "path", "fragment"), [
    ({"seed": -1}, "sampling.seed", ">= 0"),
    ({"seed": 2**63}, "sampling.seed", ""),
    ({"seed": True}, "sampling.seed", "integer"),
    ({"seed": 1.5}, "sampling.seed", "integer"),
    ({"stop": "END"}, "sampling.stop", "list"),
    ({"stop": [""]}, "sampling.stop", "non-empty"),
    ({"stop": [3]}, "sampling.stop.0", "string"),
    ({"stop": ["a"] * 17}, "sampling.stop", "at most 16"),
    ({"stop": ["x" * 1001]}, "sampling.stop", "longer than 1000"),
])
def test_bad_seed_or_stop_names_the_field(sampling: dict[str, object], path: str, fragment: str) -> None:
    with pytest.raises(RequestError) as exc:
        _req(**sampling)
    assert exc.value.path == path and fragment in exc.value.message


def test_chat_roles() -> None:
    r = request_from_dict({"task": "reason", "inputs": [
        {"type": "text", "text": "be brief", "role": "system"},
        {"type": "text", "text": "hello", "role": "user"},
        {"type": "text", "text": "hi!", "role": "assistant"},
        {"type": "text", "text": "again", "role": "user"},
    ]})
    assert [p.role for p in r.inputs if isinstance(p, TextPart)] == ["system", "user", "assistant", "user"]
    assert r.prompt is None  # chat turns are not the diffusion prompt
    with pytest.raises(RequestError) as exc:
        request_from_dict({"task": "reason", "inputs": [{"type": "text", "text": "x", "role": "tool"}]})
    assert exc.value.path.startswith("inputs.0")
