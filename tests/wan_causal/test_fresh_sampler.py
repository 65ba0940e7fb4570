"""``rollout_options.sampler: "fresh"`` (issue 41): each step of a chunk but the last predicts x0
and re-noises it to the next sigma with fresh noise (DMD2 / Self-Forcing's few-step sampler),
the noise from a CPU generator seeded by (seed, chunk, step). The cached rollout equals the
uncached reference under it, as under Euler (same tolerance and reason as ``test_rollout.py``),
through sessions and the runtime."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.errors import DeployError
from omniloop.request import EventKind
from omniloop.runtime import Runtime
from omniloop.testing import make_manager
from omniloop_kit.causal import causal_step, chunk_noise, step_noise
from omniloop_wan import plugin as wan_plugin
from omniloop_wan.causal import CausalOptions, CausalWan, SessionStore, chunk_forward
from omniloop_wan.stages import encode_text, to_uint8_frames

from .conftest import other_text

ATOL = RTOL = 1e-5  # cached slabs vs the masked full sequence: see test_rollout.py


def _engine(transformer, vae=None, **kw: Any) -> CausalWan:
    opts = CausalOptions(**{"chunk_frames": 3, "steps": 3, "kv_slabs": 16, "sampler": "fresh", **kw})
    return CausalWan(transformer, vae, options=opts, height=32, width=32)


def _latents(eng: CausalWan, text: torch.Tensor, chunks: int, seed: int, **kw: Any) -> torch.Tensor:
    s = eng.open_stream(seed, cfg="uncond" in kw)
    try:
        return torch.cat([o.latents for o in eng.run(s, text, chunks, decode=False, **kw)], dim=2)
    finally:
        s.free()


def test_step_noise_is_per_seed_chunk_and_step():
    shape = (1, 16, 3, 4, 4)
    a = step_noise(5, 1, 0, shape)
    assert a.dtype == torch.float32 and a.shape == shape and torch.equal(a, step_noise(5, 1, 0, shape))
    others = [step_noise(5, 1, 1, shape), step_noise(5, 2, 0, shape), step_noise(6, 1, 0, shape), chunk_noise(5, 1, shape)]
    assert all(not torch.equal(a, o) for o in others)
    x, v = torch.randn(shape), torch.randn(shape)
    assert torch.equal(causal_step(x, v, 0.8, 0.5), x + (0.5 - 0.8) * v)
    assert torch.equal(causal_step(x, v, 0.8, 0.5, a), (1 - 0.5) * (x - 0.8 * v) + 0.5 * a)


def test_fresh_is_the_hand_written_sampler_and_differs_from_euler_after_step_one(transformer, text):
    eng = _engine(transformer, chunk_frames=1, steps=2)
    got = _latents(eng, text, 1, seed=4)
    s0, s1, _ = eng.options.sigmas()
    with torch.no_grad():
        x = chunk_noise(4, 0, eng.chunk_shape())
        v = chunk_forward(transformer, x, torch.full((1,), s0 * 1000.0), text, 0)
        x = (1 - s1) * (x - s0 * v) + s1 * step_noise(4, 0, 0, x.shape)
        want = x - s1 * chunk_forward(transformer, x, torch.full((1,), s1 * 1000.0), text, 0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    euler = CausalWan(transformer, options=CausalOptions(chunk_frames=1, steps=2, kv_slabs=16), height=32, width=32)
    assert not torch.allclose(got, _latents(euler, text, 1, seed=4), atol=1e-4)
    # one step per chunk: nothing to re-noise, the same as Euler bit for bit
    one = [CausalWan(transformer, options=CausalOptions(chunk_frames=1, steps=1, kv_slabs=16, sampler=s), height=32,
                     width=32) for s in ("fresh", "euler")]
    assert torch.equal(*(_latents(e, text, 2, seed=4) for e in one))


def test_deterministic_per_seed(transformer, text):
    eng = _engine(transformer)
    a = _latents(eng, text, 2, seed=9)
    assert torch.equal(a, _latents(eng, text, 2, seed=9))
    assert not torch.allclose(a, _latents(eng, text, 2, seed=10), atol=1e-3)


@pytest.mark.parametrize(("window", "sink", "chunks", "cfg"),
                         [(None, 0, 3, False), (2, 1, 4, False), (None, 0, 3, True), (2, 1, 3, True)])
def test_cached_rollout_equals_the_reference(transformer, text, window, sink, chunks, cfg):
    eng = _engine(transformer, window=window, sink=sink)
    kw = {"uncond": other_text(transformer, 40), "guidance": 4.0} if cfg else {}
    cached = _latents(eng, text, chunks, seed=11, **kw)
    torch.testing.assert_close(cached, eng.reference(text, chunks, seed=11, **kw), atol=ATOL, rtol=RTOL)
    assert eng.manager.used_blocks == 0


def test_image_conditioned_fresh_rollout_equals_the_reference(transformer, vae, text):
    from omniloop_wan.causal import encode_first_frame

    eng = _engine(transformer, vae)
    first = encode_first_frame(vae, torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1)
    s = eng.open_stream(seed=3, first_latents=first)
    cached = torch.cat([o.latents for o in eng.run(s, text, 2, decode=False)], dim=2)
    s.free()
    torch.testing.assert_close(cached, eng.reference(text, 2, seed=3, first_latents=first), atol=ATOL, rtol=RTOL)
    assert torch.equal(cached[:, :, :1], first)


def test_a_session_continued_equals_one_request(transformer, text):
    eng = _engine(transformer, chunk_frames=1)
    texts, counts = [text, other_text(transformer, 8)], [2, 2]
    one = eng.open_stream(seed=21)
    whole = list(eng.run_schedule(one, list(zip(texts, counts, strict=True)), decode=False))
    one.free()
    store = SessionStore(eng)
    sid = store.create(seed=21).id
    parts = [o for t, n in zip(texts, counts, strict=True) for o in store.generate(sid, t, n, decode=False)]
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(parts, whole, strict=True))
    store.close(sid)


def _runtime(path, **rollout: Any) -> Runtime:
    opts = {"rollout": "causal", "rollout_options": {"chunk_frames": 3, "steps": 2, "kv_slabs": 8, **rollout}}
    return Runtime.from_model(path, manager=make_manager(("wan", wan_plugin), toy=False), options=opts)


def test_the_runtime_serves_it_and_refuses_a_bad_sampler_at_load(tiny_wan):
    rt = _runtime(tiny_wan, sampler="fresh")
    req = {"task": "t2v", "prompt": "a red fox runs", "outputs": {"stream_partial": True},
           "diffusion": {"frames": 9, "seed": 3, "height": 32, "width": 32}}
    events = list(rt.stream(req))
    assert events[-1].kind is EventKind.FINAL and events[-1].output.ok
    got = torch.cat([e.value.frames for e in events if e.kind is EventKind.PARTIAL])
    c = rt.model.components
    text = encode_text(c["tokenizer"], c["text_encoder"], "a red fox runs", torch.device("cpu"), torch.float32)[0]
    opts = rt.model.config["causal"].options
    assert opts.sampler == "fresh"
    eng = CausalWan(c["transformer"], c["vae"], options=opts, height=32, width=32)
    s = eng.open_stream(3)
    want = torch.cat([to_uint8_frames(o.video) for o in eng.run(s, text, 1)])
    s.free()
    assert torch.equal(got, want)
    euler = list(_runtime(tiny_wan).stream(req))
    assert not torch.equal(torch.cat([e.value.frames for e in euler if e.kind is EventKind.PARTIAL]), got)
    with pytest.raises(DeployError) as exc:
        _runtime(tiny_wan, sampler="ddim")
    msg = str(exc.value)
    assert "\n" not in msg and "options.rollout_options.sampler" in msg and "euler, fresh" in msg and "'ddim'" in msg
