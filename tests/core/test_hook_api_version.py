"""Hook API 1.1 (issue 15; 1.2 added omniloop_register_linear_precisions): the version was bumped for the hook and argument added in it
(``omniloop_register_run_options``, ``omniloop_request_start(..., plugin_params)``), plugins that
declare 1.0 still load and still get called without the new argument, plugins that need 1.1 say so
and load, and every argument added after its hook is documented with the version that added it."""

from __future__ import annotations

import inspect
import re
from typing import Any

import attrs
import pytest

from omniloop import hookspecs
from omniloop.hookspecs import hookimpl
from omniloop.plugins import api_supported
from omniloop.testing import build_toy_checkpoint, component_plugin, make_manager, toy_request, toy_runtime


def _v(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split("."))


def test_the_version_is_the_newest_in_the_history() -> None:
    assert hookspecs.HOOK_API_VERSION == "1.5"  # 1.5: LinearPrecisionSpec.options_schema (issue 40)
    versions = list(hookspecs.HOOK_API_HISTORY)
    assert versions == sorted(versions, key=_v) and versions[-1] == hookspecs.HOOK_API_VERSION


def test_every_hook_since_is_a_released_version() -> None:
    for name in [*hookspecs.REGISTRATION_HOOKS, *hookspecs.OBSERVER_EVENTS]:
        since = re.search(r"Since:\s*(\d+(?:\.\d+)*)", inspect.getdoc(getattr(hookspecs, name)) or "")
        assert since and since.group(1) in hookspecs.HOOK_API_HISTORY, name
    assert "Since: 1.1" in (inspect.getdoc(hookspecs.omniloop_register_run_options) or "")
    assert "Since: 1.2" in (inspect.getdoc(hookspecs.omniloop_register_linear_precisions) or "")
    assert "Since: 1.3" in (inspect.getdoc(hookspecs.omniloop_register_runtime_loaders) or "")
    assert "Since: 1.4" in (inspect.getdoc(hookspecs.omniloop_register_mechanisms) or "")


def test_arguments_added_later_are_in_the_spec_and_documented_with_their_version() -> None:
    assert hookspecs.ARGUMENTS_SINCE["omniloop_request_start"] == {"plugin_params": "1.1"}
    for hook, args in hookspecs.ARGUMENTS_SINCE.items():
        spec = getattr(hookspecs, hook)
        doc = inspect.getdoc(spec) or ""
        hook_since = re.search(r"Since:\s*(\d+(?:\.\d+)*)", doc).group(1)  # type: ignore[union-attr]
        for arg, version in args.items():
            assert arg in inspect.signature(spec).parameters, (hook, arg)
            assert version in hookspecs.HOOK_API_HISTORY and _v(hook_since) < _v(version)
            assert f"since {version}" in " ".join(doc.split()), f"{hook}'s docstring does not say {arg} is since {version}"
            assert arg in hookspecs.HOOK_API_HISTORY[version]


@pytest.mark.parametrize(("declared", "loads"), [
    (">=1.0,<2", True),   # every plugin written for 1.0 keeps loading on 1.1 and 1.2
    (">=1.1,<2", True),   # a plugin that takes plugin_params declares it needs 1.1
    (">=1.2,<2", True),   # a plugin registering a linear precision (1.2) says so
    (">=1.3,<2", True),   # a plugin registering a runtime loader (1.3) says so
    (">=1.4,<2", True),   # a plugin registering a load-time mechanism (1.4) says so
    (">=1.5,<2", True),   # a linear precision with options_schema (1.5) says so
    ("==1.0", False),     # pinned to exactly 1.0: refused, and the message says what we provide
    (">=1.6", False),
    ("<1.1", False),
])
def test_declared_ranges_against_this_version(declared: str, loads: bool) -> None:
    assert api_supported(declared) is loads
    pm = make_manager()

    class Plugin:
        OMNILOOP_HOOK_API = declared

        @hookimpl
        def omniloop_register_run_options(self, register: Any) -> None:
            pass

    rec = pm.add("p", Plugin())
    assert rec.ok is loads, rec.error
    if not loads:
        assert rec.status == "refused" and declared in (rec.error or "") and hookspecs.HOOK_API_VERSION in (rec.error or "")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_toy_checkpoint(tmp_path_factory.mktemp("toy"))


def test_a_1_0_observer_and_a_1_1_observer_run_side_by_side(ckpt: Any) -> None:
    @attrs.define(frozen=True)
    class NewParams:
        every: int = attrs.field(default=1, metadata={"ge": 1})

    seen: list[Any] = []

    class Old:  # written for 1.0: no plugin_params
        needs_eager = False

        @hookimpl
        def omniloop_request_start(self, request: Any, pipeline: Any, deploy: Any) -> None:
            seen.append(("old", request.request_id))

    class New:  # written for 1.1
        needs_eager = False

        @hookimpl
        def omniloop_request_start(self, request: Any, plugin_params: Any) -> None:
            seen.append(("new", plugin_params.get("new")))

    old_plugin = component_plugin("old", "observer", Old)
    new_plugin = component_plugin("new", "observer", New, hook_api=">=1.1,<2", params_schema=NewParams)
    rt = toy_runtime(ckpt, ("old", old_plugin), ("new", new_plugin), plugins={"old": {}, "new": {}})
    assert rt.generate(toy_request(steps=1, request_id="r1", plugin_params={"new": {"every": 2}})).ok
    assert sorted(seen, key=str) == sorted([("old", "r1"), ("new", NewParams(every=2))], key=str)
