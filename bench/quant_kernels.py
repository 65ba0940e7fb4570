"""omniloop-quant's GELU + e4m3 row quantisation kernel against the bytes it moves (issue 40).

GPU only (``--smoke``: tiny shapes on the CPU under Triton's interpreter, to check the script). Per
shape — the FP8 feed-forward's hidden at 480×832×81: Wan 1.3B ``32,760 × 8,960`` and 14B
``32,760 × 13,824`` bf16 — the milliseconds (CUDA events, median of ``--reps``) of

* ``torch-eager``: ``kernels.reference`` (GELU, then the per-row amax, scale and e4m3 cast) op by op;
* ``inductor``: the same under ``torch.compile`` (what the feed-forward ran before the kernel);
* ``kernel w<N>``: ``gelu_quantize_rows`` with the whole row in registers as power-of-two pieces
  (``kernels.pieces``) at ``num_warps`` N (the default's choice marked); ``kernel pow2``: the row as one
  block padded to a power of two (the kernel's first form, 83 % of its lanes masked at 8,960); and
  ``kernel c<C> w<N>``: the row in ``C``-wide pieces, read twice;

each with its effective bandwidth (bf16 read + e4m3 written + scales, over the time) as a fraction of
``--peak-gbs`` (4,800 GB/s: the H200's HBM3e), and each variant's agreement with the reference (share
of equal e4m3 values, scales' max relative difference). The H200 run of 2026-12-05 put the default
at ~0.8 ms per 1.3B call (~1.1 TB/s, inferred from the step time it saved): this script measures it
and the variants that could take it towards the ~0.2 ms its bytes need.

``--parts norm`` (in the default ``gelu,norm``) times ``omniloop_quant.norm_kernels`` the same way at
Wan's three sites in front of an FP8 GEMM (``norm1``: LayerNorm + modulation; ``norm2``: gated residual
add + affine LayerNorm; ``norm3``: residual add + LayerNorm + modulation), 32,760 tokens at 1.3B's
1,536 and 14B's 5,120 wide, against the same computation in torch eager and under inductor (what Wan's
compiled block runs today: 0.10–0.24 ms a call at 1.3B in the H200 profile of 2026-12-05); bytes: bf16
in, e4m3 + scales out, plus the delta in and the new residual out where there is one.

    python bench/quant_kernels.py --out $OUT
    python bench/quant_kernels.py --smoke --no-write
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _repo_paths import add_repo_packages

add_repo_packages()

if "--smoke" in sys.argv:  # the kernels on the CPU: Triton's interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from _common import add_output_args, command_line, machine, publish  # noqa: E402

HERE = Path(__file__).resolve().parent
SHAPES = {"wan-1.3b-ffn": (32760, 8960), "wan-14b-ffn": (32760, 13824)}
SMOKE_SHAPES = {"smoke": (8, 640)}
#: the residual / LayerNorm / modulation sites in front of Wan's FP8 GEMMs: 32,760 tokens x the model width
NORM_SHAPES = {"wan-1.3b-norm": (32760, 1536), "wan-14b-norm": (32760, 5120)}
SMOKE_NORM_SHAPES = {"smoke-norm": (6, 192)}
NORM_SITES = ("norm1", "norm2", "norm3")
NORM_WARPS = (2, 4, 8, 16)
WARPS = (2, 4, 8, 16)
CHUNKS = ((1024, 4), (2048, 8), (4096, 8))


def timed(fn: Any, reps: int, device: str) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on the GPU, wall clock on the CPU)."""
    import time

    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def agreement(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    (q, s), (rq, rs) = got, want
    return {"equal_e4m3_share": round(float((q.float() == rq.float()).float().mean()), 6),
            "scale_max_rel_diff": float(((s - rs).abs() / rs.abs().clamp(min=1e-30)).max())}


def run_sides(name: str, sides: list[tuple[str, Any]], moved: int, args: argparse.Namespace, device: str,
              compare: Any) -> list[dict[str, Any]]:
    """Time each ``(label, fn)``; a kernel side also gets ``compare(fn())`` (its agreement with the torch ops)."""
    rows = []
    for label, fn in sides:
        try:
            ms = timed(fn, args.reps, device)
            gbs = moved / (ms * 1e-3) / 1e9
            row = {"side": label, "ms": round(ms, 4), "gb_per_s": round(gbs, 1),
                   "fraction_of_peak": round(gbs / args.peak_gbs, 3) if device == "cuda" else None}
            if label.startswith("kernel"):
                row["vs_reference"] = compare(fn())
        except Exception as exc:  # one variant failing (a launch that does not fit) leaves the others
            row = {"side": label, "error": f"{type(exc).__name__}: {exc}"[:400]}
        print(name, row, flush=True)
        rows.append(row)
    return rows


def measure(name: str, shape: tuple[int, int], args: argparse.Namespace, device: str) -> dict[str, Any]:
    from omniloop_quant import kernels

    m, n = shape
    torch.manual_seed(0)
    h = (torch.randn(m, n, device=device) * 3).to(torch.bfloat16)
    moved = m * n * 2 + m * n * 1 + m * 4  # bf16 in, e4m3 out, float32 scales
    want = kernels.reference(h, "tanh")
    default_w = kernels.PIECES_WARPS
    pow2_w = kernels.default_warps(max(16, 1 << (n - 1).bit_length()))
    sides: list[tuple[str, Any]] = [("torch-eager", lambda: kernels.reference(h, "tanh"))]
    if device == "cuda":
        sides.append(("inductor", torch.compile(lambda: kernels.reference(h, "tanh"), fullgraph=True)))
    warps = (default_w,) if args.smoke else WARPS
    for w in warps:
        sides.append((f"kernel w{w}" + (" (default)" if w == default_w else ""),
                      lambda w=w: kernels.gelu_quantize_rows(h, "tanh", num_warps=w)))
    sides.append((f"kernel pow2 w{pow2_w} (first form)", lambda: kernels.gelu_quantize_rows(h, "tanh", pow2=True)))
    for c, w in (((256, 4),) if args.smoke else CHUNKS):
        sides.append((f"kernel c{c} w{w}", lambda c=c, w=w: kernels.gelu_quantize_rows(h, "tanh", chunk=c, num_warps=w)))
    rows = run_sides(name, sides, moved, args, device, lambda got: agreement(got, want))
    return {"shape": name, "rows_cols": [m, n], "bytes_moved": moved, "sides": rows}


def norm_site(site: str, b: int, length: int, n: int, device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Wan's three sites in front of an FP8 GEMM (omniloop_quant.norm_kernels): ``norm1`` (LayerNorm +
    modulation), ``norm2`` (gated residual add + affine LayerNorm), ``norm3`` (residual add + LayerNorm +
    modulation); random values at the bench shape."""
    torch.manual_seed(0)
    x = (torch.randn(b, length, n, device=device) * 2).to(torch.bfloat16)
    vec = [torch.randn(b, 1, n, device=device) * 0.3 for _ in range(3)]
    delta = torch.randn(b, length, n, device=device).to(torch.bfloat16)
    return x, {"norm1": {"scale": vec[0], "shift": vec[1]},
               "norm2": {"delta": delta, "gate": vec[2], "weight": torch.ones(n, device=device), "bias": vec[0].reshape(-1)[:n]},
               "norm3": {"delta": delta, "scale": vec[0], "shift": vec[1]}}[site]


def measure_norm(name: str, shape: tuple[int, int], site: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    from omniloop_quant import norm_kernels

    m, n = shape
    x, kw = norm_site(site, 1, m, n, device)
    eps = 1e-6
    moved = m * n * (2 + 1) + m * 4 + (m * n * 4 if "delta" in kw else 0)  # x in, e4m3 + scales out (+ delta in, residual out)
    want = norm_kernels.reference(x, eps=eps, **kw)

    def compare(got: Any) -> dict[str, Any]:
        out = agreement(got[1:], want[1:])
        if want[0] is not None:
            out["residual_equal_share"] = round(float((got[0] == want[0]).float().mean()), 6)
        return out

    sides: list[tuple[str, Any]] = [("torch-eager", lambda: norm_kernels.reference(x, eps=eps, **kw))]
    if device == "cuda":
        sides.append(("inductor", torch.compile(lambda: norm_kernels.reference(x, eps=eps, **kw), fullgraph=True)))
    for w in ((4,) if args.smoke else NORM_WARPS):
        sides.append((f"kernel w{w}" + (" (default)" if w == 4 else ""),
                      lambda w=w: norm_kernels.residual_norm_quantize_rows(x, eps=eps, num_warps=w, **kw)))
    rows = run_sides(f"{name} {site}", sides, moved, args, device, compare)
    return {"shape": name, "site": site, "rows_cols": [m, n], "bytes_moved": moved, "sides": rows}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_args(ap, HERE / "results")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="the GPU's memory bandwidth, GB/s")
    ap.add_argument("--parts", default="gelu,norm", help="gelu: the FFN's GELU + e4m3 kernel; norm: the residual + "
                    "LayerNorm + modulation + e4m3 kernel at Wan's three sites (omniloop_quant.norm_kernels)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise SystemExit("bench/quant_kernels.py times a CUDA kernel: run it on a GPU (or --smoke on the CPU)")
    if args.smoke:
        args.reps = 1
    parts = set(args.parts.split(","))
    if parts - {"gelu", "norm"}:
        raise SystemExit(f"--parts: unknown {sorted(parts - {'gelu', 'norm'})} (gelu, norm)")
    results = []
    if "gelu" in parts:
        results += [measure(name, shape, args, device) for name, shape in (SMOKE_SHAPES if args.smoke else SHAPES).items()]
    if "norm" in parts:
        results += [measure_norm(name, shape, site, args, device)
                    for name, shape in (SMOKE_NORM_SHAPES if args.smoke else NORM_SHAPES).items() for site in NORM_SITES]
    record = {"bench": "quant_kernels" + ("-smoke" if args.smoke else ""), "date": dt.date.today().isoformat(),
              "command": command_line("bench/quant_kernels.py", argv), "machine": machine(), "results": results}
    return publish(record, args)


if __name__ == "__main__":
    raise SystemExit(main())
