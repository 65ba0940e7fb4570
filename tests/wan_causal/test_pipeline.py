"""``options.rollout: causal`` through the Runtime: PARTIAL chunk events, sessions, errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.errors import DeployError, RequestError
from omniloop.request import EventKind
from omniloop.runtime import Runtime
from omniloop.testing import make_manager
from omniloop_fbcache import plugin as fbcache_plugin
from omniloop_scheduler import plugin as scheduler_plugin
from omniloop_wan import plugin as wan_plugin
from omniloop_wan.causal.pipeline import CausalDeployment
from omniloop_wan.stages import encode_text, to_uint8_frames

ROLLOUT = {"chunk_frames": 3, "steps": 2, "kv_slabs": 8, "max_sessions": 2}


def _runtime(path, **rollout: Any) -> Runtime:
    opts = {"rollout": "causal", "rollout_options": {**ROLLOUT, **rollout}}
    return Runtime.from_model(path, manager=make_manager(("wan", wan_plugin), toy=False), options=opts)


def _req(prompt: str, frames: int, seed: int = 3, **node: Any) -> dict[str, Any]:
    r: dict[str, Any] = {"task": "t2v", "prompt": prompt, "diffusion": {"frames": frames, "seed": seed},
                         "outputs": {"stream_partial": True}}
    if node:
        r["node_params"] = {"rollout": node}
    return r


@pytest.fixture(scope="module")
def rt(tiny_wan) -> Runtime:
    return _runtime(tiny_wan)


def _error(rt: Runtime, req: dict[str, Any]) -> str:
    """The message of the request's ERROR event (errors raised by nodes are streamed, not raised)."""
    try:
        events = list(rt.stream(req))
    except RequestError as exc:  # refused by Runtime.prepare
        return str(exc)
    errs = [e.message for e in events if e.kind is EventKind.ERROR]
    assert errs, "expected an error event"
    assert not any(e.kind is EventKind.PARTIAL for e in events)
    return str(errs[0])


def _dep(rt: Runtime) -> CausalDeployment:
    return rt.model.config["causal"]




def test_chunks_stream_as_partial_events(rt):
    events = list(rt.stream(_req("a red fox runs", frames=33)))  # 9 latent frames = 3 chunks
    parts = [e for e in events if e.kind is EventKind.PARTIAL]
    assert [e.artifact for e in parts] == ["video_chunk"] * 3
    assert [e.value.frames.shape[0] for e in parts] == [9, 12, 12]
    final = next(e for e in events if e.kind is EventKind.FINAL).output
    video = final.artifacts["video"].frames
    assert video.shape == (33, 32, 32, 3) and video.dtype == torch.uint8
    assert torch.equal(torch.cat([e.value.frames for e in parts]), video)
    eng, _ = _dep(rt).engine(32, 32)
    assert eng.manager.used_blocks == 0 and eng.manager.sequences == 0  # the request's slabs are back
    eng.manager.check()
    # the same frames as the engine driven by hand (same seed, the text encoder's prompt states)
    comps = rt.model.components
    text, _ = encode_text(comps["tokenizer"], comps["text_encoder"], "a red fox runs", torch.device("cpu"), torch.float32)
    stream = eng.open_stream(seed=3)
    by_hand = torch.cat([to_uint8_frames(o.video) for o in eng.run(stream, text, 3)])
    stream.free()
    assert torch.equal(by_hand, video)


def test_session_continues_with_a_new_prompt(rt):
    out1 = rt.generate(_req("a red fox runs", frames=9, keep_session=True))
    sid = out1.metrics["session"]
    eng, store = _dep(rt).engine(32, 32)
    assert len(store) == 1 and eng.manager.used_blocks == 1
    out2 = rt.generate(_req("a blue bird flies", frames=9, session=sid))
    assert out2.artifacts["video"].frames.shape[0] == 12  # a later chunk: 4 frames per latent frame
    assert eng.manager.used_blocks == 2 and store.get(sid).chunks == 2
    # one request over both prompts (the engine's schedule) gives the same frames
    assert store.close(sid) and eng.manager.used_blocks == 0
    msg = _error(rt, _req("a cat", frames=9, session=sid))
    assert "node_params.rollout.session" in msg and "unknown or expired" in msg


def test_bad_frames_and_options_are_refused(rt, tiny_wan):
    msg = _error(rt, _req("a fox", frames=13))
    assert "diffusion.frames" in msg and "whole chunks" in msg
    with pytest.raises(RequestError, match=r"node_params\.rollout\.session"):  # refused by prepare (the schema)
        rt.prepare(_req("a fox", frames=9, session="../../etc/passwd"))
    with pytest.raises(DeployError, match=r"options\.rollout_options\.chunk"):
        _runtime(tiny_wan, chunk=3)
    with pytest.raises(DeployError, match=r"options\.rollout_options\.steps"):
        _runtime(tiny_wan, steps=0)


def _step_runtime(path) -> Runtime:
    manager = make_manager(("wan", wan_plugin), ("scheduler", scheduler_plugin), toy=False, scheduler=False)
    opts = {"rollout": "causal", "rollout_options": ROLLOUT}
    return Runtime.from_model(path, manager=manager, options=opts, scheduler="step")


@pytest.mark.parametrize("keep_session", [False, True])
def test_cancel_mid_stream_frees_the_slabs(tiny_wan, keep_session):
    rt = _step_runtime(tiny_wan)
    s = rt.stream(_req("a red fox runs", frames=33, keep_session=keep_session))  # 3 chunks
    got = 0
    for ev in s:
        if ev.kind is EventKind.PARTIAL:
            got += 1
            break
    eng, store = _dep(rt).engine(32, 32)
    assert got == 1 and eng.manager.used_blocks == 1 and eng.manager.reserved_blocks == 2
    assert len(store) == int(keep_session)
    s.close()  # the client went away mid-stream: the step scheduler cancels and releases the loop
    assert eng.manager.used_blocks == 0 and eng.manager.reserved_blocks == 0 and eng.manager.sequences == 0
    assert len(store) == 0  # a kept session cancelled mid-stream is closed too
    eng.manager.check()


def test_a_session_continued_twice_equals_one_request_of_the_concatenated_schedule(tiny_wan):
    rt = _runtime(tiny_wan)
    prompts = [("a red fox runs", 21), ("a blue bird flies", 9), ("a cat sits in the snow", 21)]  # 2 + 1 + 2 chunks
    first = rt.generate(_req(prompts[0][0], frames=prompts[0][1], seed=9, keep_session=True))
    sid = first.metrics["session"]
    videos = [first.artifacts["video"].frames]
    for prompt, frames in prompts[1:]:
        out = rt.generate(_req(prompt, frames=frames, seed=123, session=sid))  # the session's seed is kept
        assert out.metrics["session"] == sid
        videos.append(out.artifacts["video"].frames)
    assert [v.shape[0] for v in videos] == [21, 12, 24]
    eng, store = _dep(rt).engine(32, 32)
    assert store.get(sid).chunks == 5 and eng.manager.used_blocks == 5
    store.close(sid)
    assert eng.manager.used_blocks == 0
    # one stream over the concatenated schedule (prompt, chunks), with the text encoder's states
    comps = rt.model.components
    sched = [(encode_text(comps["tokenizer"], comps["text_encoder"], p, torch.device("cpu"), torch.float32)[0], n)
             for p, n in zip([p for p, _ in prompts], [2, 1, 2], strict=True)]
    stream = eng.open_stream(seed=9)
    whole = torch.cat([to_uint8_frames(o.video) for o in eng.run_schedule(stream, sched)])
    stream.free()
    assert torch.equal(torch.cat(videos), whole)
    eng.manager.check()


def test_interleaved_causal_requests_each_equal_themselves_alone(tiny_wan):
    rt = _step_runtime(tiny_wan)
    alone = [rt.generate(_req(p, frames=33, seed=s)).artifacts["video"].frames
             for p, s in (("a red fox runs", 1), ("a blue bird flies", 2))]
    a = rt.stream(_req("a red fox runs", frames=33, seed=1))
    b = rt.stream(_req("a blue bird flies", frames=33, seed=2))
    order, finals = [], {}
    pending = {"a": a, "b": b}
    while pending:  # alternate one event of each stream: the pool interleaves their chunk steps
        for name in list(pending):
            ev = next(pending[name], None)
            if ev is None:
                del pending[name]
                continue
            if ev.kind is EventKind.PARTIAL:
                order.append(name)
            if ev.output is not None:
                finals[name] = ev.output.artifacts["video"].frames
    assert order.count("a") == order.count("b") == 3 and order != ["a"] * 3 + ["b"] * 3
    assert torch.equal(finals["a"], alone[0]) and torch.equal(finals["b"], alone[1])
    eng, _ = _dep(rt).engine(32, 32)
    assert eng.manager.sequences == 0 and eng.manager.used_blocks == 0


def test_an_interceptor_is_refused_not_ignored(tiny_wan):
    manager = make_manager(("wan", wan_plugin), ("fbcache", fbcache_plugin), toy=False)
    rt = Runtime.from_model(tiny_wan, manager=manager, plugins={"fbcache": {}},
                            options={"rollout": "causal", "rollout_options": ROLLOUT})
    with pytest.raises(DeployError, match=r"plugins\.fbcache: .*rollout: causal"):
        rt.generate(_req("a fox", frames=9))


def test_steps_and_shift_of_the_request_drive_the_chunk_schedule_and_a_lone_negative_prompt_warns(rt):
    req = _req("a red fox runs", frames=9, seed=5)
    req["diffusion"].update(steps=3, shift=2.0, guidance_scale=1.0)
    req["negative_prompt"] = "blurry"
    out = rt.generate(req)
    assert any("without CFG" in w and "negative_prompt" in w for w in out.metrics["warnings"])
    eng, _ = _dep(rt).engine(32, 32)
    comps = rt.model.components
    text, _ = encode_text(comps["tokenizer"], comps["text_encoder"], "a red fox runs", torch.device("cpu"), torch.float32)
    s = eng.open_stream(seed=5)
    want = to_uint8_frames(next(eng.run(s, text, 1, steps=3, shift=2.0)).video)
    s.free()
    assert torch.equal(out.artifacts["video"].frames, want)
    bad = _req("a fox", frames=9)
    bad["diffusion"]["shift"] = 1000.0
    assert "diffusion.shift" in _error(rt, bad)


def test_more_chunks_than_the_pool_holds_are_refused_not_queued_forever(tiny_wan):
    rt = _step_runtime(tiny_wan)  # kv_slabs 8, no window: a 9-chunk request cannot fit
    msg = _error(rt, _req("a fox", frames=105))  # 27 latent frames = 9 chunks
    assert "diffusion.frames" in msg and "8" in msg and "window" in msg
    out = rt.generate(_req("a fox", frames=9, keep_session=True))  # a session of 1 chunk ...
    msg = _error(rt, _req("a fox", frames=93, session=out.metrics["session"]))  # ... + 8 more = 9
    assert "9 chunks need 9 slabs" in msg
    eng, store = _dep(rt).engine(32, 32)
    store.close(out.metrics["session"])
    assert eng.manager.used_blocks == 0
