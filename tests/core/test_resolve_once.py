"""Issue 15: a request is resolved once, by its family, and everything downstream reads that.

* ``Runtime.prepare`` calls ``family.resolve`` exactly once; the result is ``Execution.resolved``
  and every node's ``ctx.resolved``;
* ``Deployment.check`` runs the same resolution on an inspected (config-only) model;
* the scheduler sizes a request from ``resolved.workload()``, not from guessed defaults;
* interceptors get their validated plugin params as ``open(step, loop, params)``; the 1.0
  signature ``open(step, loop)`` still works and warns ``HookDeprecationWarning``.
"""

from __future__ import annotations

import warnings
from typing import Any

import attrs
import pytest

from omniloop import Deployment, HookDeprecationWarning, Resolved, Workload
from omniloop.errors import PluginError, RequestError
from omniloop.family import PluginComponentSpec
from omniloop.hookspecs import hookimpl
from omniloop.resolved import GenericResolved
from omniloop.testing import (
    PassThroughBlocks,
    build_toy_checkpoint,
    component_plugin,
    make_manager,
    toy_request,
    toy_runtime,
)
from omniloop.testing.toy import ToyFamily, ToyResolved


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_toy_checkpoint(tmp_path_factory.mktemp("toy"))


def test_prepare_resolves_once_and_every_node_reads_it(ckpt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = toy_runtime(ckpt)
    calls: list[str] = []
    real = ToyFamily.resolve

    def counting(self: Any, *args: Any, **kw: Any) -> Any:
        calls.append("resolve")
        return real(self, *args, **kw)

    monkeypatch.setattr(ToyFamily, "resolve", counting)
    seen: list[Any] = []
    ex = rt.prepare(toy_request(steps=3, node_params={"denoise": {"guidance_scale": 1.0}}))
    assert calls == ["resolve"]
    assert isinstance(ex.resolved, ToyResolved) and isinstance(ex.resolved, Resolved)
    assert (ex.resolved.steps, ex.resolved.guidance_scale, ex.resolved.branches) == (3, 1.0, ("cond",))
    while not ex.done:
        if ex._ctx is not None:
            seen.append(ex._ctx.resolved)
        ex.advance()
    assert ex.output.ok and calls == ["resolve"]  # running the nodes resolved nothing again
    assert seen and all(r is ex.resolved for r in seen)
    assert ex.state.loops["denoise"].branches == ("cond",) and ex.state.loops["denoise"].total == 3


def test_check_runs_the_same_resolution_without_weights(ckpt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    real = ToyFamily.resolve

    def counting(self: Any, model: Any, *args: Any, **kw: Any) -> Any:
        calls.append(model.components)
        return real(self, model, *args, **kw)

    monkeypatch.setattr(ToyFamily, "resolve", counting)
    dep = Deployment({"model": {"path": str(ckpt)}}, manager=make_manager())
    dep.check(toy_request())
    assert calls == [{}]  # the inspected model: no components, no weights
    with pytest.raises(RequestError) as err:
        dep.check(toy_request(diffusion={"height": 10}))
    assert err.value.path == "diffusion.height"
    with pytest.raises(RequestError) as err:
        dep.check(toy_request(node_params={"denoise": {"guidance_scale": -1}}))
    assert err.value.path == "node_params.denoise.guidance_scale"


def test_the_scheduler_asks_the_resolved_request(ckpt: Any) -> None:
    from omniloop_scheduler.models import shape_of

    rt = toy_runtime(ckpt)
    ex = rt.prepare(toy_request(steps=5, diffusion={"steps": 5, "height": 32, "width": 24, "guidance_scale": 4.0}))
    assert ex.resolved.workload() == Workload(steps=5, branches=2, frames=3, height=32, width=24)
    shape = shape_of(rt, ex)
    assert (shape.steps, shape.branches, shape.frames, shape.height, shape.width) == (5, 2, 3, 32, 24)


def test_a_family_without_resolve_gets_the_generic_resolution(ckpt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(ToyFamily, "resolve")
    monkeypatch.setattr(ToyFamily, "capabilities", attrs.evolve(ToyFamily.capabilities, resolve=False))
    rt = toy_runtime(ckpt)
    ex = rt.prepare(toy_request(steps=2))
    assert isinstance(ex.resolved, GenericResolved)
    w = ex.resolved.workload()
    assert (w.steps, w.frames, w.height, w.width, w.branches) == (2, 3, 16, 16, 2)  # the toy's task defaults
    assert ex.run().ok


def test_a_resolve_returning_the_wrong_thing_is_named(ckpt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ToyFamily, "resolve", lambda self, *a, **k: {"steps": 3})
    rt = toy_runtime(ckpt)
    with pytest.raises(PluginError, match="resolve\\(\\) returned dict"):
        rt.prepare(toy_request())


# -- plugin params passed explicitly; the old open() signature warns ------------------------------
@attrs.define(frozen=True)
class GainParams:
    gain: float = attrs.field(default=1.0, metadata={"ge": 0.0})


class Gain(PassThroughBlocks):
    name = "gain"
    distribution_altering = True

    def __init__(self) -> None:
        self.params: list[Any] = []

    def open(self, step: Any, loop: Any, params: GainParams) -> Any:
        self.params.append(params)
        return params.gain

    def run(self, blocks: Any, hidden: Any, ctx: Any, call: Any) -> Any:
        for b in blocks:
            hidden = call(b, hidden) * ctx.state
        return hidden


class OldGain(Gain):
    def open(self, step: Any, loop: Any) -> Any:  # type: ignore[override]  # the 1.0 signature
        p = loop.extra["plugin_params"]["gain"]
        self.params.append(p)
        return p.gain


def _plugin(obj: Any) -> Any:
    return ("gain", component_plugin("gain", "block_interceptor", lambda: obj, params_schema=GainParams,
                                     distribution_altering=True))


def test_interceptors_get_their_validated_params_in_open(ckpt: Any) -> None:
    icpt = Gain()
    rt = toy_runtime(ckpt, _plugin(icpt), plugins={"gain": {}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", HookDeprecationWarning)
        assert rt.generate(toy_request(steps=2, plugin_params={"gain": {"gain": 0.5}})).ok
    assert icpt.params and all(p == GainParams(gain=0.5) for p in icpt.params)
    icpt.params.clear()
    assert rt.generate(toy_request(steps=2)).ok
    assert all(p == GainParams() for p in icpt.params)  # the schema's defaults when not tuned


def test_the_old_open_signature_still_works_and_warns(ckpt: Any) -> None:
    old, new = OldGain(), Gain()
    outs = []
    for icpt in (old, new):
        rt = toy_runtime(ckpt, _plugin(icpt), plugins={"gain": {}})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs.append(rt.generate(toy_request(steps=2, plugin_params={"gain": {"gain": 0.5}})))
        dep = [w for w in caught if issubclass(w.category, HookDeprecationWarning)]
        if icpt is old:
            assert dep and "open(step, loop) is deprecated" in str(dep[0].message)
        else:
            assert not dep
    assert old.params == new.params and old.params[0] == GainParams(gain=0.5)
    import torch

    assert torch.equal(outs[0].artifacts["video"].frames, outs[1].artifacts["video"].frames)


# -- deploy fields without behaviour are refused, never accepted and ignored ------------------------
@pytest.mark.parametrize("field,value", [("transport", "nccl")])  # offload: tests/core/test_offload.py
def test_fields_without_behaviour_are_refused(ckpt: Any, field: str, value: str) -> None:
    from omniloop.errors import DeployError

    with pytest.raises(DeployError, match=f"^{field}: '{value}' is not implemented yet"):
        Deployment({"model": {"path": str(ckpt)}, field: value}, manager=make_manager())
    Deployment({"model": {"path": str(ckpt)}, "transport": "inproc", "offload": "none"}, manager=make_manager())


# -- a renamed hook keeps working for the minor version and warns -----------------------------------
def test_a_renamed_hook_registers_under_its_new_name_and_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    from omniloop import hookspecs
    from omniloop.plugins import PluginManager

    monkeypatch.setitem(hookspecs.RENAMED_HOOKS, "omniloop_register_observer_types", "omniloop_register_observers")
    seen: list[str] = []

    class Old:
        OMNILOOP_HOOK_API = ">=1.0,<2"

        @hookimpl
        def omniloop_register_observer_types(self, register: Any) -> None:  # the old name
            seen.append("called")
            register(PluginComponentSpec(name="old-observer", kind="observer", factory=lambda cfg: object()))

    pm = PluginManager(discover=False)
    with pytest.warns(HookDeprecationWarning, match="implements hook 'omniloop_register_observer_types', renamed"):
        rec = pm.add("old", Old())
    assert rec.ok, rec.error
    assert "old-observer" in pm.registry().observers and seen == ["called"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", HookDeprecationWarning)
        assert PluginManager(discover=False).add("new", type("New", (), {"OMNILOOP_HOOK_API": ">=1.0,<2"})()).ok


def test_hookspecs_carry_real_types() -> None:
    import inspect

    from omniloop import hookspecs

    sig = inspect.signature(hookspecs.omniloop_step_end)
    assert sig.parameters["request"].annotation == "OmniRequest" and sig.parameters["loop"].annotation == "LoopState"
    assert inspect.signature(hookspecs.omniloop_register_families).parameters["register"].annotation == "Callable[[Family], None]"
    assert inspect.signature(hookspecs.omniloop_schedule_decision).parameters["decision"].annotation == "ScheduleDecision"


def test_observers_get_their_validated_params_at_request_start(ckpt: Any) -> None:
    @attrs.define(frozen=True)
    class WatchParams:
        every: int = attrs.field(default=1, metadata={"ge": 1})

    seen: list[Any] = []

    class Watch:
        needs_eager = False

        @hookimpl
        def omniloop_request_start(self, request: Any, plugin_params: Any) -> None:
            seen.append(plugin_params.get("watch"))

    rt = toy_runtime(ckpt, ("watch", component_plugin("watch", "observer", Watch, params_schema=WatchParams)),
                     plugins={"watch": {}})
    assert rt.generate(toy_request(steps=1, plugin_params={"watch": {"every": 3}})).ok
    assert rt.generate(toy_request(steps=1)).ok
    assert seen == [WatchParams(every=3), WatchParams()]
    with pytest.raises(RequestError) as err:
        rt.prepare(toy_request(plugin_params={"watch": {"every": 0}}))
    assert err.value.path == "plugin_params.watch.every"
