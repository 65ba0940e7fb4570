"""Offload on one GPU: per-step time and peak GPU memory of deploy ``offload: none | model | sequential``.

Random weights, the real Wan2.1 T2V architectures (timing does not depend on the values), bf16
transformer and UMT5-XXL text encoder, float32 VAE, 480×832×81 (latents ``[1, 16, 21, 60, 104]``),
CFG 5 (a step is the cond and the uncond forward), the whole pipeline (prompt → frames) through
``omniloop.execution.Execution`` with the same :mod:`omniloop_offload` code a deployment installs:

==========================  =======================================================================
``none``                    every component resident on the GPU (the baseline)
``model``                   each node's components copied to the GPU when it runs (text encoder,
                            then transformer, then VAE), the others back in pinned host memory
``sequential``              as ``model``, but the transformer's (and text encoder's) blocks
                            stream one at a time; the next block's copy overlaps the current
                            block's compute on a side CUDA stream
``sequential-nooverlap``    (``--modes``, not default) the same without the side stream: what the
                            overlap saves
==========================  =======================================================================

Per (arch, mode): the median seconds per denoise step (steps 2..N of a ``--steps`` request; the
first holds the loop's set-up and, offloaded, the transformer's copy), end to end, each node's
seconds, peak GPU memory over the whole request and over the denoise loop alone
(``torch.cuda.max_memory_allocated``), the bytes resident, and whether the final latents are
``torch.equal`` to ``none``'s. The 14B architecture (40 blocks, dim 5120; ~28 GB of bf16 weights)
runs after the 1.3B one when ``--arch`` names it and the time budget allows.

``--budget-s`` (default 540 s: a lent machine runs one command for at most 600 s) skips what
would not finish; the JSON record is rewritten after every mode, so a run cut short keeps what it
measured. Progress is printed as it goes (flushed).

Results go to ``$OUT`` if set, else ``bench/results/``, as ``offload_gpu-<archs>-<date>[-smoke].json``
(e.g. ``offload_gpu-1.3B-14B-2026-12-01.json``) with the command line and the machine.

    python bench/offload_gpu.py --arch 1.3B           # 1 GPU: ~2-3 min (estimate; not yet run)
    python bench/offload_gpu.py --arch 14B            # ~4-6 min (estimate: ~10 s per CFG step)
    python bench/offload_gpu.py                       # both in one run (the budget may skip 14B modes)
    python bench/offload_gpu.py --smoke               # tiny models on a CPU: checks the script

Memory: the 14B run builds the transformer on the GPU (fp32 init, ~56 GB, then bf16) and pins
~45 GB of host memory (14B + UMT5-XXL) for the offload modes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
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

from _common import (  # noqa: E402
    CFG_13B,
    CFG_14B,
    SMOKE_TE,
    SMOKE_TF,
    SMOKE_VAE,
    UMT5_XXL,
    command_line,
    library_versions,
    machine,
    omniloop_request,
    step_times,
    wan_components,
)

ARCHS: dict[str, dict[str, Any]] = {"1.3B": CFG_13B, "14B": CFG_14B}
MODES = ("none", "model", "sequential", "sequential-nooverlap")
SEED = 42
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def gib(n: int | None) -> float | None:
    return None if n is None else round(n / 2**30, 3)


def peak() -> int | None:
    return torch.cuda.max_memory_allocated() if cuda() else None


def reset_peak() -> None:
    if cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def build_shared(device: torch.device, dtype: torch.dtype, smoke: bool) -> tuple[Any, Any]:
    """The VAE (float32) and the UMT5 text encoder (``dtype``), built on ``device`` (fast random init)."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKLWan(**(SMOKE_VAE if smoke else {})).to(torch.float32).eval().requires_grad_(False)
        te = UMT5EncoderModel(UMT5Config(**(SMOKE_TE if smoke else UMT5_XXL))).to(dtype).eval().requires_grad_(False)
    return vae, te


def build_transformer(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(1)
    with torch.device(device):
        return WanTransformer3DModel(**cfg).to(dtype).eval().requires_grad_(False)


def nbytes(module: Any) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def run_request(built: Any, body: dict[str, Any], *, stop_after_denoise: bool = False) -> dict[str, Any]:
    """One request node by node: per-step marks, node times, peak memory (whole / denoise only)."""
    from omniloop.artifacts import Latents
    from omniloop.execution import Execution
    from omniloop.schema import request_from_dict

    ex = Execution(built, request_from_dict(body))
    marks: list[float] = []
    reset_peak()
    sync()
    t0 = time.perf_counter()
    denoise_peak: int | None = None
    whole_peak = 0
    while not ex.done:
        node = ex.current_node
        name = node.name if node is not None else None
        if stop_after_denoise and name == "vae_decode":
            ex.cancel()
            ex.advance()
            break
        if name == "denoise" and not marks and cuda():  # the loop's own peak starts here
            whole_peak = max(whole_peak, peak() or 0)
            torch.cuda.reset_peak_memory_stats()
        ex.advance()
        if name == "denoise":
            sync()
            marks.append(time.perf_counter())
            if ex.current_node is None or ex.current_node.name != "denoise":
                denoise_peak = peak()
    sync()
    total = time.perf_counter() - t0
    out = ex.output
    if not stop_after_denoise and not out.ok:
        raise RuntimeError(f"request failed: {out.error}")
    whole_peak = max(whole_peak, peak() or 0)
    steps = step_times(marks)
    latents = ex.state.artifacts.get("denoised")
    return {
        "total": total, "steps": steps, "node_seconds": out.metrics.get("node_seconds"),
        "peak": whole_peak if cuda() else None, "denoise_peak": denoise_peak,
        "latents": latents.tensor if isinstance(latents, Latents) else None,
    }


def bench_arch(arch: str, tf_cfg: dict[str, Any], shared: tuple[Any, Any], args: argparse.Namespace,
               device: torch.device, dtype: torch.dtype, record: dict[str, Any], save: Any) -> None:
    from omniloop.deploy import DeployConfig
    from omniloop.execution import BuiltPipeline
    from omniloop.request import TaskType
    from omniloop_offload import install, wrap_pipeline
    from omniloop_wan.family import WanFamily

    smoke = args.smoke
    size = (9, 32, 32) if smoke else (args.frames, args.height, args.width)
    res: dict[str, Any] = record["results"].setdefault(arch, {"size": list(size), "modes": {}})
    log(f"{arch}: building the transformer on {device}")
    t = time.perf_counter()
    tf = build_transformer(tf_cfg, device, dtype)
    sync()
    vae, te = shared
    comps = wan_components(tf, vae, te)
    res["build_s"] = round(time.perf_counter() - t, 2)
    res["weights_gib"] = {"transformer": gib(nbytes(tf)), "text_encoder": gib(nbytes(te)), "vae": gib(nbytes(vae))}
    res["blocks"] = len(tf.blocks)
    res["block_gib"] = gib(nbytes(tf.blocks[0]))
    fam = WanFamily()
    deploy = DeployConfig(device=str(device), dtype="float32" if smoke else "bfloat16")
    options: dict[str, Any] = {"deploy": deploy}
    model = fam.from_components(comps, device=device, dtype=dtype, options=options)
    spec = fam.build_pipeline(model, TaskType.T2V, options)
    body = omniloop_request(args.steps, SEED, size)
    ref_latents: torch.Tensor | None = None
    for mode in args.modes:
        left = args.budget_s - (time.monotonic() - T0)
        need = res.get("last_mode_s", 0.0) * 1.3
        if left < need or left < 5:
            log(f"{arch} {mode}: skipped ({left:.0f}s of the budget left, about {need:.0f}s needed)")
            res["modes"][mode] = {"skipped": f"time budget: {left:.0f}s left"}
            save()
            continue
        t_mode = time.monotonic()
        off = None
        try:
            if mode != "none":
                t = time.perf_counter()
                off = install(model, fam, mode.split("-")[0], device, overlap=not mode.endswith("nooverlap"))
                sync()
                install_s = time.perf_counter() - t
                built_spec = wrap_pipeline(spec, off)
            else:
                for m in (tf, te, vae):  # an earlier architecture's offload modes left them in host memory
                    if any(p.device != device for p in m.parameters()):
                        m.to(device)
                install_s = 0.0
                built_spec = spec
            reset_peak()
            built = BuiltPipeline(spec=built_spec, components=comps, device=device, dtype=dtype, options=options)
            log(f"{arch} {mode}: warm-up ({min(2, args.steps)} steps, no decode)")
            with torch.no_grad():
                run_request(built, omniloop_request(min(2, args.steps), 0, size), stop_after_denoise=True)
                log(f"{arch} {mode}: timed request ({args.steps} steps)")
                r = run_request(built, body)
            med = statistics.median(r["steps"]) if r["steps"] else None
            row: dict[str, Any] = {
                "s_per_step_median": round(med, 4) if med else None,
                "s_per_step": [round(x, 4) for x in r["steps"]],
                "s_end_to_end": round(r["total"], 3),
                "node_seconds": r["node_seconds"],
                "peak_gpu_gib": gib(r["peak"]),
                "peak_gpu_denoise_gib": gib(r["denoise_peak"]),
                "install_s": round(install_s, 2),
            }
            if off is not None:
                row["offload"] = off.describe()
            if mode == "none":
                ref_latents = r["latents"]
            elif ref_latents is not None and r["latents"] is not None:
                row["latents_equal_to_none"] = bool(torch.equal(r["latents"].cpu(), ref_latents.cpu()))
                row["latents_max_abs_vs_none"] = float((r["latents"].float().cpu() - ref_latents.float().cpu()).abs().max())
            base = res["modes"].get("none", {}).get("s_per_step_median")
            if base and med:
                row["step_time_vs_none"] = round(med / base, 3)
            res["modes"][mode] = row
            log(f"{arch} {mode}: {json.dumps({k: row[k] for k in ('s_per_step_median', 's_end_to_end', 'peak_gpu_gib', 'peak_gpu_denoise_gib')})}")
        except Exception as exc:  # recorded (out of memory, or a bug), the next mode still runs
            import traceback

            traceback.print_exc()
            first = (str(exc).splitlines() or [""])[0]
            res["modes"][mode] = {"error": f"{type(exc).__name__}: {first}"}
            log(f"{arch} {mode}: failed: {type(exc).__name__}: {first}")
        finally:
            if off is not None:
                off.remove()  # the weights stay in pinned host memory for the next offload mode
            reset_peak()
        res["last_mode_s"] = round(time.monotonic() - t_mode, 1)
        save()
    # free this transformer before the next architecture
    tf.to("meta")
    comps.clear()
    reset_peak()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU (checks the script)")
    ap.add_argument("--arch", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--modes", nargs="+", default=list(MODES[:3]), choices=list(MODES))
    ap.add_argument("--steps", type=int, default=4, help="denoise steps of the timed request (median over steps 2..N)")
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting new modes after this many seconds")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if "none" in args.modes:  # the baseline first: the others compare to it
        args.modes = ["none", *[m for m in args.modes if m != "none"]]
    smoke = args.smoke
    if not smoke and not cuda():
        print("offload_gpu: needs a CUDA device (use --smoke on a CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    if smoke:
        torch.set_num_threads(1)
    date = dt.date.today().isoformat() + ("-smoke" if smoke else "")
    record: dict[str, Any] = {
        "bench": "offload_gpu", "date": date,
        "command": command_line("bench/offload_gpu.py", list(argv if argv is not None else sys.argv[1:])),
        "machine": machine(dtype=str(dtype), device=str(device), **library_versions(),
                           host_mem_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)),
        "budget_s": args.budget_s, "steps": args.steps, "modes": args.modes, "results": {},
    }

    archs = {"smoke": SMOKE_TF} if smoke else {a: ARCHS[a] for a in args.arch}
    path = Path(args.out) / f"offload_gpu-{'-'.join(archs)}-{date}.json"  # one file per set of archs

    def save() -> None:
        record["elapsed_s"] = round(time.monotonic() - T0, 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")

    log(f"building the VAE and text encoder on {device}")
    shared = build_shared(device, dtype, smoke)
    for arch, cfg in archs.items():
        if time.monotonic() - T0 > args.budget_s * 0.5 and arch != next(iter(archs)):
            log(f"{arch}: skipped (half the time budget is spent)")
            record["results"][arch] = {"skipped": "time budget"}
            save()
            continue
        bench_arch(arch, cfg, shared, args, device, dtype, record, save)
    save()
    for arch, res in record["results"].items():
        for mode, row in res.get("modes", {}).items():
            print(arch, mode, {k: row.get(k) for k in ("s_per_step_median", "peak_gpu_gib", "peak_gpu_denoise_gib",
                                                       "latents_equal_to_none", "skipped", "error") if k in row}, flush=True)
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
