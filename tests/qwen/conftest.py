"""Fixtures for the Qwen family tests: tiny random Qwen2 / Qwen3 checkpoints (built once per
session, GQA: 4 query heads over 2 KV heads), runtimes over them, and transformers references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import omniloop_qwen.plugin as qwen_plugin
import omniloop_scheduler.plugin as scheduler_plugin
from omniloop.runtime import Runtime
from omniloop.testing import make_manager, once_per_arguments
from omniloop_qwen.tiny import build_tiny_checkpoint

PROMPTS = (
    "the quick brown fox",
    "hello",
    "write a short story about a cat who sails across the sea at night under the bright stars.",
    "0 1 2 3",
)


def qwen_manager() -> Any:
    """The Qwen family and the real schedulers (serial, step); nothing discovered."""
    return make_manager(("qwen", qwen_plugin), ("scheduler", scheduler_plugin), toy=False, scheduler=False)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_qwen(arch)`` → path of a tiny checkpoint of ``qwen2`` or ``qwen3``."""

    @once_per_arguments
    def get(arch: str = "qwen2") -> Path:
        return build_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch)

    return get


@pytest.fixture(scope="session")
def qwen_runtime(tiny_qwen):
    """``qwen_runtime(arch, scheduler="serial", **deploy)`` → a CPU float32 runtime (cached per arguments)."""
    cache: dict[Any, Runtime] = {}

    def get(arch: str = "qwen2", scheduler: str = "serial", **deploy: Any) -> Runtime:
        key = (arch, scheduler, repr(sorted(deploy.items())))
        if key not in cache:
            cache[key] = Runtime.from_model(tiny_qwen(arch), manager=qwen_manager(), scheduler=scheduler, **deploy)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def hf_reference(tiny_qwen):
    """``hf_reference(arch, prompt_ids, max_new_tokens)`` → transformers ``generate(do_sample=False)`` new tokens."""
    from transformers import AutoModelForCausalLM

    models: dict[str, Any] = {}

    def run(arch: str, ids: list[int], max_new_tokens: int) -> list[int]:
        if arch not in models:
            models[arch] = AutoModelForCausalLM.from_pretrained(tiny_qwen(arch), dtype=torch.float32).eval()
        x = torch.tensor([ids])
        with torch.no_grad():
            out = models[arch].generate(x, do_sample=False, max_new_tokens=max_new_tokens)
        return [int(t) for t in out[0, x.shape[1]:]]

    return run


def reason(prompt: str, max_tokens: int = 16, temperature: float = 0.0, **extra: Any) -> dict[str, Any]:
    return {"task": "reason", "inputs": [{"type": "text", "text": prompt}],
            "sampling": {"max_tokens": max_tokens, "temperature": temperature}, **extra}


@pytest.fixture
def req():
    """``req(prompt, max_tokens=16, temperature=0.0, **extra)`` → a reason request dict."""
    return reason


@pytest.fixture
def prompts() -> tuple[str, ...]:
    """Prompts of different lengths (1 to ~30 tokens)."""
    return PROMPTS


@pytest.fixture
def runtime_at():
    """``runtime_at(path, **deploy)`` → a fresh runtime over a checkpoint folder."""
    return lambda path, **deploy: Runtime.from_model(path, manager=qwen_manager(), **deploy)


class _EagerGraph:
    """Stands in for a CUDA graph on CPU: ``replay`` runs the captured function eagerly."""

    def __init__(self, fn):
        self.replay = fn


@pytest.fixture
def graphed_vs_eager(monkeypatch):
    """Run ``graphed`` (a PagedQwen given ``DecodeGraphs``) beside ``eager`` on the same prompts:
    the CUDA graph is replaced by an eager replay of ``decode_static`` (CPU); everything else —
    buckets, padding rows, block-table columns, a context growing across two buckets — is the CUDA
    path's code. Every decode step's logits, the greedy tokens and the K/V written at each
    sequence's slots must agree; returns the ``DecodeGraphs`` for counts."""
    from omniloop_kvcache import CacheManager
    from omniloop_qwen import model as qm
    from omniloop_qwen import paged_attention as pa

    monkeypatch.setattr(qm, "MIN_GRAPH_CONTEXT", 16)  # small buckets, so the context crosses two

    def fake_capture(self, cache, host, ctx_tokens):
        m = self.model
        meta = host.clone()
        row_seq = torch.arange(host.shape[0], dtype=torch.int32)
        splits = pa.choose_splits(host.shape[0], m.kv_heads, ctx_tokens, m.device)
        logits = m.decode_static(cache, meta, row_seq, ctx_tokens, splits)
        self.captures += 1
        replay = _EagerGraph(lambda: logits.copy_(m.decode_static(cache, meta, row_seq, ctx_tokens, splits)))
        return qm._DecodeGraph(graph=replay, meta=meta, row_seq=row_seq, logits=logits, cache=cache,
                               ctx_tokens=ctx_tokens, splits=splits)

    monkeypatch.setattr(qm.DecodeGraphs, "_capture", fake_capture)

    def run(eager, graphed, steps: int):
        graphed.graphs = qm.DecodeGraphs(graphed)
        caches = [CacheManager(eager.layout(), block_size=4, num_blocks=64) for _ in range(2)]
        prompts = [[5, 9, 13], list(range(20, 31)), [7]]
        handles, toks = [], []
        for model, cache in zip((eager, graphed), caches, strict=True):
            hs = [cache.allocate() for _ in prompts]
            logits = model.forward(cache, hs, prompts)  # prefill: the eager path in both
            handles.append(hs)
            toks.append([[int(t)] for t in logits.argmax(-1)])
        assert toks[0] == toks[1]
        for _ in range(steps):
            a = eager.forward(caches[0], handles[0], toks[0])
            b = graphed.forward(caches[1], handles[1], toks[1])
            torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
            toks = [[[int(t)] for t in x.argmax(-1)] for x in (a, b)]
            assert toks[0] == toks[1]
        for li in range(len(eager.layers)):  # the same K/V landed at the same slots
            for h0, h1 in zip(*handles, strict=True):
                s0, s1 = caches[0].slots(h0), caches[1].slots(h1)
                torch.testing.assert_close(caches[1].k[li][s1], caches[0].k[li][s0], rtol=0, atol=2e-5)
                torch.testing.assert_close(caches[1].v[li][s1], caches[0].v[li][s0], rtol=0, atol=2e-5)
        return graphed.graphs

    return run
