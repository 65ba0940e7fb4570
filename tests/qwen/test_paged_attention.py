"""The paged-attention kernel (``omniloop_qwen.paged_attention``) and the ``paged_attention`` deploy option.

* Always: ``CacheManager.block_tables`` agrees with ``slot_table`` (after fork and drop_front); the
  torch reference equals dense attention per row; the option's values and refusals.
* When ``triton`` imports: the Triton kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``;
  in a child pytest process unless this one started with it: the interpreter needs the variable set
  before ``triton`` is first imported, and other tests may import it earlier) against the torch reference — float32 within 2e-5 absolute (float32 scores and softmax, IEEE
  dots; the order of the sums differs), bfloat16 within 2e-2 (P is rounded to bf16 before P·V and
  the output to bf16: about one bf16 ulp of an O(1) value) — and a runtime deployed with
  ``paged_attention: triton`` on CPU float32 (interpreted) decodes greedily token-exact vs
  transformers ``generate``, alone, with chunked prefill and batched.
* CUDA only: the compiled kernel vs the torch reference, and greedy tokens vs transformers.
"""

from __future__ import annotations

import pytest
import torch

from omniloop.errors import DeployError
from omniloop.request import Status
from omniloop.testing.pytest_plugin import HAS_TRITON, interpreted
from omniloop.testing.pytest_plugin import IN_TRITON_INTERPRETER as IN_INTERPRETER
from omniloop_kvcache import CacheManager, KVLayout
from omniloop_qwen import paged_attention as pa

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the kernel tests need it; "
                                                           "pip install triton to run them in its CPU interpreter)")
needs_cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _cache(hkv: int, d: int, bs: int, num_blocks: int, dtype: torch.dtype, device: str = "cpu") -> CacheManager:
    cache = CacheManager(KVLayout(layers=1, kv_heads=hkv, head_dim=d, dtype=dtype, device=device),
                         block_size=bs, num_blocks=num_blocks)
    g = torch.Generator(device="cpu").manual_seed(0)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g).to(dtype))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g).to(dtype))
    return cache


def _scenario(cache: CacheManager):
    """Sequences with scattered blocks, a fork sharing blocks, one after drop_front with a sink;
    each then gets new tokens (1 = a decode row, more = a causal prefill chunk)."""
    bs = cache.block_size
    filler = cache.allocate(3 * bs)  # so the others' blocks do not start at 0
    a = cache.allocate()
    cache.append(a, 5 * bs + 3)
    b = cache.allocate()
    cache.append(b, 2)
    cache.free(filler)
    c = cache.fork(a)
    d = cache.allocate()
    cache.append(d, 6 * bs)
    cache.drop_front(d, 3, keep=1)
    e = cache.allocate()
    handles, new = [a, b, c, d, e], [1, 7, 1, 3, 4]
    for h, n in zip(handles, new, strict=True):
        cache.append(h, n)
    return handles, new


def _inputs(cache: CacheManager, handles, new, hq: int, device: str = "cpu"):
    table, held = cache.block_tables(handles)
    row_seq, kv_lens = pa.attention_rows(held.tolist(), new)
    g = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randn(len(row_seq), hq, cache.layout.head_dim, generator=g).to(cache.layout.dtype).to(device)
    meta = torch.tensor([row_seq, kv_lens], dtype=torch.int32, device=device)
    return q, table.to(device), meta[1], meta[0]


def test_block_tables_agree_with_slot_table() -> None:
    cache = _cache(2, 8, 4, 64, torch.float32)
    handles, _ = _scenario(cache)
    table, held = cache.block_tables(handles)
    slots, lengths = cache.slot_table(handles)
    assert table.dtype == held.dtype == torch.int32
    assert held.tolist() == lengths.tolist()
    for i in range(len(handles)):
        pos = torch.arange(int(held[i]))
        from_table = table[i].long()[pos // 4] * 4 + pos % 4
        assert torch.equal(from_table, slots[i, : int(held[i])])
    assert cache.block_tables([])[0].shape == (0, 0)


def test_attention_rows_are_causal_prefixes() -> None:
    assert pa.attention_rows([5, 1, 9], [1, 1, 3]) == ([0, 1, 2, 2, 2], [5, 1, 7, 8, 9])


def test_torch_reference_equals_dense_attention_per_row() -> None:
    cache = _cache(2, 16, 4, 64, torch.float32)
    handles, new = _scenario(cache)
    q, table, kv_lens, row_seq = _inputs(cache, handles, new, hq=6)
    out = pa.paged_attention_torch(q, cache.k[0], cache.v[0], table, kv_lens, row_seq, block_size=4, scale=0.25)
    slots, _ = cache.slot_table(handles)
    for r in range(q.shape[0]):
        s_ = slots[int(row_seq[r]), : int(kv_lens[r])]
        k = cache.k[0][s_].repeat_interleave(3, dim=1)  # [L, Hq, D]
        v = cache.v[0][s_].repeat_interleave(3, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[r], k) * 0.25, dim=-1)
        torch.testing.assert_close(out[r], torch.einsum("hl,lhd->hd", p, v), rtol=1e-6, atol=1e-6)


# -- the kernel in Triton's CPU interpreter ------------------------------------------------------

CASES = [  # (q heads, kv heads, head dim, block size, dtype, context splits)
    (4, 2, 16, 4, torch.float32, None),  # the tiny checkpoints' shape
    (14, 2, 64, 16, torch.float32, None),  # Qwen2.5-0.5B's heads (7 query heads per KV head)
    (14, 2, 64, 16, torch.float32, 3),  # ... split-K: 3 partials merged
    (3, 3, 24, 8, torch.float32, 2),  # no GQA, a head dim that is not a power of two
    (14, 2, 64, 16, torch.bfloat16, None),
    (14, 2, 64, 16, torch.bfloat16, 3),
]


@interpreted
@pytest.mark.parametrize(("hq", "hkv", "d", "bs", "dtype", "splits"), CASES)
def test_kernel_matches_torch_reference_interpreted(interpret, hq, hkv, d, bs, dtype, splits) -> None:
    cache = _cache(hkv, d, bs, 96, dtype)
    handles, new = _scenario(cache)
    # a longer sequence, so split-K has several BLOCK_N tiles to cut
    long = cache.allocate()
    cache.append(long, 2 * pa.BLOCK_N + 5)
    handles, new = [*handles, long], [*new, 1]
    if splits:  # split-K on two decode rows (a forked sequence, the long one): the interpreter is slow per program
        handles, new = [handles[2], long], [1, 1]
    q, table, kv_lens, row_seq = _inputs(cache, handles, new, hq=hq)
    kw = {"block_size": bs, "scale": d**-0.5}
    ref = pa.paged_attention_torch(q, cache.k[0], cache.v[0], table, kv_lens, row_seq, **kw)
    out = pa.paged_attention(q, cache.k[0], cache.v[0], table, kv_lens, row_seq, splits=splits, **kw)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref.float()).abs().max().item() <= tol


def _greedy(rt, req, prompt: str, n: int) -> list[int]:
    out = rt.generate(req(prompt, max_tokens=n))
    assert out.status is Status.COMPLETED, out.error
    return out.artifacts["text"].token_ids


@interpreted
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_runtime_with_the_kernel_matches_transformers_interpreted(
    interpret, arch, tiny_qwen, runtime_at, hf_reference, req, prompts,
) -> None:
    rt = runtime_at(tiny_qwen(arch), options={"paged_attention": "triton", "prefill_chunk": 5, "kv_block_size": 4})
    assert rt.model.config["paged_attention"] == "triton" and rt.model.components["paged"].attention == "triton"
    tok = rt.model.components["tokenizer"]
    prompt = prompts[2] if arch == "qwen2" else prompts[0]  # several 5-token chunks over 4-token blocks; one chunk
    assert _greedy(rt, req, prompt, 8) == hf_reference(arch, tok(prompt)["input_ids"], 8), prompt
    cache = rt.model.components["kv_cache"]
    cache.check()
    assert cache.used_blocks == 0 and cache.sequences == 0


@interpreted
def test_batched_decode_with_the_kernel_each_equals_alone_interpreted(
    interpret, tiny_qwen, runtime_at, hf_reference, req, prompts,
) -> None:
    rt = runtime_at(tiny_qwen("qwen2"), scheduler="step", scheduler_options={"max_batch": 8},
                    options={"paged_attention": "triton"})
    tok = rt.model.components["tokenizer"]
    streams = [rt.stream(req(p, max_tokens=4 + 2 * i)) for i, p in enumerate(prompts)]
    outs = [[e for e in s if e.output is not None][-1].output for s in streams]
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.status is Status.COMPLETED, out.error
        assert out.artifacts["text"].token_ids == hf_reference("qwen2", tok(p)["input_ids"], 4 + 2 * i), p
    sizes = [len(d.request_ids) for d in rt.scheduler.trace if d.action == "batched_step"]
    assert max(sizes) == len(prompts)


@interpreted
def test_decode_graph_inputs_match_the_eager_step_interpreted(interpret, tiny_qwen, graphed_vs_eager) -> None:
    """DecodeGraphs' static inputs (buckets, padding rows, block table columns, a growing context
    crossing buckets) give the eager triton step's tokens and logits: the graph is replaced by an
    eager replay of ``decode_static`` (CPU), everything else is the CUDA path's code."""
    from transformers import AutoModelForCausalLM

    from omniloop_qwen import model as qm

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen("qwen3"), dtype=torch.float32).eval()
    eager, graphed = qm.PagedQwen(hf, attention="triton"), qm.PagedQwen(hf, attention="triton")
    graphs = graphed_vs_eager(eager, graphed, steps=8)
    assert graphs.replays == 8 and graphs.captures == 2  # 3 rows -> bucket 4; contexts 16, then 32


@interpreted
def test_kernel_with_padded_tables_at_block_edges_interpreted(interpret) -> None:
    """The shapes the runtime makes, on the kernel: batch-1 decode after a short prefill, a table
    wider than a sequence's blocks (padded with -1: never read, and clamped into the pool if it
    were), lengths an exact multiple of the block size and one past it, causal prefill rows."""
    bs = 4
    cache = _cache(2, 16, bs, 24, torch.float32)
    a, b, c = cache.allocate(), cache.allocate(), cache.allocate()
    cache.append(a, 3)  # a short prompt's prefill
    cache.append(b, 2 * bs - 1)
    cache.append(c, 5 * bs)
    for handles, new in (([a], [1]), ([a, b, c], [1, 1, 1]), ([a, b, c], [1, 1, 1]), ([b], [3])):
        for h, n in zip(handles, new, strict=True):
            cache.append(h, n)
        table, held = cache.block_tables(handles, pad=-1)
        row_seq, kv_lens = pa.attention_rows(held.tolist(), new)
        q = torch.randn(len(row_seq), 4, 16, generator=torch.Generator().manual_seed(len(row_seq)))
        meta = torch.tensor([row_seq, kv_lens], dtype=torch.int32)
        pa.check_bounds(q, cache.k[0], cache.v[0], table, meta[1], meta[0], block_size=bs)
        kw = {"block_size": bs, "scale": 0.25}
        ref = pa.paged_attention_torch(q, cache.k[0], cache.v[0], table.clamp(min=0), meta[1], meta[0], **kw)
        out = pa.paged_attention(q, cache.k[0], cache.v[0], table, meta[1], meta[0], **kw)
        assert (out - ref).abs().max().item() <= 2e-5, (held.tolist(), new)
    assert held.tolist() == [3 * bs] and cache.length(c) == 5 * bs + 2  # b ends on an exact multiple; c one block + 2 past


@needs_triton
@pytest.mark.skipif(IN_INTERPRETER, reason="this process is the interpreter run")
def test_interpreted_tests_in_a_child_process(run_interpreted_child) -> None:
    """The ``*_interpreted`` tests above, in a fresh pytest process started with TRITON_INTERPRET=1."""
    run_interpreted_child(__file__)


# -- the deploy option ---------------------------------------------------------------------------


def test_option_auto_is_torch_on_cpu_and_bad_values_are_refused(tiny_qwen, runtime_at, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = tiny_qwen("qwen2")
    rt = runtime_at(path)
    assert rt.model.config["paged_attention"] == "torch" and rt.model.components["paged"].attention == "torch"
    with pytest.raises(DeployError, match=r"options\.paged_attention: must be one of auto, torch, triton, got 'flash'"):
        runtime_at(path, options={"paged_attention": "flash"})
    with pytest.raises(DeployError, match=r"options\.paged_attention: 'triton' cannot run: "):
        runtime_at(path, options={"paged_attention": "triton"})  # CPU, no interpreter
    with pytest.raises(DeployError, match=r"options\.decode_cuda_graphs: needs a CUDA device and paged_attention triton"):
        runtime_at(path, options={"decode_cuda_graphs": True})
    with pytest.raises(DeployError, match=r"options\.decode_cuda_graphs: must be true or false, got 'yes'"):
        runtime_at(path, options={"decode_cuda_graphs": "yes"})


def test_resolve_backend() -> None:
    assert pa.resolve_backend("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="must be one of"):
        pa.resolve_backend("xformers", "cpu")
    if not HAS_TRITON:
        with pytest.raises(ValueError, match="'triton' package is not installed"):
            pa.resolve_backend("triton", "cpu")


# -- CUDA ----------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch_reference_cuda(monkeypatch, dtype) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for hq, hkv, d, bs in ((14, 2, 64, 16), (16, 8, 128, 16), (6, 6, 24, 8)):
        cache = _cache(hkv, d, bs, 512, dtype, device="cuda")
        handles, new = _scenario(cache)
        long = cache.allocate()
        cache.append(long, 1500)
        handles, new = [*handles, long], [*new, 1]
        q, table, kv_lens, row_seq = _inputs(cache, handles, new, hq=hq, device="cuda")
        kw = {"block_size": bs, "scale": d**-0.5}
        ref = pa.paged_attention_torch(q, cache.k[0], cache.v[0], table, kv_lens, row_seq, **kw)
        for splits in (None, 1, 7):
            out = pa.paged_attention(q, cache.k[0], cache.v[0], table, kv_lens, row_seq, splits=splits, **kw)
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            assert (out.float() - ref.float()).abs().max().item() <= tol, (hq, hkv, d, bs, splits)


@needs_cuda
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_cuda_runtime_kernel_vs_torch_and_transformers(monkeypatch, arch, tiny_qwen, runtime_at, req, prompts) -> None:
    """float32 on CUDA: the kernel (auto) and the torch path give transformers' greedy tokens; the
    decode graphs, unfused (``decode_fused: false``) and fused (graphs' default), the kernel's."""
    from transformers import AutoModelForCausalLM

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = tiny_qwen(arch)
    kern = runtime_at(path, device="cuda", scheduler="step", scheduler_options={"max_batch": 8})
    ref_rt = runtime_at(path, device="cuda", options={"paged_attention": "torch"})
    graphs = runtime_at(path, device="cuda", scheduler="step", scheduler_options={"max_batch": 8},
                        options={"decode_cuda_graphs": True, "decode_fused": False})
    fused = runtime_at(path, device="cuda", scheduler="step", scheduler_options={"max_batch": 8},
                       options={"decode_cuda_graphs": True})
    assert kern.model.config["paged_attention"] == "triton"
    assert graphs.model.components["paged"].fused is None and fused.model.components["paged"].fused is not None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    tok = kern.model.components["tokenizer"]
    streams = [kern.stream(req(p, max_tokens=12)) for p in prompts]
    outs = [[e for e in s if e.output is not None][-1].output for s in streams]
    g_streams = [graphs.stream(req(p, max_tokens=12)) for p in prompts]
    g_outs = [[e for e in s if e.output is not None][-1].output for s in g_streams]
    f_streams = [fused.stream(req(p, max_tokens=12)) for p in prompts]
    f_outs = [[e for e in s if e.output is not None][-1].output for s in f_streams]
    assert graphs.model.components["paged"].graphs.replays > 0 and fused.model.components["paged"].graphs.replays > 0
    for p, out, g_out, f_out in zip(prompts, outs, g_outs, f_outs, strict=True):
        assert out.status is Status.COMPLETED, out.error
        assert g_out.status is Status.COMPLETED, g_out.error
        assert f_out.status is Status.COMPLETED, f_out.error
        assert g_out.artifacts["text"].token_ids == out.artifacts["text"].token_ids, p
        assert f_out.artifacts["text"].token_ids == out.artifacts["text"].token_ids, p
        ids = torch.tensor([tok(p)["input_ids"]], device="cuda")
        with torch.no_grad():
            want = hf.generate(ids, do_sample=False, max_new_tokens=12)[0, ids.shape[1]:].tolist()
        assert out.artifacts["text"].token_ids == want, p
        assert _greedy(ref_rt, req, p, 12) == want, p
