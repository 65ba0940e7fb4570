"""Sessions: continuing equals one request of the concatenated schedule; expiry, bounds, cancel."""

from __future__ import annotations

import pytest
import torch

from omniloop_wan.causal import CausalOptions, CausalWan, SessionError, SessionLimit, SessionStore
from omniloop_wan.causal.sessions import Cancelled

from .conftest import other_text


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _engine(transformer, vae=None, **kw):
    opts = CausalOptions(chunk_frames=3, steps=2, kv_slabs=kw.pop("kv_slabs", 12), **kw)
    return CausalWan(transformer, vae, options=opts, height=32, width=32)


@pytest.mark.parametrize("window", [None, 2])
def test_session_continued_twice_equals_one_request_of_the_concatenated_schedule(transformer, vae, text, window):
    texts = [text, other_text(transformer, 8), other_text(transformer, 9)]
    counts = [2, 1, 2]
    eng = _engine(transformer, vae, window=window, sink=1 if window else 0)
    one = eng.open_stream(seed=21)
    whole = list(eng.run_schedule(one, list(zip(texts, counts, strict=True))))
    one.free()

    store = SessionStore(eng)
    s = store.create(seed=21)
    parts = []
    for t, n in zip(texts, counts, strict=True):  # a request, then two follow-ups with new prompts
        parts += list(store.generate(s.id, t, n))
        assert store.get(s.id) is s and not s.busy
    assert s.chunks == 5 and s.requests == 3
    assert [p.index for p in parts] == [w.index for w in whole] == list(range(5))
    for a, b in zip(parts, whole, strict=True):
        assert torch.equal(a.latents, b.latents)
        assert torch.equal(a.video, b.video)
    # the prompt mattered: chunk 2 with the first prompt differs
    ref = eng.open_stream(seed=21)
    same_prompt = list(eng.run(ref, text, 3, decode=False))
    assert not torch.equal(same_prompt[2].latents, whole[2].latents)
    ref.free()
    assert store.close(s.id)
    eng.manager.check()
    assert eng.manager.used_blocks == 0 and eng.manager.sequences == 0


def test_cancel_mid_stream_frees_the_slabs(transformer, text):
    eng = _engine(transformer, kv_slabs=6)
    store = SessionStore(eng)
    s = store.create(seed=1, reserve_chunks=4)
    assert eng.manager.reserved_blocks == 4
    it = store.generate(s.id, text, 4, decode=False)
    next(it)
    next(it)
    assert eng.manager.used_blocks == 2 and s.busy
    assert store.cancel(s.id)  # from the client side: takes effect at the next chunk boundary
    with pytest.raises(Cancelled):
        next(it)
    eng.manager.check()
    assert eng.manager.stats()["used_blocks"] == 0 and eng.manager.reserved_blocks == 0 and eng.manager.sequences == 0
    with pytest.raises(SessionError):
        store.get(s.id)


def _first_chunk_out(transformer, text, seed, chunks):
    """A fresh engine and store, one session (``seed``) streaming ``chunks`` chunks (no decode),
    after its first chunk: ``(engine, store, session, the stream)``."""
    eng = _engine(transformer)
    store = SessionStore(eng)
    s = store.create(seed=seed)
    it = store.generate(s.id, text, chunks, decode=False)
    next(it)
    return eng, store, s, it


def test_abandoned_stream_frees_the_slabs(transformer, text):
    eng, store, _, it = _first_chunk_out(transformer, text, seed=1, chunks=3)
    it.close()  # the client went away mid-stream
    assert eng.manager.used_blocks == 0 and len(store) == 0
    eng.manager.check()


def test_sessions_are_bounded_and_expire(transformer, text):
    clock = Clock()
    eng = _engine(transformer, max_sessions=2, session_ttl_s=10.0)
    store = SessionStore(eng, clock=clock)
    a = store.create(seed=1)
    list(store.generate(a.id, text, 1, decode=False))
    clock.t = 5.0
    b = store.create(seed=2)
    with pytest.raises(SessionLimit, match="maximum of 2"):
        store.create(seed=3)
    assert eng.manager.used_blocks == 1
    clock.t = 12.0  # a: idle 11 s -> expired; b: 7 s -> alive
    c = store.create(seed=3)
    assert len(store) == 2 and eng.manager.used_blocks == 0
    with pytest.raises(SessionError, match="unknown or expired"):
        store.generate(a.id, text, 1)
    assert store.get(b.id) is b and store.get(c.id) is c
    clock.t = 100.0
    assert sorted(store.expire()) == sorted([b.id, c.id])
    assert eng.manager.sequences == 0
    eng.manager.check()


def test_one_request_at_a_time_and_bad_input(transformer, text):
    eng, store, s, it = _first_chunk_out(transformer, text, seed=0, chunks=2)
    with pytest.raises(SessionError, match="already running"):
        next(store.generate(s.id, text, 1, decode=False))
    list(it)
    with pytest.raises(ValueError, match="chunks"):
        store.generate(s.id, text, 0)
    with pytest.raises(ValueError, match="seed"):
        store.create(seed=-1)
    with pytest.raises(SessionError):
        store.get("../etc/passwd")
    store.close(s.id)
    assert eng.manager.sequences == 0
