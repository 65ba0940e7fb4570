"""The text (understanding) segment is computed once per request and CFG branch, held in the
model's text-KV pool (``omniloop_kvcache.CacheManager``, KV class ``cosmos3-text``) and read at
every step; the pool's blocks are given back when the request ends."""

from __future__ import annotations

from typing import Any

import pytest

import omniloop_cosmos3.transformer as T
from omniloop.request import Status


@pytest.fixture
def count_und(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = T.understand

    def counted(tf: Any, ids: Any, rot: Any) -> Any:
        calls.append(int(ids.shape[0]))
        return real(tf, ids, rot)

    monkeypatch.setattr(T, "understand", counted)
    return calls


@pytest.mark.parametrize("steps", [1, 4])
def test_text_kv_once_per_request_and_branch(runtime, t2v, count_und, steps):
    rt = runtime("qwen")
    out = rt.generate(t2v(seed=1, steps=steps, negative="blurry"))
    assert out.status is Status.COMPLETED, out.error
    # two branches (cond, uncond), whatever the number of steps
    assert len(count_und) == 2
    kv = out.metrics["text_kv"]
    assert kv["branches"] == 2 and sorted(count_und) == sorted(kv["tokens"].values())


def test_text_kv_one_branch_without_cfg(runtime, t2v, count_und):
    out = runtime("nemotron").generate(t2v(seed=1, steps=3, guidance_scale=1.0))
    assert out.status is Status.COMPLETED, out.error
    assert len(count_und) == 1 and out.metrics["text_kv"]["branches"] == 1


def test_text_kv_pool_given_back(runtime, t2v):
    rt = runtime("qwen")
    pool = rt.model.components["text_kv"]
    assert pool.name == "cosmos3-text"
    before = pool.free_blocks
    assert rt.generate(t2v(seed=2, steps=2)).status is Status.COMPLETED
    assert pool.free_blocks == before and pool.sequences == 0
    pool.check()


def test_text_kv_pool_size_is_a_deploy_option(tiny_ckpt):
    from omniloop.errors import DeployError

    from .conftest import c3_runtime

    rt = c3_runtime(tiny_ckpt("nemotron"), options={"text_kv_tokens": 512})
    assert rt.model.components["text_kv"].num_blocks == 32
    with pytest.raises(DeployError, match=r"options\.text_kv_tokens"):
        c3_runtime(tiny_ckpt("nemotron"), options={"text_kv_tokens": 4})


def test_a_full_pool_fails_the_request_and_frees_what_it_took(tiny_ckpt, t2v):
    from .conftest import c3_runtime

    rt = c3_runtime(tiny_ckpt("nemotron"), options={"text_kv_tokens": 160})  # room for one branch's text only
    pool = rt.model.components["text_kv"]
    out = rt.generate(t2v(seed=1, steps=1))
    assert out.status is Status.FAILED and "KV cache 'cosmos3-text'" in out.error.message
    assert pool.sequences == 0 and pool.free_blocks == pool.num_blocks
    assert rt.generate(t2v(seed=1, steps=1, guidance_scale=1.0)).status is Status.COMPLETED  # one branch fits


def test_kv_demand_is_the_text_blocks(runtime, t2v):
    rt = runtime("qwen")
    ex = rt.prepare(t2v(seed=1, steps=1))
    node = next(n for n in ex.nodes if n.name == "denoise")
    pool, blocks = node.stage.kv_demand(ex.state)
    p = ex.state.resolved
    assert pool is rt.model.components["text_kv"]
    assert blocks == pool.blocks_for(len(p.cond_ids)) + pool.blocks_for(len(p.uncond_ids))
