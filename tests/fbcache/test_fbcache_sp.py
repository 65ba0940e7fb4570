"""The cache decision reduces over the pool's sequence-parallel group (gloo on CPU, 3 processes).

World of 3 ranks; ranks 0 and 1 form the SP group and each run half of the sequence (uneven
shards); rank 2 is outside the group and waits in a WORLD barrier, so a collective issued on
WORLD instead of the SP group would fail. Both SP ranks must take exactly the decisions of one
unsharded run.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import socket
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available() or "fork" not in mp.get_all_start_methods(),
    reason="needs gloo and fork",
)


def _worker() -> ModuleType:
    path = Path(__file__).with_name("sp_worker.py")
    spec = importlib.util.spec_from_file_location("omniloop_fbcache_sp_worker", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sp_ranks_decide_as_one_unsharded_run(tmp_path: Path) -> None:
    worker = _worker()
    ref = worker.reference()
    port = str(_free_port())
    outs = [tmp_path / f"rank{r}.json" for r in range(3)]
    ctx = mp.get_context("fork")  # the ranks inherit the imported modules
    procs = [ctx.Process(target=worker.rank_main, args=(r, 3, port, str(outs[r]))) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0, 0]

    r0, r1 = (json.loads(outs[r].read_text()) for r in (0, 1))
    assert not outs[2].exists()
    for branch in ("cond", "uncond"):
        cached = ref["metrics"][branch]["cached_steps"]
        assert cached, "the reference must cache some steps for this test to mean anything"
        assert r0["metrics"][branch]["cached_steps"] == cached
        assert r1["metrics"][branch]["cached_steps"] == cached
        assert r0["metrics"][branch]["residual_diffs"] == r1["metrics"][branch]["residual_diffs"]
        for step, diff in ref["metrics"][branch]["residual_diffs"].items():
            assert r0["metrics"][branch]["residual_diffs"][step] == pytest.approx(diff, rel=1e-5)
    x = torch.cat([torch.tensor(r0["x"]), torch.tensor(r1["x"])], dim=1)
    torch.testing.assert_close(x, torch.tensor(ref["x"]), rtol=1e-5, atol=1e-6)
