"""The fused decode step (``omniloop_qwen.fused``; deploy ``options.decode_fused``).

* Always: the option's values and refusals.
* When ``triton`` imports, in Triton's CPU interpreter (a child pytest process started with
  ``TRITON_INTERPRET=1``, as ``test_paged_attention.py`` does), float32:
  - each kernel against the transformers module it replaces (``Qwen2RMSNorm`` with and without
    the residual add, ``q_norm``/``k_norm`` + ``apply_rotary_pos_emb`` + the cache write, SiLU·mul):
    within 1e-6 absolute (float32; the norm's sum order and rsqrt differ; exp's last bit: 1e-6
    relative for SiLU), RoPE without the norm and the V write bit-exact;
  - a runtime deployed with ``decode_fused: true`` decodes greedily token-exact vs transformers
    ``generate`` (Qwen2 and Qwen3), batched sequences each equal to themselves alone, no block leaked;
  - the fused step behind ``DecodeGraphs`` (the graph replaced by an eager replay on CPU) gives the
    unfused eager step's logits within 2e-5 and the same tokens, and the same K/V in the cache.
  (bf16 is not checked in the interpreter: its float32 -> bf16 cast truncates instead of rounding
  to nearest even, so no bf16 kernel matches torch there.)
* CUDA only: bf16 fused vs unfused decode steps — logits within 0.1 absolute (about two bf16 ulps
  of O(10) logits: merged GEMMs and the norm's float32 sum order may flip a bf16 rounding), the same
  argmax for nearly every row — and greedy tokens vs transformers in float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omniloop.errors import DeployError
from omniloop.request import Status
from omniloop.testing.pytest_plugin import HAS_TRITON, interpreted
from omniloop.testing.pytest_plugin import IN_TRITON_INTERPRETER as IN_INTERPRETER
from omniloop_kvcache import CacheManager

needs_cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")


def _hf(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


# -- the kernels, interpreted ---------------------------------------------------------------------


@interpreted
def test_norm_kernel_matches_the_module_interpreted() -> None:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from omniloop_qwen import fused

    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 96, generator=g), torch.randn(3, 96, generator=g)
    norm = Qwen2RMSNorm(96, eps=1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(96, generator=g)
    torch.testing.assert_close(fused.add_rms_norm(x, norm.weight, 1e-6), norm(x), rtol=0, atol=1e-6)
    res = r.clone()
    out = fused.add_rms_norm(x, norm.weight, 1e-6, residual=res)
    assert torch.equal(res, r + x)  # the residual stream: one float32 add, as torch's
    torch.testing.assert_close(out, norm(r + x), rtol=0, atol=1e-6)


@interpreted
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_matches_transformers_interpreted(qk_norm) -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from omniloop_qwen import fused

    hq, hkv, d, rows = 14, 2, 64, 3
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g)
    angles = torch.randn(rows, d // 2, generator=g) * 3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    qn, kn = Qwen3RMSNorm(d, eps=1e-6), Qwen3RMSNorm(d, eps=1e-6)
    qn.weight.data, kn.weight.data = 1 + 0.1 * torch.randn(d, generator=g), 1 + 0.1 * torch.randn(d, generator=g)
    k_cache, v_cache = torch.zeros(40, hkv, d), torch.zeros(40, hkv, d)
    slots = torch.tensor([7, 31, 2], dtype=torch.int32)
    q_out = fused.rope_write(qkv, cos, sin, slots, k_cache, v_cache, q_heads=hq, kv_heads=hkv, head_dim=d,
                             qk_norm=torch.stack([qn.weight, kn.weight]) if qk_norm else None, eps=1e-6)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(rows, 1, hq, d), k.view(rows, 1, hkv, d), v.view(rows, hkv, d)
    if qk_norm:
        q, k = qn(q), kn(k)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos[:, None], sin[:, None])
    tol = 1e-6 if qk_norm else 0.0  # without the norm: the same float32 products and sums
    torch.testing.assert_close(q_out, q_ref[:, :, 0], rtol=0, atol=tol)
    torch.testing.assert_close(k_cache[slots.long()], k_ref[:, :, 0], rtol=0, atol=tol)
    assert torch.equal(v_cache[slots.long()], v)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots.long()] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@interpreted
def test_silu_mul_matches_the_mlp_activation_interpreted() -> None:
    from omniloop_qwen import fused

    g = torch.Generator().manual_seed(2)
    gu = torch.randn(2, 2 * 1500, generator=g) * 4  # 1500 columns: two programs per row, the second masked
    ref = torch.nn.functional.silu(gu[:, :1500]) * gu[:, 1500:]
    # within about one float32 ulp: the interpreter's exp and torch's round their last bit differently
    torch.testing.assert_close(fused.silu_mul(gu), ref, rtol=1e-6, atol=1e-6)


# -- the runtime, interpreted ---------------------------------------------------------------------


def _greedy(rt, req, prompt: str, n: int) -> list[int]:
    out = rt.generate(req(prompt, max_tokens=n))
    assert out.status is Status.COMPLETED, out.error
    return out.artifacts["text"].token_ids


@interpreted
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_runtime_fused_matches_transformers_interpreted(arch, tiny_qwen, runtime_at, hf_reference, req, prompts) -> None:
    rt = runtime_at(tiny_qwen(arch), options={"paged_attention": "triton", "decode_fused": True, "kv_block_size": 4})
    assert rt.model.config["decode_fused"] is True and rt.model.components["paged"].fused is not None
    tok = rt.model.components["tokenizer"]
    prompt = prompts[0]
    assert _greedy(rt, req, prompt, 8) == hf_reference(arch, tok(prompt)["input_ids"], 8), prompt
    cache = rt.model.components["kv_cache"]
    cache.check()
    assert cache.used_blocks == 0 and cache.sequences == 0


@interpreted
def test_batched_fused_decode_each_equals_alone_interpreted(tiny_qwen, runtime_at, hf_reference, req, prompts) -> None:
    rt = runtime_at(tiny_qwen("qwen2"), scheduler="step", scheduler_options={"max_batch": 8},
                    options={"paged_attention": "triton", "decode_fused": True})
    tok = rt.model.components["tokenizer"]
    streams = [rt.stream(req(p, max_tokens=3 + i)) for i, p in enumerate(prompts)]
    outs = [[e for e in s if e.output is not None][-1].output for s in streams]
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.status is Status.COMPLETED, out.error
        assert out.artifacts["text"].token_ids == hf_reference("qwen2", tok(p)["input_ids"], 3 + i), p
    assert max(len(d.request_ids) for d in rt.scheduler.trace if d.action == "batched_step") == len(prompts)
    assert rt.model.components["kv_cache"].used_blocks == 0


@interpreted
def test_fused_step_behind_decode_graphs_matches_the_unfused_step_interpreted(tiny_qwen, graphed_vs_eager) -> None:
    """The fused decode step behind DecodeGraphs (the graph replayed eagerly on CPU) gives the
    unfused eager step's logits, tokens and K/V over a context crossing two graph buckets."""
    from omniloop_qwen import model as qm

    hf = _hf(tiny_qwen("qwen3"))
    eager, graphed = qm.PagedQwen(hf, attention="triton"), qm.PagedQwen(hf, attention="triton", fused=True)
    graphs = graphed_vs_eager(eager, graphed, steps=7)
    assert graphs.replays == 7 and graphs.captures == 2


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(IN_INTERPRETER, reason="this process is the interpreter run")
def test_fused_interpreted_tests_in_a_child_process(run_interpreted_child) -> None:
    """The ``*_interpreted`` tests above, in a fresh pytest process started with TRITON_INTERPRET=1."""
    run_interpreted_child(__file__)


# -- the deploy option (after the interpreted tests: it unsets TRITON_INTERPRET, and triton first imported
# without it stays out of the interpreter in this process) ---------------------------------------------


def test_option_values_are_checked(tiny_qwen, runtime_at, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = tiny_qwen("qwen2")
    with pytest.raises(DeployError, match=r"options\.decode_fused: must be true, false or 'auto', got 'yes'"):
        runtime_at(path, options={"decode_fused": "yes"})
    with pytest.raises(DeployError, match=r"options\.decode_fused: needs paged_attention triton \(paged_attention 'torch'\)"):
        runtime_at(path, options={"decode_fused": True})  # CPU: auto resolves to torch
    for options in ({}, {"decode_fused": "auto"}, {"decode_fused": False}):  # auto without graphs: off
        rt = runtime_at(path, options=options)
        assert rt.model.config["decode_fused"] is False and rt.model.components["paged"].fused is None


def test_auto_is_on_exactly_with_cuda_graphs() -> None:
    """The default (``auto``) follows ``decode_cuda_graphs`` — the combination measured on the H200
    (``decode_cuda_graphs`` itself already needs CUDA and the triton backend); ``false`` opts out."""
    from omniloop_qwen.family import resolve_fused

    assert resolve_fused("auto", graphs=True) is True and resolve_fused("auto", graphs=False) is False
    assert resolve_fused(False, graphs=True) is False and resolve_fused(True, graphs=False) is True


def test_fused_weights_share_the_modules_storage(tiny_qwen) -> None:
    """The merged q/k/v and gate/up weights are the modules' own storage (no second copy): each
    module's weight and bias is a row slice of the merged tensor, values unchanged, and transformers'
    forward over the rebound modules gives bit-identical logits (CPU float32; no Triton needed)."""
    from omniloop_qwen.model import PagedQwen

    for arch in ("qwen2", "qwen3"):
        hf = _hf(tiny_qwen(arch))
        ids = torch.tensor([[5, 9, 13, 200, 7]])
        before = {n: p.detach().clone() for n, p in hf.named_parameters()}
        logits = hf(ids).logits
        fw = PagedQwen(hf, attention="triton", fused=True).fused
        assert fw is not None
        for n, p in hf.named_parameters():
            assert torch.equal(p, before[n]), n
        assert torch.equal(hf(ids).logits, logits)
        for li, layer in enumerate(hf.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            pairs = [(fw.qkv_w[li], [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                     (fw.gate_up[li], [mlp.gate_proj.weight, mlp.up_proj.weight])]
            if fw.qkv_b[li] is not None:
                pairs.append((fw.qkv_b[li], [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
            for merged, parts in pairs:
                assert merged is not None
                offset = 0
                for part in parts:
                    assert part.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
                    assert part.storage_offset() == offset and part.is_contiguous()
                    offset += part.numel()
                assert offset == merged.numel()
        assert (fw.qkv_b[0] is not None) == (arch == "qwen2")  # Qwen2's q/k/v have biases, Qwen3's none


# -- CUDA -------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_cuda_fused_graph_step_vs_unfused_bf16(arch, tiny_qwen, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from omniloop_qwen.model import PagedQwen

    hf = _hf(tiny_qwen(arch), torch.bfloat16, "cuda")
    ref, fast = PagedQwen(hf, attention="triton"), PagedQwen(hf, attention="triton", cuda_graphs=True, fused=True)
    caches = [CacheManager(ref.layout(), block_size=16, num_blocks=64) for _ in range(2)]
    prompts = [[5, 9, 13], list(range(20, 61)), [7]]
    handles = [[c.allocate() for _ in prompts] for c in caches]
    toks = [[int(t)] for t in ref.forward(caches[0], handles[0], prompts).argmax(-1)]
    fast.forward(caches[1], handles[1], prompts)
    agree = total = 0
    for _ in range(6):
        a, b = ref.forward(caches[0], handles[0], toks), fast.forward(caches[1], handles[1], toks)
        assert (a - b).abs().max().item() <= 0.1
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
        toks = [[int(t)] for t in a.argmax(-1)]  # both follow the reference's tokens
    assert agree >= total - 1
    assert fast.graphs is not None and fast.graphs.replays == 6


@needs_cuda
def test_cuda_runtime_fused_matches_transformers_float32(tiny_qwen, runtime_at, hf_reference, req, prompts, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rt = runtime_at(tiny_qwen("qwen2"), device="cuda", options={"paged_attention": "triton", "decode_fused": True,
                                                                 "decode_cuda_graphs": True})
    tok = rt.model.components["tokenizer"]
    for p in prompts[:2]:
        assert _greedy(rt, req, p, 8) == hf_reference("qwen2", tok(p)["input_ids"], 8), p
