"""``/v1/models`` lists a deployment's adapters; a body naming an undeclared one gets a 422 naming it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytest.importorskip("omniloop_server")

import omniloop_adapters.plugin as adapters_plugin
import omniloop_scheduler.plugin as scheduler_plugin
import omniloop_wan.plugin as wan_plugin
from omniloop.runtime import Runtime
from omniloop.testing import make_manager
from omniloop_server import create_app
from omniloop_server.testing import serving

T = 60.0


@pytest.fixture
def server(wan_setup: dict[str, Any], tmp_path: Any) -> Any:
    manager = make_manager(("wan", wan_plugin), ("adapters", adapters_plugin), ("scheduler", scheduler_plugin), toy=False, scheduler=False)
    rt = Runtime.from_model(wan_setup["ckpt"], manager=manager, scheduler="step",
                            adapters={"a": str(wan_setup["a"]), "b": str(wan_setup["b"])})
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0, poll_after_ms=50)
    with serving(app) as url:
        yield url


def test_models_lists_adapters_without_paths(server: str, wan_setup: dict[str, Any]) -> None:
    with httpx.Client(base_url=server, timeout=T) as c:
        model = c.get("/v1/models").json()["data"][0]
    rows = model["adapters"]
    assert [r["name"] for r in rows] == ["a", "b"] and [r["rank"] for r in rows] == [4, 2]
    assert all("path" not in r for r in rows) and str(wan_setup["root"]) not in str(model)


def test_undeclared_adapter_is_a_422_naming_it(server: str) -> None:
    body = {"prompt": "a red fox", "size": "32x32", "frames": 5, "steps": 1, "seed": 1,
            "omniloop": {"adapters": [{"name": "a", "scale": 0.5}, {"name": "nope"}]}}
    with httpx.Client(base_url=server, timeout=T) as c:
        r = c.post("/v1/videos", json=body)
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert "nope" in err["message"] and "adapters" in (err["param"] or "")
        ok = c.post("/v1/videos", json={**body, "omniloop": {"adapters": [{"name": "a", "scale": 0.5}]}})
        assert ok.status_code == 200, ok.text
