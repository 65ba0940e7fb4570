"""Classifier-free guidance in the causal rollout: each branch attends to its own clean-chunk K/V
(its own slabs); the cached CFG rollout equals the CFG combination of two block-causal masked
full-sequence forwards (one per text), through the engine, sessions and the runtime."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.request import EventKind
from omniloop.runtime import Runtime
from omniloop.testing import make_manager
from omniloop_wan import plugin as wan_plugin
from omniloop_wan.causal import CausalOptions, CausalWan, SessionError, SessionStore
from omniloop_wan.stages import encode_text, to_uint8_frames

from .conftest import other_text

# Same tolerance and reason as test_rollout.py (cached slabs vs masked full sequence: the same
# math with keys in another order, a longer softmax with exp(-inf) terms and other matmul shapes;
# fp32 rounding at the 1e-7 level per op). CFG with g = 5 multiplies the branch difference's
# rounding by ~5 and the batch-2 forward adds its own; still well under 1e-5 over 4 steps x 4
# chunks of the 2-block tiny model.
ATOL = RTOL = 1e-5
G = 5.0


def _engine(transformer, **kw: Any) -> CausalWan:
    opts = CausalOptions(**{"chunk_frames": 3, "steps": 4, "kv_slabs": 16, **kw})
    return CausalWan(transformer, options=opts, height=32, width=32)


@pytest.mark.parametrize(("window", "sink", "chunks"), [(None, 0, 4), (2, 1, 4), (1, 0, 3)])
def test_cached_cfg_rollout_equals_masked_full_sequence_cfg(transformer, text, window, sink, chunks):
    eng = _engine(transformer, window=window, sink=sink)
    uncond = other_text(transformer, 99)  # same shape as text: one batch-2 forward per step
    stream = eng.open_stream(seed=4, reserve_chunks=chunks, cfg=True)
    assert eng.manager.reserved_blocks == 2 * eng.slabs_for(chunks)
    cached = torch.cat([o.latents for o in eng.run(stream, text, chunks, decode=False, uncond=uncond, guidance=G)], dim=2)
    ref = eng.reference(text, chunks, seed=4, uncond=uncond, guidance=G)
    torch.testing.assert_close(cached, ref, atol=ATOL, rtol=RTOL)
    # both branches hold one slab per chunk in the window
    assert stream.kv.held_chunks() == stream.kv_uncond.held_chunks() == stream.kv.held_chunks()
    # guidance matters, and the unconditional branch's own context matters
    plain = eng.reference(text, chunks, seed=4)
    assert not torch.allclose(plain, ref, atol=1e-3)
    stream.free()
    assert eng.manager.used_blocks == 0 and eng.manager.reserved_blocks == 0 and eng.manager.sequences == 0
    eng.manager.check()


def test_uncond_of_another_length_runs_two_forwards_and_equals_the_reference(transformer, text):
    eng = _engine(transformer)
    g = torch.Generator().manual_seed(5)
    uncond = torch.randn(1, 7, transformer.config.text_dim, generator=g)  # not batchable with text (16 tokens)
    stream = eng.open_stream(seed=2, cfg=True)
    cached = torch.cat([o.latents for o in eng.run(stream, text, 3, decode=False, uncond=uncond, guidance=G)], dim=2)
    stream.free()
    torch.testing.assert_close(cached, eng.reference(text, 3, seed=2, uncond=uncond, guidance=G), atol=ATOL, rtol=RTOL)


def test_default_guidance_comes_from_the_options(transformer, text):
    eng = _engine(transformer, guidance_scale=G)
    uncond = other_text(transformer, 12)
    s = eng.open_stream(seed=1, cfg=True)
    a = next(eng.run(s, text, 1, decode=False, uncond=uncond)).latents
    s.free()
    torch.testing.assert_close(a, eng.reference(text, 1, seed=1, uncond=uncond), atol=ATOL, rtol=RTOL)
    assert torch.equal(eng.reference(text, 1, seed=1, uncond=uncond), eng.reference(text, 1, seed=1, uncond=uncond, guidance=G))


def test_refusals_come_before_any_compute(transformer, text):
    eng = _engine(transformer)
    plain = eng.open_stream(seed=0)
    with pytest.raises(ValueError, match=r"guidance_scale 5 needs a stream opened with cfg=True"):
        eng.run(plain, text, 1, guidance=5.0)
    cfg = eng.open_stream(seed=0, cfg=True)
    with pytest.raises(ValueError, match=r"give the unconditional text states"):
        eng.run(cfg, text, 1, guidance=5.0)
    for bad in (float("nan"), float("inf"), -1.0, 101.0, True):
        with pytest.raises(ValueError, match=r"guidance_scale: must be a finite number in \[0, 100\]"):
            eng.run(cfg, text, 1, uncond=text, guidance=bad)
    with pytest.raises(ValueError, match=r"rollout_options\.guidance_scale"):
        CausalOptions(guidance_scale=float("nan"))
    assert plain.next_chunk == cfg.next_chunk == 0 and eng.manager.used_blocks == 0
    plain.free()
    cfg.free()


def test_a_cfg_session_continued_twice_equals_one_stream_of_the_concatenated_schedule(transformer, text):
    eng = _engine(transformer, kv_slabs=16)
    store = SessionStore(eng)
    uncond = other_text(transformer, 50)
    texts = [text, other_text(transformer, 51), other_text(transformer, 52)]
    counts = [2, 1, 1]
    s = store.create(seed=6, cfg=True)
    got = []
    for t, n in zip(texts, counts, strict=True):
        got += [o.latents for o in store.generate(s.id, t, n, decode=False, uncond=uncond, guidance=G)]
    assert eng.manager.used_blocks == 2 * 4
    whole_stream = eng.open_stream(seed=6, cfg=True)
    whole = [o.latents for o in eng.run_schedule(whole_stream, list(zip(texts, counts, strict=True)), decode=False,
                                                 uncond=uncond, guidance=G)]
    whole_stream.free()
    assert torch.equal(torch.cat(got, dim=2), torch.cat(whole, dim=2))
    # a session started without CFG cannot switch to it (its uncond branch has no slabs)
    p = store.create(seed=1)
    with pytest.raises(SessionError, match=r"needs a stream opened with cfg=True"):
        store.generate(p.id, text, 1, guidance=G)
    store.close(s.id)
    store.close(p.id)
    assert eng.manager.used_blocks == 0


# -- through the runtime ------------------------------------------------------------------------

ROLLOUT = {"chunk_frames": 3, "steps": 2, "kv_slabs": 8, "max_sessions": 2}


def _runtime(path, **rollout: Any) -> Runtime:
    opts = {"rollout": "causal", "rollout_options": {**ROLLOUT, **rollout}}
    return Runtime.from_model(path, manager=make_manager(("wan", wan_plugin), toy=False), options=opts)


def _req(prompt: str, frames: int, seed: int = 3, guidance: float | None = None, negative: str | None = None,
         **node: Any) -> dict[str, Any]:
    r: dict[str, Any] = {"task": "t2v", "prompt": prompt, "diffusion": {"frames": frames, "seed": seed},
                         "outputs": {"stream_partial": True}}
    if guidance is not None:
        r["diffusion"]["guidance_scale"] = guidance
    if negative is not None:
        r["negative_prompt"] = negative
    if node:
        r["node_params"] = {"rollout": node}
    return r


def test_runtime_cfg_request_equals_the_engine_with_the_negative_prompt(tiny_wan):
    rt = _runtime(tiny_wan)
    events = list(rt.stream(_req("a red fox runs", frames=21, guidance=G, negative="blurry")))  # 2 chunks
    out = next(e for e in events if e.kind is EventKind.FINAL).output
    assert out.ok and "warnings" not in out.metrics
    parts = [e.value.frames for e in events if e.kind is EventKind.PARTIAL]
    assert torch.equal(torch.cat(parts), out.artifacts["video"].frames)
    comps = rt.model.components
    enc = lambda p: encode_text(comps["tokenizer"], comps["text_encoder"], p, torch.device("cpu"), torch.float32)[0]  # noqa: E731
    eng, _ = rt.model.config["causal"].engine(32, 32)
    assert eng.manager.used_blocks == 0 and eng.manager.sequences == 0
    s = eng.open_stream(seed=3, cfg=True)
    want = torch.cat([to_uint8_frames(o.video) for o in eng.run(s, enc("a red fox runs"), 2, uncond=enc("blurry"), guidance=G)])
    s.free()
    assert torch.equal(out.artifacts["video"].frames, want)
    # guidance 1 is the plain rollout (no second branch, the negative prompt ignored with a warning)
    plain = rt.generate(_req("a red fox runs", frames=21, guidance=1.0, negative="blurry"))
    assert any("negative_prompt ignored" in w for w in plain.metrics["warnings"])
    assert not torch.equal(plain.artifacts["video"].frames, out.artifacts["video"].frames)


def test_runtime_default_guidance_from_rollout_options_and_sessions_keep_their_mode(tiny_wan):
    rt = _runtime(tiny_wan, guidance_scale=G)
    a = rt.generate(_req("a red fox runs", frames=9)).artifacts["video"].frames
    b = rt.generate(_req("a red fox runs", frames=9, guidance=G)).artifacts["video"].frames
    assert torch.equal(a, b)
    first = rt.generate(_req("a red fox runs", frames=9, guidance=1.0, keep_session=True))
    sid = first.metrics["session"]
    events = list(rt.stream(_req("a cat", frames=9, guidance=G, session=sid)))
    err = [e.message for e in events if e.kind is EventKind.ERROR]
    assert err and "diffusion.guidance_scale" in err[0] and "without CFG" in err[0]
    eng, store = rt.model.config["causal"].engine(32, 32)
    assert store.get(sid).chunks == 1  # refused before any compute; the session is intact
    cfg_first = rt.generate(_req("a red fox runs", frames=9, keep_session=True))  # default G: a CFG session
    sid2 = cfg_first.metrics["session"]
    assert store.get(sid2).stream.cfg and eng.manager.used_blocks == 1 + 2
    cont = rt.generate(_req("a cat", frames=9, session=sid2))
    assert cont.ok and store.get(sid2).chunks == 2 and eng.manager.used_blocks == 1 + 4
    store.close(sid)
    store.close(sid2)
    assert eng.manager.used_blocks == 0
