"""Runtime and execution on the toy family: validation before compute, interceptors, observers,
cancellation and failure isolation."""

import attrs
import pytest
import torch

from omniloop.errors import DeployError, RequestError
from omniloop.hookspecs import hookimpl
from omniloop.request import Status
from omniloop.testing import PassThroughBlocks, component_plugin, run_interleaved, toy_runtime


def req(**diffusion):
    return {"task": "t2v", "prompt": "a red circle", "diffusion": {"seed": 7, **diffusion}}


@attrs.define
class CountingParams:
    scale: float = attrs.field(default=1.0, metadata={"ge": 0.0})


class ScalingBlocks(PassThroughBlocks):
    """A block interceptor that scales every block output by ``scale`` (1.0 = identity)."""

    name = "scaler"
    distribution_altering = True

    def __init__(self):
        self.opened, self.closed = [], []

    def open(self, step, loop, params=None):
        p = loop.extra["plugin_params"].get("scaler")
        st = {"branch": step.branch, "calls": 0, "scale": p.scale if p else 1.0}
        self.opened.append(st)
        return st

    def run(self, blocks, hidden, ctx, call):
        st = ctx.state
        for b in blocks:
            hidden = call(b, hidden) * st["scale"]
            st["calls"] += 1
        return hidden

    def close(self, state):
        self.closed.append(state)

    def metrics(self, state):
        return {"calls": state["calls"]}


def scaler_plugin(scaler=None):
    """The ``scaler`` block interceptor as a plugin: ``scaler`` (a new :class:`ScalingBlocks` when None)."""
    scaler = ScalingBlocks() if scaler is None else scaler
    return component_plugin("scaler", "block_interceptor", lambda: scaler, params_schema=CountingParams,
                            distribution_altering=True)


class StepLog:
    needs_eager = False

    def __init__(self):
        self.steps = []

    @hookimpl
    def omniloop_step_end(self, request, node, step, total):
        self.steps.append((request.request_id, node, step, total))




def test_generate_is_deterministic_for_a_seed(toy_checkpoint):
    rt = toy_runtime(toy_checkpoint)
    a, b, c = rt.generate(req()), rt.generate(req()), rt.generate(req(seed=8))
    assert a.status is Status.COMPLETED
    assert a.artifacts["video"].frames.dtype == torch.uint8
    assert a.artifacts["video"].frames.shape == (3, 16, 16, 3)
    assert a.artifacts["video"].producer == "decode"
    assert torch.equal(a.artifacts["video"].frames, b.artifacts["video"].frames)
    assert not torch.equal(a.artifacts["latents"].tensor, c.artifacts["latents"].tensor)


@pytest.mark.parametrize("body, path", [
    (req(steps=500), "diffusion.steps"),
    (req(height=18), "diffusion.height"),
    ({"task": "i2v", "prompt": "x"}, "task"),
    ({**req(), "plugin_params": {"cache-dit": {"Fn": 1}}}, "plugin_params.cache-dit"),
    ({**req(), "node_params": {"nope": {}}}, "node_params.nope"),
    ({**req(), "node_params": {"denoise": {"guidance_scale": -2.0}}}, "node_params.denoise.guidance_scale"),
    ({**req(), "node_params": {"denoise": {"bogus": 1}}}, "node_params.denoise.bogus"),
    ({**req(), "node_params": {"decode": {"x": 1}}}, "node_params.decode"),
])
def test_bad_requests_are_refused_before_compute(toy_checkpoint, body, path):
    rt = toy_runtime(toy_checkpoint, limits={"max_steps": 50})
    with pytest.raises(RequestError) as err:
        rt.prepare(body)
    assert err.value.path == path


def test_node_params_reach_the_stage(toy_checkpoint):
    rt = toy_runtime(toy_checkpoint)
    a = rt.generate({**req(), "node_params": {"denoise": {"guidance_scale": 1.0}}})
    b = rt.generate(req(guidance_scale=1.0))
    assert torch.equal(a.artifacts["latents"].tensor, b.artifacts["latents"].tensor)


def test_block_interceptor_is_opened_per_branch_and_closed(toy_checkpoint):
    icpt = ScalingBlocks()
    rt = toy_runtime(toy_checkpoint, ("scaler", scaler_plugin(icpt)), plugins={"scaler": {}})
    base = toy_runtime(toy_checkpoint).generate(req())
    same = rt.generate(req())
    assert [s["branch"] for s in icpt.opened] == ["cond", "uncond"]
    assert icpt.closed == icpt.opened
    assert same.metrics["plugins"]["scaler"] == {"cond": {"calls": 16}, "uncond": {"calls": 16}}
    assert torch.equal(base.artifacts["latents"].tensor, same.artifacts["latents"].tensor)
    tuned = rt.generate({**req(), "plugin_params": {"scaler": {"scale": 0.5}}})
    assert not torch.equal(base.artifacts["latents"].tensor, tuned.artifacts["latents"].tensor)


def test_exact_requests_run_without_distribution_altering_plugins(toy_checkpoint):
    icpt = ScalingBlocks()
    rt = toy_runtime(toy_checkpoint, ("scaler", scaler_plugin(icpt)), plugins={"scaler": {}})
    out = rt.generate({**req(), "exact": True})
    assert icpt.opened == [] and "plugins" not in out.metrics
    with pytest.raises(RequestError, match="alters outputs"):
        rt.prepare({**req(), "exact": True, "plugin_params": {"scaler": {"scale": 0.5}}})


def test_two_block_interceptors_are_refused(toy_checkpoint):
    second = component_plugin("other", "block_interceptor", ScalingBlocks)
    with pytest.raises(DeployError, match="two block interceptors"):
        toy_runtime(toy_checkpoint, ("scaler", scaler_plugin()), ("other", second), plugins={"scaler": {}, "other": {}})


def test_family_without_run_blocks_refuses_block_interceptors(toy_checkpoint, monkeypatch):
    import attrs

    from omniloop.testing.toy import ToyFamily

    monkeypatch.setattr(ToyFamily, "capabilities", attrs.evolve(ToyFamily.capabilities, block_interceptors=False))
    with pytest.raises(DeployError, match="does not"):  # refused before load (issue 34: was at the first request)
        toy_runtime(toy_checkpoint, ("scaler", scaler_plugin()), plugins={"scaler": {}})


def test_unused_observer_events_are_not_bound(toy_checkpoint):
    log = StepLog()
    rt = toy_runtime(toy_checkpoint, ("steplog", component_plugin("steplog", "observer", lambda: log)),
                     plugins={"steplog": {}})
    built = rt.pipeline(rt.prepare(req()).request.task)
    assert built.bus.step_end is not None
    assert built.bus.step_start is None and built.bus.tap is None and built.bus.node_start is None
    rt.generate(req(steps=3))
    assert [s[2:] for s in log.steps] == [(0, 3), (1, 3), (2, 3)]
    assert toy_runtime(toy_checkpoint).pipeline(rt.prepare(req()).request.task).bus is None


def test_interleaved_executions_equal_each_alone(toy_checkpoint):
    rt = toy_runtime(toy_checkpoint, ("scaler", scaler_plugin()), plugins={"scaler": {}})
    reqs = [{**req(seed=s), "plugin_params": {"scaler": {"scale": 0.9}}} for s in (1, 2)]
    alone = [rt.generate(r) for r in reqs]
    for a, out in zip(alone, run_interleaved(rt, reqs), strict=True):
        assert torch.equal(a.artifacts["latents"].tensor, out.artifacts["latents"].tensor)


def test_cancel_between_steps_releases_state(toy_checkpoint):
    icpt = ScalingBlocks()
    rt = toy_runtime(toy_checkpoint, ("scaler", scaler_plugin(icpt)), plugins={"scaler": {}})
    ex = rt.prepare(req(steps=10))
    for _ in range(3):  # text encode, then two steps
        ex.advance()
    ex.cancel()
    events = ex.advance()
    assert ex.output.status is Status.CANCELLED
    assert events[-1].output is ex.output
    assert "video" not in ex.output.artifacts
    assert len(icpt.closed) == 2  # both branches released
    assert ex.state.loops["denoise"].plugin_state == {}


def _bad_and_good(checkpoint, step_index, exc):
    """A request whose scaler (``scale`` 0) raises ``exc`` at ``step_index`` and a plain one, advanced
    in lockstep through one runtime: ``(bad, good, the scaler instance)``."""

    class Raising(ScalingBlocks):
        def run(self, blocks, hidden, ctx, call):
            if ctx.step.step_index == step_index and ctx.loop.extra["plugin_params"]["scaler"].scale == 0.0:
                raise exc
            return super().run(blocks, hidden, ctx, call)

    scaler = Raising()
    rt = toy_runtime(checkpoint, ("scaler", scaler_plugin(scaler)), plugins={"scaler": {}})
    bad = rt.prepare({**req(), "plugin_params": {"scaler": {"scale": 0.0}}})
    good = rt.prepare(req())
    while not (bad.done and good.done):
        bad.advance()
        good.advance()
    return bad, good, scaler


def test_failure_in_a_step_fails_only_that_request(toy_checkpoint):
    bad, good, scaler = _bad_and_good(toy_checkpoint, 2, RuntimeError("injected"))
    assert bad.output.status is Status.FAILED
    assert bad.output.error.node == "denoise" and bad.output.error.step == 2
    assert "injected" in bad.output.error.message
    assert good.output.status is Status.COMPLETED
    assert len(scaler.closed) == 4


def test_stream_emits_progress_then_final(toy_checkpoint):
    rt = toy_runtime(toy_checkpoint)
    events = list(rt.stream(req(steps=2)))
    steps = [(e.step, e.total) for e in events if e.node == "denoise" and e.step]
    assert steps == [(1, 2), (2, 2)]
    assert events[-1].kind.value == "final" and events[-1].output.ok


def test_bad_checkpoint_is_one_clear_error(tmp_path):
    from omniloop.errors import CheckpointError
    from omniloop.testing.toy import CONFIG_NAME, build_toy_checkpoint

    ck = build_toy_checkpoint(tmp_path / "ck")
    (ck / "toy.pt").unlink()
    with pytest.raises(CheckpointError, match=r"toy.pt: missing weights"):
        toy_runtime(ck)
    (ck / CONFIG_NAME).write_text("{not json")
    with pytest.raises(DeployError, match="no installed family recognizes"):
        toy_runtime(ck)


def test_runtime_reports_tasks_and_defaults(toy_checkpoint):
    rt = toy_runtime(toy_checkpoint)
    assert {t.value for t in rt.tasks} == {"t2v", "t2i"}
    assert rt.defaults("t2v")["steps"] == 4 and rt.defaults("t2i")["frames"] == 1
    rt.model.tasks = frozenset({rt.prepare(req()).request.task})
    assert {t.value for t in rt.tasks} == {"t2v"}
    with pytest.raises(RequestError, match="t2i"):
        rt.prepare({"task": "t2i", "prompt": "x"})


# --------------------------------------------------------------------------------------------
# issue 14: supported tasks, and the checks that need no weights
# --------------------------------------------------------------------------------------------


def test_supported_tasks_follow_the_checkpoint_not_the_family(toy_checkpoint, monkeypatch):
    from omniloop.request import TaskType
    from omniloop.testing import ToyFamily

    rt = toy_runtime(toy_checkpoint)
    assert rt.supported_tasks == rt.tasks == {TaskType.T2V, TaskType.T2I}
    import attrs

    monkeypatch.setattr(ToyFamily, "supported_tasks", lambda self, model: ["t2i"], raising=False)
    monkeypatch.setattr(ToyFamily, "capabilities", attrs.evolve(ToyFamily.capabilities, supported_tasks=True))
    assert rt.supported_tasks == {TaskType.T2I} and rt.describe()["tasks"] == ["t2i"]
    with pytest.raises(RequestError, match="not supported by the checkpoint"):
        rt.prepare(req())


def test_the_wan_t2v_checkpoint_does_not_advertise_i2v(tmp_path):
    pytest.importorskip("omniloop_wan")
    from omniloop.request import TaskType
    from omniloop.runtime import Runtime
    from omniloop_wan.tiny import build_tiny_checkpoint

    rt = Runtime.from_model(build_tiny_checkpoint(tmp_path / "wan"), family="wan")
    assert rt.family.tasks == {TaskType.T2V, TaskType.I2V}
    assert rt.supported_tasks == {TaskType.T2V}


def _deployment(checkpoint, **deploy):
    from omniloop.runtime import Deployment, deploy_for_model
    from omniloop.testing import make_manager

    return Deployment(deploy_for_model(checkpoint, **deploy), manager=make_manager(("scaler", scaler_plugin())))


@pytest.mark.parametrize(("body", "path"), [
    ({"diffusion": {"steps": 100000}}, "diffusion.steps"),  # the deploy's limit
    ({"diffusion": {"height": 7}}, "diffusion.height"),  # the family's own check, on the inspected config
    ({"prompt": "   "}, "inputs"),
    ({"prompt": ""}, "inputs"),
    ({"plugin_params": {"scaler": {"bogus": 1}}}, "plugin_params.scaler.bogus"),
    ({"plugin_params": {"scaler": {"scale": float("nan")}}}, "plugin_params.scaler.scale"),
    ({"plugin_params": {"nope": {}}}, "plugin_params.nope"),
    ({"task": "i2v"}, "task"),
    ({"exact": True, "plugin_params": {"scaler": {"scale": 2.0}}}, "plugin_params.scaler"),
])
def test_requests_are_checked_against_the_deployment_without_loading_weights(toy_checkpoint, monkeypatch, body, path):
    from omniloop.testing import ToyFamily

    def no_load(*a, **k):
        raise AssertionError("Deployment.check must not load weights")

    monkeypatch.setattr(ToyFamily, "load", no_load)
    d = _deployment(toy_checkpoint, plugins={"scaler": {}})
    with pytest.raises(RequestError) as err:
        d.check({"task": "t2v", "prompt": "a fox", **body})
    assert err.value.path == path
    assert d.check({"task": "t2v", "prompt": "a fox", "plugin_params": {"scaler": {"scale": 2.0}}}).prompt == "a fox"
    assert d.supported_tasks == {t for t in ToyFamily.tasks}


def test_a_family_without_inspect_still_gets_the_generic_checks(toy_checkpoint, monkeypatch):
    import attrs

    from omniloop.testing import ToyFamily

    monkeypatch.delattr(ToyFamily, "inspect")
    monkeypatch.setattr(ToyFamily, "capabilities", attrs.evolve(ToyFamily.capabilities, inspect=False))
    d = _deployment(toy_checkpoint)
    assert d.inspect() is None
    with pytest.raises(RequestError, match=r"diffusion\.steps"):
        d.check({"task": "t2v", "prompt": "x", "diffusion": {"steps": 100000}})
    d.check({"task": "t2v", "prompt": "x", "diffusion": {"height": 7}})  # the family's check needs its model


def test_the_runtime_refuses_what_the_deployment_refuses(toy_checkpoint):
    rt = toy_runtime(toy_checkpoint)
    for body in ({"prompt": " "}, {"diffusion": {"height": 7}}, {"diffusion": {"steps": 10**6}}):
        with pytest.raises(RequestError):
            rt.prepare({"task": "t2v", "prompt": "x", **body})
        with pytest.raises(RequestError):
            rt.check({"task": "t2v", "prompt": "x", **body})


@pytest.mark.parametrize("exc", [SystemExit(3), GeneratorExit()])
def test_a_plugin_calling_sys_exit_in_a_step_fails_only_its_request(toy_checkpoint, exc):
    bad, good, scaler = _bad_and_good(toy_checkpoint, 1, exc)
    assert bad.output.status is Status.FAILED and bad.output.error.type == type(exc).__name__
    assert good.output.status is Status.COMPLETED
    assert len(scaler.closed) == 4  # both branches of both requests closed


def test_ctrl_c_in_a_step_cancels_the_request_cleanly_and_propagates(toy_checkpoint):
    class Interrupted(ScalingBlocks):
        def run(self, blocks, hidden, ctx, call):
            if ctx.step.step_index == 1:
                raise KeyboardInterrupt
            return super().run(blocks, hidden, ctx, call)

    scaler = Interrupted()
    rt = toy_runtime(toy_checkpoint, ("scaler", scaler_plugin(scaler)), plugins={"scaler": {}})
    ex = rt.prepare(req())
    with pytest.raises(KeyboardInterrupt):
        ex.run()
    assert ex.done and ex.output.status is Status.CANCELLED
    assert len(scaler.closed) == 2
