"""A request built in Python (an ``OmniRequest`` object, which skips the converter) meets exactly
the rules a JSON request meets (issue 15): ``Runtime.prepare`` and ``Deployment.check`` call
``omniloop.schema.as_request`` on entry, and the error is the same ``RequestError`` naming the
dotted field, with the same message, as for the dict a client would send."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from omniloop.errors import RequestError
from omniloop.request import (
    AdapterRef,
    DiffusionParams,
    ImagePart,
    OmniRequest,
    SamplingParams,
    TaskType,
    TextPart,
)
from omniloop.runtime import Deployment
from omniloop.schema import as_request, request_from_dict, request_to_dict, validate_request
from omniloop.testing import build_toy_checkpoint, make_manager, toy_request, toy_runtime

P = [TextPart("a red ball")]

#: (request object, dotted path) — each is refused by request_from_dict in its JSON form too
BAD = [
    (OmniRequest(task=TaskType.T2V, inputs=P, diffusion=DiffusionParams(steps=0)), "diffusion.steps"),
    (OmniRequest(task=TaskType.T2V, inputs=P, diffusion=DiffusionParams(fps=1e-300)), "diffusion.fps"),
    (OmniRequest(task=TaskType.T2V, inputs=P, diffusion=DiffusionParams(seed=2**70)), "diffusion.seed"),
    (OmniRequest(task=TaskType.T2V, inputs=P, diffusion=DiffusionParams(guidance_scale=float("inf"))),
     "diffusion.guidance_scale"),
    (OmniRequest(task=TaskType.T2V, inputs=P, sampling=SamplingParams(temperature=float("nan"))),
     "sampling.temperature"),
    (OmniRequest(task=TaskType.T2V, inputs=P, sampling=SamplingParams(stop=[""])), "sampling.stop"),
    (OmniRequest(task=TaskType.T2V, inputs=P, priority=1000), "priority"),
    (OmniRequest(task=TaskType.T2V, inputs=P, request_id="../../etc/passwd"), "request_id"),
    (OmniRequest(task=TaskType.T2V, inputs=P, request_id=""), "request_id"),
    (OmniRequest(task=TaskType.T2V, inputs=[TextPart("a\x00b")]), "inputs.0.text"),
    (OmniRequest(task=TaskType.T2V, inputs=[*P, ImagePart()]), "inputs.1"),
    (OmniRequest(task=TaskType.T2V, inputs=P, adapters=[AdapterRef("../lora.safetensors")]), "adapters.0.name"),
    (OmniRequest(task=TaskType.T2V, inputs=P, node_params={"denoise": {"shift": float("nan")}}),
     "node_params.denoise.shift"),
    (OmniRequest(task=TaskType.T2V, inputs=P, schema_version="2"), "schema_version"),
]

#: objects no JSON body can even express (wrong Python types in the fields)
WRONG_TYPES = [
    (OmniRequest(task=TaskType.T2V, inputs=P, diffusion=DiffusionParams(steps="5")), "diffusion.steps"),  # type: ignore[arg-type]
    (OmniRequest(task=TaskType.T2V, inputs=P, diffusion=DiffusionParams(steps=5.0)), "diffusion.steps"),  # type: ignore[arg-type]
    (OmniRequest(task=TaskType.T2V, inputs=P, diffusion={"steps": 5}), "diffusion"),  # type: ignore[arg-type]
    (OmniRequest(task="t3v", inputs=P), "task"),  # type: ignore[arg-type]
    (OmniRequest(task=TaskType.T2V, inputs=["a red ball"]), "inputs.0"),  # type: ignore[list-item]
    (OmniRequest(task=TaskType.T2V, inputs=P, adapters=[{"name": "x"}]), "adapters.0"),  # type: ignore[list-item]
    (OmniRequest(task=TaskType.T2V, inputs=P, exact=1), "exact"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("req", "path"), BAD, ids=[p for _, p in BAD])
def test_an_object_gets_the_error_its_json_form_gets(req: OmniRequest, path: str) -> None:
    with pytest.raises(RequestError) as as_object:
        validate_request(req)
    assert as_object.value.path == path
    data = request_to_dict(req)  # what a client would send for it
    with pytest.raises(RequestError) as as_json:
        request_from_dict(data)
    assert (as_json.value.path, str(as_json.value)) == (as_object.value.path, str(as_object.value))
    assert "\n" not in str(as_object.value)  # one line


@pytest.mark.parametrize(("req", "path"), WRONG_TYPES, ids=[p for _, p in WRONG_TYPES])
def test_wrong_python_types_are_named(req: OmniRequest, path: str) -> None:
    with pytest.raises(RequestError) as err:
        as_request(req)
    assert err.value.path == path and "\n" not in str(err.value)


def test_a_valid_object_is_returned_as_it_is() -> None:
    req = OmniRequest(task=TaskType.T2V, inputs=[*P, ImagePart(data_b64="AAAA")], diffusion=DiffusionParams(steps=3),
                      node_params={"denoise": {"shift": 3.0}}, adapters=[AdapterRef("style", 0.5)], request_id="my.job-1")
    assert as_request(req) is req
    assert as_request(request_to_dict(req)) == req


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_toy_checkpoint(tmp_path_factory.mktemp("toy"))


def test_runtime_and_deployment_check_python_built_requests_on_entry(ckpt: Any) -> None:
    rt = toy_runtime(ckpt)
    dep = Deployment({"model": {"path": str(ckpt)}}, manager=make_manager())
    good = request_from_dict(toy_request(steps=2))
    for bad, path in ((attrs.evolve(good, diffusion=DiffusionParams(steps=0)), "diffusion.steps"),
                      (attrs.evolve(good, request_id="/abs/out"), "request_id"),
                      (attrs.evolve(good, sampling=SamplingParams(top_p=float("nan"))), "sampling.top_p")):
        for entry in (rt.prepare, rt.generate, dep.check):
            with pytest.raises(RequestError) as err:
                entry(bad)
            assert err.value.path == path, entry
    assert rt.prepare(good).request is good
    assert rt.generate(good).ok
