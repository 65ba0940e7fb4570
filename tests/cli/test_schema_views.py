"""Issue 15: one source of truth for the request's fields — the attrs classes. The JSON Schema that
``omniloop schema`` prints (and the server serves) and ``omniloop generate``'s flags are derived
from them; a field that exists in one view and not another fails here."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from omniloop.errors import RequestError
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, SamplingParams
from omniloop.schema import request_from_dict
from omniloop.testing import build_toy_checkpoint, make_manager
from omniloop_cli import cli
from omniloop_cli.generate import FLAG_GROUPS, group_class, request_flags
from omniloop_io.jsonschema import REQUEST_CONVENIENCES, json_schema, request_schema


def _fields(cls: type) -> set[str]:
    return {f.name for f in attrs.fields(cls)}


def test_the_request_schema_has_exactly_the_schema_fields() -> None:
    s = request_schema()
    assert set(s["properties"]) == _fields(OmniRequest) | set(REQUEST_CONVENIENCES)
    for cls in (DiffusionParams, SamplingParams, OutputSpec):
        assert set(s["$defs"][cls.__name__]["properties"]) == _fields(cls), cls.__name__
        assert s["$defs"][cls.__name__]["additionalProperties"] is False
    assert s["required"] == ["task"]


def test_field_metadata_becomes_schema_keywords() -> None:
    d = request_schema()["$defs"]["DiffusionParams"]["properties"]
    assert d["steps"]["anyOf"][0] == {"type": "integer", "minimum": 1}
    assert d["shift"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0.0}
    assert d["fps"]["anyOf"][0] == {"type": "number", "minimum": 0.1, "maximum": 1000.0}
    req = request_schema()["properties"]
    assert req["priority"] == {"type": "integer", "minimum": -100, "maximum": 100, "default": 0}
    assert req["request_id"]["maxLength"] == 128 and req["request_id"]["pattern"].startswith("^")


def test_generate_has_a_flag_for_every_diffusion_and_sampling_field() -> None:
    flagged = {(g, n) for g, n, _, _ in request_flags()}
    assert flagged == {(g, f.name) for g in FLAG_GROUPS for f in attrs.fields(group_class(g))}
    assert {("audio", "seconds"), ("audio", "start")} <= flagged
    res = CliRunner().invoke(cli, ["generate", "--help"], obj=make_manager())
    assert res.exit_code == 0, res.output
    for _, _, _, flags in request_flags():
        assert flags[0] in res.output, flags
    assert "--guidance" in res.output  # the older short name stays an alias


def test_generate_flags_reach_the_request_fields(tmp_path: Any) -> None:
    res = CliRunner().invoke(cli, ["generate", "x", "--shift", "0", "--out", str(tmp_path / "a.mp4")], obj=make_manager())
    assert res.exit_code != 0 and "diffusion.shift: must be > 0" in res.output
    res = CliRunner().invoke(cli, ["generate", "x", "--top-p", "2", "--out", str(tmp_path / "a.mp4")], obj=make_manager())
    assert res.exit_code != 0 and "sampling.top_p: must be <= 1" in res.output


def test_omniloop_schema_prints_the_request_plugin_and_node_schemas(tmp_path: Any) -> None:
    ckpt = build_toy_checkpoint(tmp_path / "toy")
    res = CliRunner().invoke(cli, ["schema", "--model", str(ckpt)], obj=make_manager())
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["request"] == json.loads(json.dumps(request_schema()))
    assert doc["node_params"]["t2v"]["denoise"]["properties"]["guidance_scale"]["anyOf"][0] == {
        "type": "number", "minimum": 0.0}
    res = CliRunner().invoke(cli, ["schema"], obj=make_manager())
    assert res.exit_code == 0 and "node_params" not in json.loads(res.stdout)


# -- what the schema says is accepted, the converter accepts (and the boundaries agree) --------------
def _strategy(prop: dict[str, Any]) -> st.SearchStrategy[Any]:
    inner = prop["anyOf"][0] if "anyOf" in prop else prop
    if inner.get("type") == "integer":
        return st.integers(min_value=inner.get("minimum", -(2**62)), max_value=inner.get("maximum", 2**62))
    if inner.get("type") == "number":
        lo = inner.get("minimum", inner.get("exclusiveMinimum", -1e9))
        return st.floats(min_value=lo, max_value=inner.get("maximum", 1e9), allow_nan=False,
                         exclude_min="exclusiveMinimum" in inner)
    return st.none()


DIFFUSION = request_schema()["$defs"]["DiffusionParams"]["properties"]
SAMPLING = {k: v for k, v in request_schema()["$defs"]["SamplingParams"]["properties"].items() if k != "stop"}


@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries({}, optional={k: _strategy(v) for k, v in DIFFUSION.items()}),
       st.fixed_dictionaries({}, optional={k: _strategy(v) for k, v in SAMPLING.items()}))
def test_values_the_schema_allows_are_accepted(diffusion: dict[str, Any], sampling: dict[str, Any]) -> None:
    req = request_from_dict({"task": "t2v", "prompt": "p", "diffusion": diffusion, "sampling": sampling})
    for k, v in diffusion.items():
        assert getattr(req.diffusion, k) == v


@pytest.mark.parametrize("group,name", [("diffusion", k) for k in DIFFUSION] + [("sampling", k) for k in SAMPLING])
def test_a_value_just_outside_the_schema_is_refused_at_its_path(group: str, name: str) -> None:
    props = DIFFUSION if group == "diffusion" else SAMPLING
    inner = props[name]["anyOf"][0] if "anyOf" in props[name] else props[name]
    for word, delta in (("minimum", -1), ("exclusiveMinimum", 0), ("maximum", 1), ("exclusiveMaximum", 0)):
        if word not in inner:
            continue
        bad = inner[word] + (delta if inner["type"] == "integer" or delta == 0 else delta * 0.5)
        with pytest.raises(RequestError) as err:
            request_from_dict({"task": "t2v", "prompt": "p", group: {name: bad}})
        assert err.value.path == f"{group}.{name}"


def test_params_classes_get_schemas_too() -> None:
    from omniloop_policies import DenoiseParams

    s = json_schema(DenoiseParams)
    assert set(s["properties"]) == _fields(DenoiseParams) and s["additionalProperties"] is False
    assert s["properties"]["strength"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0}
