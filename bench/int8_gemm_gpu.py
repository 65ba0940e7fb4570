"""8-bit GEMMs on FLUX.1-dev 1024²'s linear shapes: INT8 (``torch._int_mm``) beside e4m3 (``torch._scaled_mm``) and bf16.

GPU only (issue 40). Why: e4m3's 3 mantissa bits cost flux-demo 3.5 points of shape accuracy however the
scales are cut (``bench/README.md``, sessions 23–25), while a symmetric INT8 grid with the same per-token /
per-channel scales rounds a well-scaled operand several times more finely; Hopper's tensor cores run
INT8 at the FP8 rate. This measures whether torch's INT8 GEMM reaches that rate on these shapes (on an H100,
2026-12-07, it did not: 0.86-1.11x bf16 against FP8's 1.54-1.67x; ``results/int8_gemm_gpu-h100-s26-2026-12-07.json``). Per shape
(M tokens × K in × N out), milliseconds (CUDA events, median of ``--rounds`` rounds of ``--iters`` calls)
and TFLOP/s of

* ``bf16`` — ``F.linear`` (cuBLAS), the exact-class path's GEMM;
* ``fp8-rowwise`` — ``_scaled_mm`` on e4m3 operands with per-row / per-column float32 scales, bf16 out
  (omniloop-quant's ``FP8Linear`` GEMM, quantisation of the input not included);
* ``int8-mm`` — ``_int_mm`` alone (int32 out): the GEMM's own rate;
* ``int8-mm+scale`` — ``_int_mm`` then the scales and the cast to bf16 in eager ops (what an unfused
  INT8 linear pays);
* ``int8-mm+scale-compiled`` — the same under ``torch.compile`` (inductor fuses the epilogue into one
  pointwise kernel after the extern GEMM, or a Triton template when it autotunes);

and each output's relative RMS error against the float32 product of the unquantised operands
(random-normal activations with a few outlier channels ×8, weights ~ N(0, 1/K)) — the grid's error — and,
for the 8-bit runs, against the float32 product of the *dequantised* operands (the numerical model):
what the kernel adds (accumulation, epilogue), as a relative RMS and as a gain (``<out, model> / <model,
model> - 1``: negative is a kernel that shrinks its products, which random rounding would not). JSON to ``--out``.

    python bench/int8_gemm_gpu.py --out $OUT
    python bench/int8_gemm_gpu.py --smoke --out /tmp/x    # the CPU check: tiny shapes, wall-clock timing
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _repo_paths import add_repo_packages

add_repo_packages()

import torch  # noqa: E402
from _common import cuda_ms, write_record  # noqa: E402

#: (name, M, K, N): FLUX.1-dev 1024² — 4,096 image + 512 text tokens; a single block's fused QKV + MLP
#: projection and its output projection, a double block's feed-forward, and the text stream's up-projection
SHAPES = [("single qkv+mlp", 4608, 3072, 21504), ("single proj_out", 4608, 15360, 3072),
          ("double ff up (image)", 4096, 3072, 12288), ("double ff down (image)", 4096, 12288, 3072),
          ("double ff up (text)", 512, 3072, 12288)]
SMOKE_SHAPES = [("smoke", 64, 256, 128)]
E4M3_MAX = 448.0
DEVICE = "cuda"


def operands(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(m, k, device=DEVICE, generator=g)
    x[:, torch.randperm(k, device=DEVICE, generator=g)[: max(1, k // 256)]] *= 8.0  # a few outlier channels
    w = torch.randn(n, k, device=DEVICE, generator=g) / k ** 0.5
    return x, w


def quantize(t: torch.Tensor, qmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: ``(q, scale [rows, 1] float32)`` with ``t ≈ q * scale``."""
    scale = t.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / qmax
    v = t / scale
    q = v.round().clamp(-qmax, qmax).to(dtype) if dtype == torch.int8 else v.clamp(-qmax, qmax).to(dtype)
    return q.contiguous(), scale.contiguous()


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()


def gain(out: torch.Tensor, model: torch.Tensor) -> float:
    return ((out.float() * model).sum() / (model * model).sum() - 1).item()


def int8_epilogue(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    return (acc.float() * sx * sw).to(torch.bfloat16)


def int8_linear(xq: torch.Tensor, wq_t: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    return int8_epilogue(torch._int_mm(xq, wq_t), sx, sw)


def wall_ms(fn: Any, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def measure(name: str, m: int, k: int, n: int, compiled: Any, iters: int, rounds: int) -> dict[str, Any]:
    """One shape's runs: ms, TFLOP/s and errors of each (a run this torch cannot do on this card: its error)."""
    x, w = operands(m, k, n)
    ref = x @ w.t()
    xb, wb = x.bfloat16(), w.bfloat16()
    x8, sx8 = quantize(x, E4M3_MAX, torch.float8_e4m3fn)
    w8, sw8 = quantize(w, E4M3_MAX, torch.float8_e4m3fn)
    xi, sxi = quantize(x, 127.0, torch.int8)
    wi, swi = quantize(w, 127.0, torch.int8)
    wi_t, swi_t = wi.t(), swi.reshape(1, -1)
    model8 = (x8.float() * sx8) @ (w8.float() * sw8).t()
    modeli = (xi.float() * sxi) @ (wi.float() * swi).t()
    runs: dict[str, Any] = {
        "bf16": lambda: torch.nn.functional.linear(xb, wb),
        "fp8-rowwise": lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx8, scale_b=sw8.reshape(1, -1),
                                                out_dtype=torch.bfloat16),
        "int8-mm": lambda: torch._int_mm(xi, wi_t),
        "int8-mm+scale": lambda: int8_linear(xi, wi_t, sxi, swi_t),
        "int8-mm+scale-compiled": lambda: compiled(xi, wi_t, sxi, swi_t),
    }
    rows: dict[str, Any] = {}
    flop = 2.0 * m * k * n
    for label, fn in runs.items():
        try:
            out = fn()
            ms = cuda_ms(fn, iters, rounds) if DEVICE == "cuda" else wall_ms(fn, iters)
        except Exception as e:  # e.g. a GEMM this torch does not run on this card
            rows[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps({"shape": name, "run": label, **rows[label]}), flush=True)
            continue
        row: dict[str, Any] = {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1)}
        if label == "int8-mm":
            out = out.float() * sxi * swi_t
        row["rel_rms_vs_fp32"] = round(rel_rms(out, ref), 5)
        if label != "bf16":
            model = model8 if label.startswith("fp8") else modeli
            row["rel_rms_vs_model"] = round(rel_rms(out, model), 6)
            row["gain_vs_model"] = float(f"{gain(out, model):.3g}")
        rows[label] = row
        print(json.dumps({"shape": name, "run": label, **row}), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tag", default="")
    ap.add_argument("--smoke", action="store_true", help="the CPU check: one tiny shape, eager runs, wall-clock ms")
    args = ap.parse_args(argv)
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("cannot run: no CUDA device (--smoke: the CPU check)")
        return 2
    record: dict[str, Any] = {"bench": "int8_gemm_gpu", "date": time.strftime("%Y-%m-%d"),
                              "command": " ".join(["python bench/int8_gemm_gpu.py", *(argv or sys.argv[1:])]),
                              "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "shapes": {}}
    compiled = int8_linear if args.smoke else torch.compile(int8_linear, fullgraph=True, dynamic=False)
    with torch.no_grad():
        for name, m, k, n in SMOKE_SHAPES if args.smoke else SHAPES:
            record["shapes"][name] = {"m": m, "k": k, "n": n, "runs": measure(name, m, k, n, compiled, args.iters, args.rounds)}
    if args.tag or args.smoke:  # the file's name: int8_gemm_gpu[-TAG]-<date>.json
        record["bench"] += f"-{args.tag or 'smoke'}"
    print(json.dumps({"wrote": str(write_record(record, args.out))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
