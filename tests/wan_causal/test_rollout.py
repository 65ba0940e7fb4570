"""Causal chunk rollout: the KV-cached rollout equals the uncached block-causal reference."""

from __future__ import annotations

import pytest
import torch

from omniloop_wan.causal import CausalOptions, CausalWan, block_causal_mask, chunk_forward, chunk_visibility
from omniloop_wan.causal.model import masked_forward

# Cached vs masked full-sequence attention: the same math, but the keys are gathered in a different
# order (slab order vs sequence order), masked keys contribute exp(-inf)=0 to a longer softmax sum
# and the linear layers see a different number of rows, so fp32 rounding differs at the 1e-7
# relative level per op; over 4 steps x N chunks of a 2-block model it stays well under 1e-5.
ATOL = RTOL = 1e-5


def test_chunk_forward_without_context_is_diffusers_forward(transformer, text):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 6, 4, 4, generator=g)
    t = torch.tensor([700.0])
    with torch.no_grad():
        ours = chunk_forward(transformer, x, t, text, 0)
        ref = transformer(x, t, text, return_dict=False)[0]
    assert torch.equal(ours, ref)


def test_masked_forward_all_visible_per_token_timestep_matches_diffusers(transformer, text):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 16, 3, 4, 4, generator=g)
    s = x.shape[2] * 4
    with torch.no_grad():
        ours = masked_forward(transformer, x, torch.full((1, s), 300.0), text, torch.ones(s, s, dtype=torch.bool))
        ref = transformer(x, torch.tensor([300.0]), text, return_dict=False)[0]
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


def test_visibility():
    v = chunk_visibility(5)
    assert torch.equal(v, torch.ones(5, 5, dtype=torch.bool).tril())
    w = chunk_visibility(5, window=2, sink=1)
    assert w[4].tolist() == [True, False, False, True, True]
    assert w[2].tolist() == [True, True, True, False, False]
    m = block_causal_mask([2, 2], None, 0)
    assert m.tolist() == [[True, True, False, False]] * 2 + [[True] * 4] * 2


@pytest.mark.parametrize(("window", "sink", "chunks"), [(None, 0, 4), (2, 1, 5), (1, 0, 3), (1, 2, 4)])
def test_cached_rollout_equals_block_causal_reference(transformer, text, window, sink, chunks):
    opts = CausalOptions(chunk_frames=3, steps=4, window=window, sink=sink, kv_slabs=8)
    eng = CausalWan(transformer, options=opts, height=32, width=32)
    stream = eng.open_stream(seed=11, reserve_chunks=chunks)
    outs = list(eng.run(stream, text, chunks, decode=False))
    assert [o.index for o in outs] == list(range(chunks))
    cached = torch.cat([o.latents for o in outs], dim=2)
    ref = eng.reference(text, chunks, seed=11)
    assert cached.shape == ref.shape == (1, 16, 3 * chunks, 4, 4)
    torch.testing.assert_close(cached, ref, atol=ATOL, rtol=RTOL)
    # the rollout is not trivially context-free: dropping the context changes chunk 1
    if chunks > 1 and window != 1:
        alone = CausalWan(transformer, options=CausalOptions(chunk_frames=3, steps=4, window=1), height=32, width=32)
        s2 = alone.open_stream(seed=11)
        lone = torch.cat([o.latents for o in alone.run(s2, text, 2, decode=False)], dim=2)
        assert not torch.allclose(lone[:, :, 3:], cached[:, :, 3:6], atol=1e-4)
        s2.free()
    held = stream.kv.held_chunks()
    assert held == (chunks if window is None else min(chunks, sink + window - 1) if chunks > sink else chunks)
    eng.manager.check()
    stream.free()
    assert eng.manager.used_blocks == 0 and eng.manager.reserved_blocks == 0
    eng.manager.check()


def test_slab_written_once_per_chunk(transformer, text):
    eng = CausalWan(transformer, options=CausalOptions(chunk_frames=3, steps=2, kv_slabs=4), height=32, width=32)
    stream = eng.open_stream(seed=0)
    list(eng.run(stream, text, 3, decode=False))
    assert eng.manager.length(stream.kv.handle) == 3 * eng.tokens_per_chunk
    assert eng.manager.used_blocks == 3
    stream.free()


def test_bad_options_are_refused_with_the_field_named(transformer):
    with pytest.raises(ValueError, match="chunk_frames"):
        CausalOptions(chunk_frames=0)
    with pytest.raises(ValueError, match="shift"):
        CausalOptions(shift=float("nan"))
    with pytest.raises(ValueError, match="window"):
        CausalOptions(window=0)
    with pytest.raises(ValueError, match="height and width"):
        CausalWan(transformer, height=30, width=32)


def test_past_the_rope_table_is_refused(transformer, text):
    eng = CausalWan(transformer, options=CausalOptions(chunk_frames=16, steps=1, kv_slabs=4), height=32, width=32)
    stream = eng.open_stream(seed=0)
    list(eng.run(stream, text, 2, decode=False))
    with pytest.raises(ValueError, match="RoPE"):
        list(eng.run(stream, text, 1, decode=False))
    stream.free()
