"""Worker for test_fbcache_sp.py: one rank of a sequence-parallel toy denoise loop (gloo, CPU).

The test forks the ranks from its own process (fast start, no re-import); by hand:

    python sp_worker.py ref OUT.json                 # unsharded reference, no torch.distributed
    python sp_worker.py RANK WORLD PORT OUT.json     # ranks 0, 1 form the SP group; rank 2 stays out

The toy blocks act on each token independently, so a rank can run its shard of the sequence
alone; only the cache decision needs the whole sequence, which is what the SP reduce provides.
Rank 2 is in the world but not in the SP group: it waits in a WORLD barrier, so any collective
issued on WORLD instead of the SP group would mismatch and fail.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from omniloop.interceptors import BlockContext, run_blocks
from omniloop.loop import LoopState, StepContext
from omniloop_fbcache import FirstBlockCache

TOKENS, DIM, STEPS, SPLIT = 12, 16, 20, 5  # uneven shards: 5 + 7 tokens
SETTINGS = {"threshold": 0.1, "warmup_steps": 3}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        return h + 0.5 * torch.tanh(self.lin(h) + temb)


def build() -> tuple[nn.ModuleList, nn.Linear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(5))
    time = nn.Linear(1, DIM)
    with torch.no_grad():
        for p in [*blocks.parameters(), *time.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5))
    text = torch.randn(2, DIM, generator=g) * 0.3
    x = torch.randn(1, TOKENS, DIM, generator=g)
    return blocks, time, text, x


def denoise(x: torch.Tensor, group: object = None) -> tuple[torch.Tensor, dict]:
    blocks, time, text, _ = build()
    icpt = FirstBlockCache(SETTINGS)
    icpt.bind_process_group(group)
    loop = LoopState(total=STEPS, branches=("cond", "uncond"))
    for b in loop.branches:
        loop.plugin_state[(icpt.name, b)] = icpt.open(StepContext("sp", "denoise", 0, STEPS, 1.0, b), loop)
    with torch.no_grad():
        for i in range(STEPS):
            t = 1.0 - i / STEPS
            preds = {}
            for j, b in enumerate(loop.branches):
                temb = time(torch.tensor([[t]])) + text[j]
                ctx = BlockContext(step=StepContext("sp", "denoise", i, STEPS, t, b), loop=loop, interceptor=icpt)
                preds[b] = run_blocks(blocks, x, ctx, lambda blk, h, temb=temb: blk(h, temb))
            x = x - (preds["uncond"] + 3.0 * (preds["cond"] - preds["uncond"])) / STEPS
    metrics = {}
    for b in loop.branches:
        st = loop.plugin_state.pop((icpt.name, b))
        metrics[b] = icpt.metrics(st)
        icpt.close(st)
    return x, metrics


def reference() -> dict:
    x, metrics = denoise(build()[3])
    return {"x": x.tolist(), "metrics": metrics}


def rank_main(rank: int, world: int, port: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    sp = dist.new_group([0, 1])
    if rank in (0, 1):
        full = build()[3]
        shard = full[:, :SPLIT] if rank == 0 else full[:, SPLIT:]
        x, metrics = denoise(shard.contiguous(), sp)
        json.dump({"x": x.tolist(), "metrics": metrics}, open(out, "w"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "ref":
        json.dump(reference(), open(sys.argv[2], "w"))
    else:
        rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
