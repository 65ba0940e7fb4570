"""multipart/form-data → body: the conversion rules of omniloop_server.bodies.form_to_body
(as OpenAI's SDK encodes ``extra_body``: nested keys bracketed, every value text)."""

from __future__ import annotations

import pytest

from omniloop.errors import RequestError
from omniloop_server.bodies import form_to_body


def test_nesting_numbers_and_text_leaves() -> None:
    body = form_to_body([
        ("prompt", "123"), ("model", "ckpt"), ("seconds", "4"), ("size", "16x16"), ("steps", "3"), ("seed", "7"),
        ("guidance_scale", "4.5"), ("omniloop[diffusion][shift]", "2.0"), ("omniloop[exact]", "true"),
        ("omniloop[request_id]", "123"), ("omniloop[plugin_params][cache-dit][warmup]", "2"),
        ("omniloop[outputs][format]", "mp4"), ("omniloop[inputs][][type]", "text"), ("input_reference", b"\x89PNG"),
    ])
    assert body == {
        "prompt": "123", "model": "ckpt", "seconds": "4", "size": "16x16", "steps": 3, "seed": 7, "guidance_scale": 4.5,
        "omniloop": {"diffusion": {"shift": 2.0}, "exact": True, "request_id": "123",
                     "plugin_params": {"cache-dit": {"warmup": 2}}, "outputs": {"format": "mp4"},
                     "inputs": [{"type": "text"}]},
        "input_reference": b"\x89PNG",
    }


def test_values_that_do_not_parse_stay_text_for_the_schema_to_name() -> None:
    body = form_to_body([("steps", "many"), ("omniloop[diffusion][fps]", "1e999"), ("seed", "9" * 30)])
    assert body == {"steps": "many", "omniloop": {"diffusion": {"fps": "1e999"}}, "seed": "9" * 30}


def test_omniloop_as_one_json_field() -> None:
    assert form_to_body([("omniloop", '{"diffusion": {"shift": 3.0}}')]) == {"omniloop": {"diffusion": {"shift": 3.0}}}
    with pytest.raises(RequestError) as exc:
        form_to_body([("omniloop", '{"diffusion": ')])
    assert exc.value.path == "omniloop"
    with pytest.raises(RequestError) as exc:
        form_to_body([("omniloop", '{"diffusion": {"shift": NaN}}')])
    assert exc.value.path == "omniloop"


@pytest.mark.parametrize("items", [
    [("steps", "1"), ("steps", "2")],
    [("omniloop", "x"), ("omniloop[a]", "1")],
    [("a[]", "1"), ("a[b]", "2")],
    [("a[b]", "1"), ("a[]", "2")],
    [("[x]", "1")],
    [("a[b", "1")],
    [("p", "\ud800")],
    [(f"k{i}", "1") for i in range(65)],
    [("a" + "[b]" * 40, "1")],
])
def test_malformed_forms_are_request_errors(items: list[tuple[str, str]]) -> None:
    with pytest.raises(RequestError):
        form_to_body(items)
