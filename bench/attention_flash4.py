"""flash-attn-4 (CuTe DSL, Hopper) vs torch SDPA (cuDNN, FA2) on Wan's attention shapes: speed and error.

GPU only. Per shape (q/k/v ``[B, L, H, D]`` bf16 tensors handed to each kernel as ``[B, H, L, D]``
views, as the Wan blocks do): milliseconds (CUDA events, median over interleaved rounds) and TFLOP/s
(``4·B·H·Lq·Lk·D`` / time) of

* ``sdpa-cudnn`` — torch SDPA forced to cuDNN (what diffusers gets on an H200),
* ``sdpa-flash`` — torch SDPA forced to its FlashAttention-2 kernel,
* ``flash-attn-4`` — omniloop-attention's backend (``omniloop_attention.flash4``: the custom op
  around ``flash_attn.cute.flash_attn_func``), and ``fa4-raw``, the package function called
  directly (the op's overhead),

and, on fresh inputs (another seed), each kernel's error against cuDNN (whole output) and against
a float32 reference (softmax(q·kᵀ·scale)·v in float32, TF32 off) on ``--ref-rows`` random query rows
of every head: max |diff| and relative RMS (‖out − ref‖ / ‖ref‖). Also: the first call's time (the
DSL's JIT compile), whether every output is finite, and whether ``torch.compile(fullgraph=True)``
keeps the backend in its graph (equal to eager).

Installed flash-attn-4 needs ``nvidia-cutlass-dsl`` + ``-libs-core`` + ``-libs-cu13`` (see
``plugins/compute/attention/README.md``). The record lists the distributions' versions and, if the import
fails, the error.

    python bench/attention_flash4.py --out $OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import importlib.metadata as md
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _repo_paths import add_repo_packages

add_repo_packages()

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

HERE = Path(__file__).resolve().parent
DISTS = ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
         "nvidia-cutlass-dsl-libs-cu13", "nvidia-cutlass-dsl-libs-cu12", "quack-kernels", "apache-tvm-ffi",
         "torch-c-dlpack-ext", "cuda-bindings", "cuda-python", "nvidia-cudnn-cu13")
#: (batch, heads, query tokens, key tokens): Wan 1.3B self-attention, 14B self-attention, a FLUX-sized
#: self-attention (4,608 tokens, 24 heads), Wan 1.3B cross-attention (512 text tokens)
SHAPES = [(1, 12, 32760, 32760), (1, 40, 32760, 32760), (1, 24, 4608, 4608), (1, 12, 32760, 512)]
HEAD_DIM = 128


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for d in DISTS:
        try:
            out[d] = md.version(d)
        except md.PackageNotFoundError:
            out[d] = None
    return out


def sdpa_with(backend: SDPBackend):  # type: ignore[no-untyped-def]
    def fn(q, k, v):  # type: ignore[no-untyped-def]
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v)
    return fn


def kernels(fa4_ok: bool) -> dict[str, Any]:
    ks: dict[str, Any] = {"sdpa-cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION),
                          "sdpa-flash": sdpa_with(SDPBackend.FLASH_ATTENTION)}
    if fa4_ok:
        from flash_attn.cute import flash_attn_func

        from omniloop_attention.flash4 import flash_attn4

        def raw(q, k, v):  # type: ignore[no-untyped-def]
            out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

        ks["flash-attn-4"] = flash_attn4
        ks["fa4-raw"] = raw
    return ks


def inputs(B: int, H: int, Lq: int, Lk: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Lq, H, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Lk, H, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Lk, H, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    return tuple(x.transpose(1, 2) for x in (q, k, v))  # [B, H, L, D] views, like Wan's processor


def time_kernels(ks: dict[str, Any], q, k, v, iters: int, rounds: int) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    ms: dict[str, list[float]] = {n: [] for n in ks}
    for _ in range(rounds):
        for name, fn in ks.items():  # interleaved: each round times every kernel once
            for _ in range(2):
                fn(q, k, v)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn(q, k, v)
            end.record()
            end.synchronize()
            ms[name].append(start.elapsed_time(end) / iters)
    return ms


def reference_rows(q, k, v, rows: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """float32 attention of the query rows ``rows`` (every head): ``[B, H, len(rows), D]``."""
    qs = q[:, :, rows].float()
    s = torch.matmul(qs, k.float().transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    return torch.matmul(s.softmax(dim=-1), v.float())


def err(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    d = out.float() - ref.float()
    return {"max_abs": float(d.abs().max()), "rel_rms": float(d.norm() / ref.float().norm().clamp_min(1e-30))}


def bench_args(doc: str) -> argparse.Namespace:
    """The kernel benches' command line (this one's and ``attention_fa3.py``'s)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ref-rows", type=int, default=512)
    ap.add_argument("--shapes", default="", help="indices into SHAPES (comma list); default all")
    return ap.parse_args()


def start_record(bench: str, args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    """A GPU kernel bench's record (machine, command) and where it is written; exits without CUDA."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{bench}.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    date = dt.date.today().isoformat()
    rec: dict[str, Any] = {
        "bench": bench, "date": date, "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                    "cudnn": torch.backends.cudnn.version(), "capability": list(torch.cuda.get_device_capability())},
    }
    out_dir = Path(args.out or os.environ.get("OUT") or HERE / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    return rec, out_dir / f"{bench}-{date}.json"


def time_and_check(row: dict[str, Any], ks: dict[str, Any], make_inputs: Any, Lq: int, flops: int,
                   args: argparse.Namespace, vs_cudnn: bool = False) -> None:
    """Into ``row``: every kernel timed on ``make_inputs(seed=0)`` (ms, per-round ms, TFLOP/s), then every output
    on fresh ``make_inputs(seed=1)`` checked (finite; error vs float32 on ``args.ref_rows`` random query rows;
    with ``vs_cudnn``, vs ``sdpa-cudnn``'s whole output)."""
    q, k, v = make_inputs(seed=0)
    ms = time_kernels(ks, q, k, v, args.iters, args.rounds)
    row["ms"] = {n: round(statistics.median(v_), 3) for n, v_ in ms.items()}
    row["ms_rounds"] = {n: [round(x, 3) for x in v_] for n, v_ in ms.items()}
    row["tflops"] = {n: round(flops / (m * 1e-3) / 1e12, 1) for n, m in row["ms"].items()}
    del q, k, v
    q, k, v = make_inputs(seed=1)
    outs = {n: fn(q, k, v) for n, fn in ks.items()}
    g = torch.Generator(device="cuda").manual_seed(2)
    rows = torch.randperm(Lq, device="cuda", generator=g)[: args.ref_rows]
    ref = reference_rows(q, k, v, rows)
    row["finite"] = {n: bool(torch.isfinite(o).all()) for n, o in outs.items()}
    if vs_cudnn:
        row["vs_cudnn"] = {n: err(o, outs["sdpa-cudnn"]) for n, o in outs.items() if n != "sdpa-cudnn"}
    row["vs_fp32_ref_rows"] = {n: err(o[:, :, rows], ref) for n, o in outs.items()}
    row["ref_rows"] = int(rows.numel())
    del q, k, v, outs, ref
    torch.cuda.empty_cache()


def run_shapes(rec: dict[str, Any], path: Path, shapes: list[Any], measure: Any, show: tuple[str, ...],
               compile_check: Any = None) -> None:
    """Each shape measured into a row of ``rec["shapes"]`` (``measure(row, shape)``; an exception becomes the
    row's error), ``show``'s keys printed and the record rewritten after each; then ``compile_check()``."""
    for shape in shapes:
        row: dict[str, Any] = {}
        try:
            measure(row, shape)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:800]
            row["traceback_tail"] = traceback.format_exc()[-1500:]
        print(json.dumps({k_: row.get(k_) for k_ in show}), flush=True)
        rec["shapes"].append(row)
        path.write_text(json.dumps(rec, indent=1) + "\n")
    if compile_check is not None:
        rec["torch_compile"] = compile_check()
        print(json.dumps({"torch_compile": rec["torch_compile"]}), flush=True)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {path}")


def compile_check() -> dict[str, Any]:
    from omniloop_attention.flash4 import flash_attn4

    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(1, 1000, 4, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for _ in range(3))

    def f(q, k, v):  # type: ignore[no-untyped-def]
        return flash_attn4(q * 1.5, k, v) + 1.0

    eager = f(q, k, v)
    try:
        explain = torch._dynamo.explain(f)(q, k, v)
        compiled = torch.compile(f, fullgraph=True, dynamic=False)(q, k, v)
        return {"fullgraph": True, "graph_breaks": explain.graph_break_count, "equal_to_eager": bool(torch.equal(compiled, eager)),
                "max_abs_vs_eager": float((compiled.float() - eager.float()).abs().max())}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:600]}


def main() -> int:
    args = bench_args(__doc__)
    rec, path = start_record("attention_flash4", args)
    rec.update(versions=versions(), shapes=[])
    t = time.perf_counter()
    try:
        import cutlass.cute  # noqa: F401
        import flash_attn.cute  # noqa: F401

        rec["import_s"] = round(time.perf_counter() - t, 2)
        rec["cutlass_cute_file"] = getattr(sys.modules["cutlass.cute"], "__file__", None)
        fa4_ok = True
    except Exception as exc:
        rec["import_error"] = f"{type(exc).__name__}: {exc}"
        rec["import_traceback"] = traceback.format_exc()[-2000:]
        fa4_ok = False
    from omniloop_attention.flash4 import flash_attn4_available

    rec["backend_available"] = flash_attn4_available()
    ks = kernels(fa4_ok and rec["backend_available"] is None)
    print(json.dumps({k: rec[k] for k in ("versions", "backend_available")} | {"import_error": rec.get("import_error")}), flush=True)

    def measure(row: dict[str, Any], shape: tuple[int, ...]) -> None:
        B, H, Lq, Lk = shape
        row.update(batch=B, heads=H, q_tokens=Lq, k_tokens=Lk, head_dim=HEAD_DIM)
        if "flash-attn-4" in ks:  # the first call compiles the DSL kernel for this shape
            q, k, v = inputs(B, H, Lq, Lk, seed=0)
            torch.cuda.synchronize()
            t = time.perf_counter()
            ks["flash-attn-4"](q, k, v)
            torch.cuda.synchronize()
            row["fa4_first_call_s"] = round(time.perf_counter() - t, 2)
            del q, k, v
        time_and_check(row, ks, functools.partial(inputs, B, H, Lq, Lk), Lq, 4 * B * H * Lq * Lk * HEAD_DIM, args,
                       vs_cudnn=True)
        if "flash-attn-4" in row["ms"]:
            row["fa4_speedup_vs_cudnn"] = round(row["ms"]["sdpa-cudnn"] / row["ms"]["flash-attn-4"], 3)

    picks = [SHAPES[int(i)] for i in args.shapes.split(",") if i] or SHAPES
    run_shapes(rec, path, picks, measure, ("heads", "q_tokens", "k_tokens", "ms", "tflops", "fa4_speedup_vs_cudnn",
                                           "vs_fp32_ref_rows", "error"), compile_check if "flash-attn-4" in ks else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
