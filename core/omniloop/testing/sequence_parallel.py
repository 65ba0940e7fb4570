"""Check that a block interceptor's skip decision is sequence-parallel safe (gloo on CPU).

:func:`check_sequence_parallel` forks a world of 3 ranks: ranks 0 and 1 form the SP group and
each run their shard of the sequence (uneven: 5 + 7 tokens) through a toy block stack; rank 2 is in
the world but not in the group and waits in a WORLD barrier, so a collective issued on WORLD
instead of the SP group mismatches and fails. Both SP ranks must take exactly the decisions of one
unsharded run, and their shards must join into its output.

The toy blocks act on each token independently, so a rank can run its shard alone; only the cache
decision needs the whole sequence, which is what the interceptor's reduce over the group provides.
The interceptor must offer ``bind_process_group(group)`` and report ``cached_steps`` and
``residual_diffs`` in ``metrics(state)``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..interceptors import BlockContext, run_blocks
from ..loop import LoopState, StepContext

TOKENS, DIM, STEPS, SPLIT = 12, 16, 20, 5  # uneven shards: 5 + 7 tokens

MakeInterceptor = Callable[[], Any]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = h + 0.5 * torch.tanh(self.lin(h) + temb)
        return out


def _build() -> tuple[nn.ModuleList, nn.Linear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    blocks = nn.ModuleList(_Block() for _ in range(5))
    time = nn.Linear(1, DIM)
    with torch.no_grad():
        for p in [*blocks.parameters(), *time.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5))
    text = torch.randn(2, DIM, generator=g) * 0.3
    x = torch.randn(1, TOKENS, DIM, generator=g)
    return blocks, time, text, x


def denoise(make: MakeInterceptor, x: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """A CFG toy loop over ``x`` (a shard or the whole sequence) with the interceptor bound to ``group``."""
    blocks, time, text, _ = _build()
    icpt = make()
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

                def call(blk: Any, h: torch.Tensor, temb: torch.Tensor = temb) -> torch.Tensor:
                    out: torch.Tensor = blk(h, temb)
                    return out

                preds[b] = run_blocks(blocks, x, ctx, call)
            x = x - (preds["uncond"] + 3.0 * (preds["cond"] - preds["uncond"])) / STEPS
    metrics: dict[str, Any] = {}
    for b in loop.branches:
        st = loop.plugin_state.pop((icpt.name, b))
        metrics[b] = icpt.metrics(st)
        icpt.close(st)
    return x, metrics


def reference(make: MakeInterceptor) -> dict[str, Any]:
    """The unsharded run, no torch.distributed."""
    x, metrics = denoise(make, _build()[3])
    return {"x": x.tolist(), "metrics": metrics}


def rank_main(make: MakeInterceptor, rank: int, world: int, port: str, out: str) -> None:
    """One rank: 0 and 1 run their shard in the SP group and write ``out``; others only barrier."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    sp = dist.new_group([0, 1])
    if rank in (0, 1):
        full = _build()[3]
        shard = full[:, :SPLIT] if rank == 0 else full[:, SPLIT:]
        x, metrics = denoise(make, shard.contiguous(), sp)
        Path(out).write_text(json.dumps({"x": x.tolist(), "metrics": metrics}))
    dist.barrier()
    dist.destroy_process_group()


def available() -> str | None:
    """None when the check can run here, else why not (for ``pytest.mark.skipif``)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return "needs torch.distributed with gloo"
    if "fork" not in mp.get_all_start_methods():
        return "needs the fork start method"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_sequence_parallel(make: MakeInterceptor, tmp_dir: str | Path, *, timeout: float = 120) -> dict[str, Any]:
    """Fork the 3 ranks, assert both SP ranks decide as one unsharded run; return the reference."""
    tmp = Path(tmp_dir)
    ref = reference(make)
    port = str(_free_port())
    outs = [tmp / f"rank{r}.json" for r in range(3)]
    ctx = mp.get_context("fork")  # the ranks inherit what the test imported (cache-dit is slow to import)
    procs = [ctx.Process(target=rank_main, args=(make, r, 3, port, str(outs[r]))) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0, 0], "a rank failed (a collective on WORLD instead of the SP group?)"

    r0, r1 = (json.loads(outs[r].read_text()) for r in (0, 1))
    assert not outs[2].exists()
    for branch in ("cond", "uncond"):
        cached = ref["metrics"][branch]["cached_steps"]
        assert cached, "the reference must cache some steps for this check to mean anything"
        for r in (r0, r1):
            assert r["metrics"][branch]["cached_steps"] == cached, f"{branch}: a rank decided differently"
        assert r0["metrics"][branch]["residual_diffs"] == r1["metrics"][branch]["residual_diffs"]
        for step, diff in ref["metrics"][branch]["residual_diffs"].items():
            got = r0["metrics"][branch]["residual_diffs"][step]
            assert abs(got - diff) <= 1e-5 * abs(diff), f"{branch} step {step}: residual diff {got} vs {diff}"
    x = torch.cat([torch.tensor(r0["x"]), torch.tensor(r1["x"])], dim=1)
    torch.testing.assert_close(x, torch.tensor(ref["x"]), rtol=1e-5, atol=1e-6)
    return ref
