"""Ulysses attention with its head groups pipelined (omniloop_wan.parallel.ulysses), 2 gloo processes.

Attention is per head, so pipelining the exchange over head groups must not change a single value:
each ``groups`` setting equals ``groups=1`` exactly, and both equal full-sequence attention computed
in one process (the same SDPA over the same per-head rows)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("diffusers")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from omniloop_wan.parallel import Mesh, ulysses

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 12, 16, 8, generator=g) for _ in range(3))  # the whole sequence
        full = F.scaled_dot_product_attention(q, k, v)
        shard = slice(rank * 8, (rank + 1) * 8)  # this rank's tokens
        mesh = Mesh(2, 1)
        res = {}
        for groups in (1, 2, 3):
            attend = ulysses(F.scaled_dot_product_attention, mesh, groups)
            res[groups] = attend(q[:, :, shard], k[:, :, shard], v[:, :, shard])
        out[rank] = {"full": full[:, :, shard], **res}
    finally:
        dist.destroy_process_group()


def test_pipelined_head_groups_change_nothing():
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
        got = dict(out)
    for rank in (0, 1):
        r = got[rank]
        assert torch.equal(r[2], r[1]) and torch.equal(r[3], r[1])
        assert torch.allclose(r[1], r["full"], rtol=0, atol=1e-6)


def test_head_groups_split_evenly():
    from omniloop_wan.parallel import head_groups

    assert head_groups(12, 2) == 3  # Wan 1.3B: 3 groups of 4 heads, 2 per rank
    assert head_groups(40, 2) == 4  # Wan 14B: 4 groups of 10
    assert head_groups(2, 2) == 1 and head_groups(6, 4) == 1
