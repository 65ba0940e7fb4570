"""Wan past one GPU: per-step time of CFG-parallel and Ulysses sequence parallel on 2 GPUs vs 1.

Random weights, the real Wan2.1 architectures (timing does not depend on the values), bf16:

==========  ==================  ===============================================================
arch        size (F x H x W)     modes
==========  ==================  ===============================================================
``1.3B``    81 x 480 x 832       ``single`` (1 GPU), ``cfg`` (cfg=2), ``sp-g1``, ``sp`` (sp=2, Ulysses)
``14B``     81 x 720 x 1280      ``single`` (1 GPU), ``sp-g1``, ``sp`` (sp=2)
==========  ==================  ===============================================================

A step is one CFG step: the cond and the uncond transformer forward (512 text tokens each).
``single`` runs both on rank 0 while rank 1 waits; ``cfg`` runs one branch per rank and
all-gathers the predictions (omniloop_wan.parallel's ParallelDenoise exchange); ``sp`` runs both
forwards with the token sequence split over the 2 ranks (omniloop_wan.parallel.sp_forward,
Ulysses all-to-all in every self-attention; ``sp`` pipelines the exchange over head groups,
``sp-g1`` is the same with one group, nothing overlapped). All in one run, one process group (NCCL), the
same weights on every rank; medians over ``--repeats`` timed steps after ``--warmup``; speedup =
single / parallel. Targets (issue 18): cfg >= 1.9x, sp >= 1.85x (1.3B), 14B sp >= 1.9x. The
record also holds the largest difference of each parallel prediction to the single one.

Results go to ``$OUT`` if set, else ``bench/results/``, as ``parallel_gpu-<date>[-smoke].json``
with the command line and the machine.

    python bench/parallel_gpu.py                  # 2 GPUs (nvidia-h200-x2); not yet run
    python bench/parallel_gpu.py --arch 1.3B      # one architecture
    python bench/parallel_gpu.py --smoke          # tiny transformer, 2 CPU processes over gloo
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repo_paths

_repo_paths.add_repo_packages()

from _common import CFG_13B, CFG_14B, SMOKE_TF, command_line, library_versions, machine, write_record  # noqa: E402

#: arch -> (transformer config, (frames, height, width), modes)
CASES: dict[str, tuple[dict[str, Any], tuple[int, int, int], tuple[str, ...]]] = {
    "1.3B": (CFG_13B, (81, 480, 832), ("single", "cfg", "sp-g1", "sp")),
    "14B": (CFG_14B, (81, 720, 1280), ("single", "sp-g1", "sp")),
}
SMOKE = {"smoke": (SMOKE_TF, (9, 32, 32), ("single", "cfg", "sp-g1", "sp"))}
TARGETS = {("1.3B", "cfg"): 1.9, ("1.3B", "sp"): 1.85, ("14B", "sp"): 1.9}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench_case(arch: str, tf_cfg: dict[str, Any], size: tuple[int, int, int], modes: tuple[str, ...],
                device: torch.device, dtype: torch.dtype, args: Any) -> dict[str, Any]:
    import torch.distributed as dist
    from diffusers import WanTransformer3DModel

    from omniloop.builtin import sdpa
    from omniloop.family import AttentionBackendSpec
    from omniloop_wan import attention
    from omniloop_wan.parallel import install_ulysses, mesh_for, sp_forward
    from omniloop_wan.transformer import wan_forward

    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights and inputs on every rank
    with torch.device(device):
        tf = WanTransformer3DModel(**tf_cfg).to(dtype).eval().requires_grad_(False)
    attention.install(tf, AttentionBackendSpec(name="sdpa", fn=sdpa))
    frames, height, width = size
    text_len = 8 if args.smoke else 512
    gen = torch.Generator("cpu").manual_seed(1)
    x = torch.randn(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8, generator=gen).to(device, dtype)
    t = torch.tensor([500.0], device=device)
    text = {b: torch.randn(1, text_len, tf_cfg["text_dim"], generator=gen).to(device, dtype) for b in ("cond", "uncond")}

    def single() -> dict[str, torch.Tensor]:
        if rank != 0:
            return {}
        return {b: wan_forward(tf, x, t, text[b]) for b in ("cond", "uncond")}

    def cfg() -> dict[str, torch.Tensor]:
        mesh = mesh_for(1, 2)
        mine = ("cond", "uncond")[mesh.cfg_rank]
        pred = wan_forward(tf, x, t, text[mine]).contiguous()
        parts = [torch.empty_like(pred) for _ in range(2)]
        dist.all_gather(parts, pred, group=mesh.cfg_group)
        return dict(zip(("cond", "uncond"), parts, strict=True))

    def sp() -> dict[str, torch.Tensor]:
        mesh = mesh_for(2, 1)
        install_ulysses(tf, mesh)
        return {b: sp_forward(tf, mesh, x, t, text[b], None, None) for b in ("cond", "uncond")}

    def sp_g1() -> dict[str, torch.Tensor]:  # the exchange not pipelined (one head group)
        mesh = mesh_for(2, 1)
        install_ulysses(tf, mesh, groups=1)
        return {b: sp_forward(tf, mesh, x, t, text[b], None, None) for b in ("cond", "uncond")}

    fns = {"single": single, "cfg": cfg, "sp-g1": sp_g1, "sp": sp}
    out: dict[str, Any] = {"size": list(size), "latents": list(x.shape), "times_s": {}, "max_abs_diff_vs_single": {}}
    ref: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for mode in modes:  # sp last: it installs the Ulysses processors for good
            fn = fns[mode]
            for _ in range(args.warmup):
                fn()
            times = []
            for _ in range(args.repeats):
                _sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                preds = fn()
                _sync(device)
                dist.barrier()
                times.append(time.perf_counter() - t0)
            out["times_s"][mode] = times
            if mode == "single":
                ref = preds
            elif rank == 0 and ref:
                out["max_abs_diff_vs_single"][mode] = max(
                    (preds[b].float() - ref[b].float()).abs().max().item() for b in ref
                )
    med = {m: statistics.median(v) for m, v in out["times_s"].items()}
    out["s_per_step_median"] = med
    out["speedup_vs_single"] = {m: med["single"] / med[m] for m in med if m != "single"}
    out["targets"] = {m: TARGETS.get((arch, m)) for m in out["speedup_vs_single"]}
    tf.to("meta")  # free the weights before the next architecture
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _rank_main(rank: int, world: int, port: int, args: Any, queue: Any) -> None:
    import torch.distributed as dist

    from omniloop_parallel.group import init_group

    smoke = args.smoke
    backend = "gloo" if smoke else "nccl"
    if not smoke:
        torch.cuda.set_device(rank)
    device = torch.device("cpu" if smoke else f"cuda:{rank}")
    dtype = torch.float32 if smoke else torch.bfloat16
    if smoke:
        torch.set_num_threads(1)
    init_group(rank, world, port, backend, args.timeout)
    try:
        cases = SMOKE if smoke else {a: CASES[a] for a in args.arch}
        results = {arch: _bench_case(arch, *case, device, dtype, args) for arch, case in cases.items()}
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny transformer, 2 CPU processes over gloo (checks the script)")
    ap.add_argument("--arch", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    ap.add_argument("--timeout", type=float, default=600.0, help="collective timeout (s)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if not args.smoke and torch.cuda.device_count() < 2:
        print("parallel_gpu: needs 2 CUDA devices (use --smoke on a CPU)", file=sys.stderr)
        return 2

    import multiprocessing as mp

    import parallel_gpu  # the workers import the target by module name (this file may run as __main__)

    from omniloop_parallel.group import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=parallel_gpu._rank_main, args=(r, 2, port, args, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    results = None
    while results is None:
        try:
            results = queue.get(timeout=1.0)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    if p.exitcode is None:
                        p.terminate()
                print("parallel_gpu: a rank failed or timed out", file=sys.stderr)
                return 1
    for p in procs:
        p.join(30)
    record = {
        "bench": "parallel_gpu",
        "date": dt.date.today().isoformat() + ("-smoke" if args.smoke else ""),
        "command": command_line("bench/parallel_gpu.py", list(argv if argv is not None else sys.argv[1:])),
        "machine": machine(world=2, backend="gloo" if args.smoke else "nccl", **library_versions()),
        "results": results,
    }
    path = write_record(record, args.out)
    for arch, res in results.items():
        print(arch, {m: f"{s * 1e3:.1f} ms" for m, s in res["s_per_step_median"].items()},
              {m: f"{v:.2f}x" for m, v in res["speedup_vs_single"].items()})
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
