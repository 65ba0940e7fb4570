"""Out-of-bounds guards of the paged-attention path (issue 20: an illegal memory access on the H200).

No Triton needed: :func:`omniloop_qwen.paged_attention.check_bounds` computes on the host every
address the kernel would touch. Here every attention call of :class:`~omniloop_qwen.model.PagedQwen`'s
triton path (eager steps and the CUDA-graph path) is routed through it and then through the torch
reference, so the exact shapes the runtime produces are checked in seconds: a batch-1 decode after
the prefill of a short prompt, a table wider than a sequence's blocks, lengths an exact multiple of
the block size and one past it, chunked prefill rows. The CUDA-graph capture runs on CPU with
``torch.cuda``'s stream/graph calls faked, to check that the captured graph's static inputs outlive
the capture (a freed ``row_seq`` was the H200 crash).
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from omniloop_kvcache import CacheManager, KVLayout
from omniloop_qwen import model as qm
from omniloop_qwen import paged_attention as pa


def _pool(bs: int = 4, blocks: int = 16) -> CacheManager:
    cache = CacheManager(KVLayout(layers=1, kv_heads=2, head_dim=8), block_size=bs, num_blocks=blocks)
    g = torch.Generator().manual_seed(0)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    return cache


def _rows(cache, handles, new):
    table, held = cache.block_tables(handles)
    row_seq, kv_lens = pa.attention_rows(held.tolist(), new)
    meta = torch.tensor([row_seq, kv_lens], dtype=torch.int32)
    q = torch.randn(len(row_seq), 4, 8)
    return q, table, meta[1], meta[0]


def test_check_bounds_accepts_the_manager_tables_and_names_each_violation() -> None:
    cache = _pool()
    a, b = cache.allocate(), cache.allocate()
    cache.append(a, 8)  # exactly two blocks
    cache.append(b, 1)
    q, table, lens, seqs = _rows(cache, [a, b], [1, 1])
    got = pa.check_bounds(q, cache.k[0], cache.v[0], table, lens, seqs, block_size=4)
    assert got["max_slot"] == max(int(cache.slots(h).max()) for h in (a, b)) and got["k_cache"] < cache.k[0].numel()
    with pytest.raises(AssertionError, match="row_seq 2 is not a row of the 2-row block table"):
        pa.check_bounds(q, cache.k[0], cache.v[0], table, lens, torch.tensor([0, 2], dtype=torch.int32), block_size=4)
    with pytest.raises(AssertionError, match="kv_lens 9 needs 3 blocks, the table has 2 columns"):
        pa.check_bounds(q, cache.k[0], cache.v[0], table, torch.tensor([9, 1], dtype=torch.int32), seqs, block_size=4)
    bad = table.clone()
    bad[1, 0] = -1
    with pytest.raises(AssertionError, match="block id -1 read, the pool has 16 blocks"):
        pa.check_bounds(q, cache.k[0], cache.v[0], bad, lens, seqs, block_size=4)
    bad[1, 0] = 16
    with pytest.raises(AssertionError, match="block id 16 read"):
        pa.check_bounds(q, cache.k[0], cache.v[0], bad, lens, seqs, block_size=4)
    with pytest.raises(AssertionError, match="kv_lens 0 < 1"):
        pa.check_bounds(q, cache.k[0], cache.v[0], table, torch.tensor([0, 1], dtype=torch.int32), seqs, block_size=4)


def test_kernel_entry_refuses_index_tensors_it_would_misread() -> None:
    cache = _pool()
    a = cache.allocate()
    cache.append(a, 5)
    q, table, lens, seqs = _rows(cache, [a], [1])
    call = lambda **kw: pa.paged_attention(  # noqa: E731
        kw.get("q", q), cache.k[0], cache.v[0], kw.get("table", table), kw.get("lens", lens), kw.get("seqs", seqs),
        block_size=4, scale=1.0)
    with pytest.raises(ValueError, match=r"block_table: expected int32, got torch\.int64"):
        call(table=table.long())
    with pytest.raises(ValueError, match="kv_lens: expected int32"):
        call(lens=lens.long())
    with pytest.raises(ValueError, match=r"expected \(1,\), one per q row"):
        call(seqs=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_lens and row_seq must be contiguous"):
        call(q=torch.randn(2, 4, 8), seqs=torch.zeros(2, dtype=torch.int32),
             lens=torch.tensor([5, 0, 5, 0], dtype=torch.int32)[::2])
    with pytest.raises(ValueError, match="contiguous rows"):
        call(table=torch.zeros((2, 2), dtype=torch.int32).t()[:1])


@pytest.fixture
def checked_attention(monkeypatch):
    """PagedQwen's kernel call replaced by: check_bounds, then the torch reference (every call counted)."""
    calls: list[tuple[int, int, int]] = []

    def checked(q, k, v, table, lens, seqs, *, block_size, scale, max_len=None, splits=None, out=None):
        pa._check_index_tensors(q, k, table, lens, seqs, block_size)
        pa.check_bounds(q, k, v, table, lens, seqs, block_size=block_size)
        if max_len is not None:
            assert int(lens.max()) <= max_len, (lens.tolist(), max_len)
        calls.append((q.shape[0], table.shape[1], int(lens.min())))
        return pa.paged_attention_torch(q, k, v, table, lens, seqs, block_size=block_size, scale=scale)

    monkeypatch.setattr(qm, "paged_attention", checked)
    return calls


def _hf(tiny_qwen):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen("qwen2"), dtype=torch.float32).eval()


def test_runtime_shapes_stay_in_bounds_and_match_the_torch_path(tiny_qwen, checked_attention) -> None:
    """PagedQwen's triton path (kernel call checked then run by the reference) vs its torch path,
    step by step: batch 1 after a 3-token prefill, then a second sequence joins (the table is
    wider than the short sequence's blocks), lengths crossing block edges (exact multiple, one past),
    a chunked prefill of a long prompt beside decode rows' sequences."""
    hf = _hf(tiny_qwen)
    bs = 4
    models = [qm.PagedQwen(hf, attention="triton"), qm.PagedQwen(hf, attention="torch")]
    caches = [CacheManager(m.layout(), block_size=bs, num_blocks=32) for m in models]

    def both(handles, feeds):
        outs = [m.forward(c, hs, feeds) for m, c, hs in zip(models, caches, handles, strict=True)]
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)
        return [[int(t)] for t in outs[0].argmax(-1)]

    a = [c.allocate() for c in caches]
    tok = both([[x] for x in a], [[5, 9, 13]])  # prefill of a short prompt, batch 1
    for _ in range(6):  # lengths 4 (= one block exactly), 5 (one past), ... 9
        tok = both([[x] for x in a], tok)
    b = [c.allocate() for c in caches]
    long_prompt = list(range(20, 31))
    for i in range(0, len(long_prompt), 5):  # chunked prefill: causal rows over the chunks held so far
        both([[x] for x in b], [long_prompt[i : i + 5]])
    toks = [tok[0], [7]]
    for _ in range(6):  # batch 2: b's table row is wider than a's blocks, then the other way round
        toks = both([[x, y] for x, y in zip(a, b, strict=True)], toks)
    assert caches[0].length(a[0]) == 3 + 6 + 6 and caches[0].length(b[0]) == 11 + 6
    assert any(w > -(-n // bs) for _, w, n in checked_attention)  # a table wider than a row's own blocks
    assert {r for r, _, _ in checked_attention} >= {1, 2, 3, 5}  # decode rows, prefill rows, chunk rows


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


class _FakeGraph:
    """A CUDA graph stand-in: the capture records the decode call; replay re-runs it with the
    tensors it captured (as a real graph reads the addresses it captured)."""

    def __init__(self) -> None:
        self.fn = None

    def replay(self) -> None:
        self.fn()


def test_decode_graph_keeps_every_static_input_alive(tiny_qwen, checked_attention, monkeypatch) -> None:
    """The real ``DecodeGraphs._capture`` (torch.cuda's streams/graph faked on CPU): each tensor the
    captured ``decode_static`` reads from outside the graph (meta, row_seq) is still alive after the
    capture returns and a gc (a real graph replays their addresses: a freed row_seq, reused by the
    next small allocation, made the replayed kernel read the block table at a garbage row)."""
    monkeypatch.setattr(qm, "MIN_GRAPH_CONTEXT", 8)
    args_seen: list[weakref.ref] = []
    capturing: list[_FakeGraph] = []
    real_static = qm.PagedQwen.decode_static

    def recording_static(self, cache, meta, row_seq, max_len, splits):
        if capturing:  # the fake graph holds its inputs by weak reference only, as a real one holds addresses
            refs = (weakref.ref(meta), weakref.ref(row_seq))
            args_seen.extend(refs)

            def replay() -> None:
                m_, r_ = (ref() for ref in refs)
                assert m_ is not None and r_ is not None, "a replay read a freed static input"
                out.copy_(real_static(self, cache, m_, r_, max_len, splits))

            capturing[-1].fn = replay
        out = real_static(self, cache, meta, row_seq, max_len, splits)
        return out

    @contextlib.contextmanager
    def fake_graph(graph, **_kw):
        capturing.append(graph)
        yield
        capturing.clear()

    hf = _hf(tiny_qwen)  # (before torch.cuda is faked: transformers' imports annotate with torch.cuda.Stream)
    monkeypatch.setattr(qm.PagedQwen, "decode_static", recording_static)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)

    eager, graphed = qm.PagedQwen(hf, attention="triton"), qm.PagedQwen(hf, attention="triton")
    graphed.graphs = qm.DecodeGraphs(graphed)
    caches = [CacheManager(eager.layout(), block_size=4, num_blocks=32) for _ in range(2)]
    hs = [[c.allocate()] for c in caches]
    toks = [[int(m.forward(c, h, [[5, 9, 13]]).argmax(-1)[0])] for m, c, h in zip((eager, graphed), caches, hs, strict=True)]
    for _ in range(8):  # batch 1: contexts 4 .. 11 cross the 8-token bucket: two captures
        outs = [m.forward(c, h, [t]) for m, c, h, t in zip((eager, graphed), caches, hs, toks, strict=True)]
        gc.collect()
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)
        toks = [[int(o.argmax(-1)[0])] for o in outs]
    assert graphed.graphs.captures == 2 and graphed.graphs.replays == 8
    gc.collect()
    assert args_seen and all(r() is not None for r in args_seen), "a captured static input was freed"
    for entry in graphed.graphs.graphs.values():
        assert entry.row_seq.dtype == torch.int32 and entry.meta.shape[0] == entry.row_seq.shape[0]
