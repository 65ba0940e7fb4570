"""The Wan pipelines: graph shape, driving the stages by hand, taps, interceptors, per-request state."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.context import StageContext
from omniloop.hookspecs import hookimpl
from omniloop.loop import RequestState, StepContext
from omniloop.observers import ObserverBus
from omniloop.request import Status, TaskType
from omniloop.schema import request_from_dict
from omniloop.testing import component_plugin, run_interleaved

from .conftest import CountingInterceptor, wan_manager


def node_names(spec) -> list[str]:
    return [n.name for n in spec.nodes]


def test_graph_per_task(wan_runtime):
    t2v = wan_runtime("t2v").pipeline(TaskType.T2V).spec
    assert node_names(t2v) == ["validate", "text_encode", "denoise", "vae_decode", "output"]
    assert t2v.node("denoise").is_loop and t2v.node("denoise").uses == ("transformer",)
    i2v = wan_runtime("wan22_i2v").pipeline(TaskType.I2V).spec
    assert node_names(i2v) == ["validate", "text_encode", "image_encode", "denoise", "vae_decode", "output"]
    assert i2v.node("denoise").uses == ("transformer", "transformer_2")
    assert i2v.outputs == {"video": "video", "latents": "latents"}


# -- driving the stages by hand (no runtime) ------------------------------------------------------


def drive(spec, components, request, *, seed: int, observers=None, block_taps=None, step_interceptors=()) -> RequestState:
    """Run a PipelineSpec the way the runtime does: forward / init-step-finalize, in order."""
    state = RequestState(request=request, generator=torch.Generator("cpu").manual_seed(seed))
    for node in spec.nodes:
        if not node.runs_for(request):
            continue
        params = node.params_schema() if node.params_schema is not None else None
        ctx = StageContext(request=request, node=node, components=components, device=torch.device("cpu"),
                           dtype=torch.float32, params=params, observers=observers,
                           step_interceptors=tuple(step_interceptors) if node.is_loop else (),
                           block_taps=block_taps if node.is_loop else None)
        if not node.is_loop:
            node.stage.forward(ctx, state)
            continue
        loop = node.stage.init(ctx, state)
        for icpt in step_interceptors:
            for b in loop.branches:
                loop.plugin_state[(icpt.name, b)] = icpt.open(StepContext(request.request_id, node.name, 0, loop.total, 0.0, b), loop)
        while True:
            result = node.stage.step(ctx, state, loop)
            loop.step += 1
            if result.done:
                break
        node.stage.finalize(ctx, state, loop)
    return state


def test_stages_driven_by_hand_equal_the_runtime(wan_runtime, t2v_request):
    rt = wan_runtime("t2v")
    req = request_from_dict(t2v_request())
    spec = rt.family.build_pipeline(rt.model, TaskType.T2V, {})
    state = drive(spec, rt.model.components, req, seed=7)
    out = rt.generate(req)
    assert torch.equal(state.artifacts["video"].frames, out.artifacts["video"].frames)
    assert torch.equal(state.artifacts["latents"].tensor, out.artifacts["latents"].tensor)


class TapRecorder:
    def __init__(self) -> None:
        self.taps: list[tuple[str, int | None, str | None, str | None]] = []

    @hookimpl
    def omniloop_tap(self, request: Any, node: str, step: Any, name: str, value: Any) -> None:
        self.taps.append((name, getattr(step, "step_index", None), getattr(step, "branch", None),
                          getattr(step, "expert", None)))

    @hookimpl
    def omniloop_wants_block_taps(self, node: str) -> Any:
        return r"\.blocks\.1$"


def test_taps_per_step_and_branch(wan_runtime, t2v_request):
    import re

    rt = wan_runtime("wan22")
    rec = TapRecorder()
    req = request_from_dict(t2v_request(steps=4))
    spec = rt.family.build_pipeline(rt.model, TaskType.T2V, {})
    drive(spec, rt.model.components, req, seed=7, observers=ObserverBus([("rec", rec)]),
          block_taps=re.compile(r"\.blocks\.1$"))
    names = [t[0] for t in rec.taps]
    assert names.count("noise_pred") == 8 and names.count("guided") == 4 and names.count("latents") == 4
    assert names[-1] == "video"
    step0 = [t for t in rec.taps if t[1] == 0]
    assert [t[:3] for t in step0] == [
        ("transformer.blocks.1", 0, "cond"), ("noise_pred", 0, "cond"),
        ("transformer.blocks.1", 0, "uncond"), ("noise_pred", 0, "uncond"),
        ("guided", 0, None), ("latents", 0, None),
    ]
    experts = [t[3] for t in rec.taps if t[0] == "guided"]
    assert experts == ["transformer", "transformer", "transformer", "transformer_2"]
    assert ("transformer_2.blocks.1", 3, "cond", "transformer_2") in rec.taps


def test_no_taps_without_observers(wan_runtime, t2v_request, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(StageContext, "tap", lambda self, name, value, step=None: calls.append(name))
    rt = wan_runtime("t2v")
    rt.generate(t2v_request(steps=1))
    assert calls == []


# -- a step interceptor through the runtime --------------------------------------------------------


class RecordingStepInterceptor(CountingInterceptor):
    """Also records the expert and timestep, counts calls per branch and logs its close."""

    name = "rec-step"

    def open(self, step: StepContext, loop: Any, params: Any = None) -> Any:
        return {"branch": step.branch, "calls": 0}

    def forward(self, step: StepContext, state: Any, inputs: dict[str, Any], compute: Any) -> torch.Tensor:
        assert state["branch"] == step.branch
        state["calls"] += 1
        assert set(inputs) >= {"hidden_states", "timestep", "encoder_hidden_states"}
        self.log.append((step.step_index, step.branch, step.expert, float(step.timestep)))
        return compute()

    def close(self, state: Any) -> None:
        self.log.append(("closed", state["branch"], state["calls"]))

    def metrics(self, state: Any) -> dict[str, Any]:
        return {"calls": state["calls"]}


def test_step_interceptor_sees_every_branch_forward(tiny_ckpt, t2v_request):
    from omniloop.runtime import Runtime

    log: list = []
    manager = wan_manager()
    manager.add("rec", component_plugin("rec-step", "step_interceptor", lambda: RecordingStepInterceptor(log)))
    rt = Runtime.from_model(tiny_ckpt("wan22"), manager=manager, plugins={"rec-step": {}})
    out = rt.generate(t2v_request(steps=4))
    assert out.ok, out.error
    forwards = [e for e in log if e[0] != "closed"]
    assert [(s, b, x) for s, b, x, _ in forwards] == [
        (0, "cond", "transformer"), (0, "uncond", "transformer"),
        (1, "cond", "transformer"), (1, "uncond", "transformer"),
        (2, "cond", "transformer"), (2, "uncond", "transformer"),
        (3, "cond", "transformer_2"), (3, "uncond", "transformer_2"),
    ]
    assert [e for e in log if e[0] == "closed"] == [("closed", "cond", 4), ("closed", "uncond", 4)]
    assert out.metrics["plugins"]["rec-step"] == {"cond": {"calls": 4}, "uncond": {"calls": 4}}
    # a pass-through interceptor changes nothing
    plain = Runtime.from_model(tiny_ckpt("wan22"), manager=wan_manager()).generate(t2v_request(steps=4))
    assert torch.equal(out.artifacts["latents"].tensor, plain.artifacts["latents"].tensor)


# -- per-request state -------------------------------------------------------------------------------


def test_same_seed_same_video_other_seed_other_video(wan_runtime, t2v_request):
    rt = wan_runtime("t2v")
    a, b, c = (rt.generate(t2v_request(seed=s)) for s in (1, 1, 2))
    assert torch.equal(a.artifacts["latents"].tensor, b.artifacts["latents"].tensor)
    assert not torch.equal(a.artifacts["latents"].tensor, c.artifacts["latents"].tensor)


def test_interleaved_requests_equal_serial_ones(wan_runtime, t2v_request):
    """Each request owns its scheduler instance, latents and generator: interleaving steps of two
    requests (different seeds, steps and guidance) gives each exactly its serial result."""
    rt = wan_runtime("wan22")
    reqs = [t2v_request(seed=1, steps=4), t2v_request(seed=2, steps=3, guidance_scale=3.0)]
    serial = [rt.generate(r) for r in reqs]
    for out, ref in zip(run_interleaved(rt, reqs), serial, strict=True):
        assert out.ok
        assert torch.equal(out.artifacts["latents"].tensor, ref.artifacts["latents"].tensor)
        assert torch.equal(out.artifacts["video"].frames, ref.artifacts["video"].frames)


def test_cancel_between_steps(wan_runtime, t2v_request):
    rt = wan_runtime("t2v")
    ex = rt.prepare(t2v_request(steps=4))
    while ex.loop is None or ex.loop.step < 2:
        ex.advance()
    ex.cancel()
    out = ex.run()
    assert out.status is Status.CANCELLED
    assert "video" not in out.artifacts


def test_video_writes_as_mp4(wan_runtime, t2v_request, tmp_path):
    av = pytest.importorskip("av")
    from omniloop_io.media import write_mp4

    out = wan_runtime("t2v").generate(t2v_request(steps=1))
    video = out.artifacts["video"]
    path = write_mp4(video.frames, video.fps, tmp_path / "fox.mp4")
    with av.open(str(path)) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 9 and (frames[0].width, frames[0].height) == (32, 32)
