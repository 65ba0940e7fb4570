"""Issue 15 on Wan: the request is resolved once (``WanFamily.resolve``) and the nodes read it."""

from __future__ import annotations

from typing import Any

import pytest

from omniloop import Resolved, Workload
from omniloop.errors import RequestError
from omniloop_wan import resolve as wan_resolve
from omniloop_wan.resolve import WanParams


def test_one_resolution_per_request(wan_runtime: Any, t2v_request: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = wan_resolve.resolve

    def counting(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*args, **kw)

    for module in ("omniloop_wan.family", "omniloop_wan.stages", "omniloop_wan.resolve"):
        monkeypatch.setattr(f"{module}.resolve", counting)
    ex = wan_runtime().prepare(t2v_request())
    assert len(calls) == 1
    assert isinstance(ex.resolved, WanParams) and isinstance(ex.resolved, Resolved)
    out = ex.run()
    assert out.ok and len(calls) == 1  # the validate and denoise nodes re-resolved nothing
    assert ex.state.read("params").values["params"] is ex.resolved


def test_the_workload_is_what_the_loop_runs(wan_runtime: Any, t2v_request: Any) -> None:
    ex = wan_runtime().prepare(t2v_request())
    r = ex.resolved
    assert r.workload() == Workload(steps=r.steps, branches=2 if r.guidance_scale > 1 else 1, frames=r.frames,
                                    height=r.height, width=r.width)
    ex.run()
    assert ex.steps_done == r.steps


def test_node_params_are_parsed_once_by_the_core(wan_runtime: Any, t2v_request: Any) -> None:
    bad = {**t2v_request(), "node_params": {"denoise": {"steps": 0}}}
    with pytest.raises(RequestError) as err:
        wan_runtime().prepare(bad)
    assert err.value.path == "node_params.denoise.steps"
    ok = {**t2v_request(), "node_params": {"denoise": {"steps": 2, "sampler": "flow-euler"}}}
    ex = wan_runtime().prepare(ok)
    assert ex.resolved.steps == 2 and ex.resolved.policies.sampler.name == "flow-euler"
