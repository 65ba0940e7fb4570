"""FlashAttention-3 (``flash-attn-3``, ``fa3-fp8``) vs cuDNN (``sdpa-cudnn``, ``cudnn-fp8``) on Wan's shapes.

GPU only (Hopper). Per shape (q/k/v ``[B, H, L, D]`` bf16 views of ``[B, L, H, D]`` tensors, as the
Wan blocks hand them over): milliseconds (CUDA events, median over interleaved rounds) and TFLOP/s
(``4·B·H·Lq·Lk·D`` / time) of

* ``sdpa-cudnn`` — torch SDPA forced to cuDNN (diffusers' kernel on Hopper), bf16,
* ``flash-attn-3`` — omniloop-attention's backend around ``torch.ops.flash_attn_3.fwd``, bf16,
* ``cudnn-fp8`` / ``fa3-fp8`` — the FP8 backends called with bf16 q/k/v (each quantises q, k, v per
  tensor first), and ``…-preq``: ``attend_quantized`` with q and k already e4m3 (what Wan's fused
  QK-norm + rotary kernel hands over; v is still quantised inside);

and, on fresh inputs, each output's error against a float32 reference (softmax(q·kᵀ·scale)·v, TF32
off) on ``--ref-rows`` random query rows of every head: max |diff| and relative RMS. Plus whether
``torch.compile(fullgraph=True)`` keeps ``flash-attn-3`` in its graph (equal to eager).

    python bench/attention_fa3.py --out $OUT      # FlashAttention-3 built by build_flash_attn_3.sh on PYTHONPATH
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _repo_paths import add_repo_packages

add_repo_packages()

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from attention_flash4 import bench_args, run_shapes, sdpa_with, start_record, time_and_check  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

HERE = Path(__file__).resolve().parent
#: (batch, heads, query tokens, key tokens, head dim): Wan 1.3B and 14B self-attention (480x832x81),
#: a FLUX-sized self-attention, a small head-dim-32 one (wan-demo's head dim; FA3 runs it on its 64 kernel)
SHAPES = [(1, 12, 32760, 32760, 128), (1, 40, 32760, 32760, 128), (1, 24, 4608, 4608, 128), (2, 12, 320, 320, 32)]


def inputs(B: int, H: int, Lq: int, Lk: int, D: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for L in (Lq, Lk, Lk)]
    return tuple(x.transpose(1, 2) for x in xs)


def kernels() -> tuple[dict[str, Any], dict[str, str | None]]:
    from omniloop_attention.flash3 import fa3_fp8, fa3_fp8_available, flash_attn3, flash_attn3_available
    from omniloop_attention.fp8 import cudnn_fp8, cudnn_fp8_available, quantize

    avail = {"flash-attn-3": flash_attn3_available(), "fa3-fp8": fa3_fp8_available(), "cudnn-fp8": cudnn_fp8_available()}
    ks: dict[str, Any] = {"sdpa-cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION)}

    def preq(backend):  # type: ignore[no-untyped-def]
        def fn(q, k, v):  # type: ignore[no-untyped-def]
            key = (q.data_ptr(), k.data_ptr())
            if fn.key != key:  # quantise q and k once per input set (outside the timing, as the fused kernel does)
                fn.key, fn.qk = key, (*quantize(q), *quantize(k))
            q8, dq, k8, dk = fn.qk
            return backend.attend_quantized(q8, dq, k8, dk, v, q.dtype)
        fn.key = None
        return fn

    if avail["flash-attn-3"] is None:
        ks["flash-attn-3"] = flash_attn3
    if avail["cudnn-fp8"] is None:
        ks["cudnn-fp8"] = cudnn_fp8
        ks["cudnn-fp8-preq"] = preq(cudnn_fp8)
    if avail["fa3-fp8"] is None:
        ks["fa3-fp8"] = fa3_fp8
        ks["fa3-fp8-preq"] = preq(fa3_fp8)
    return ks, avail


def compile_check() -> dict[str, Any]:
    from omniloop_attention.flash3 import fa3_fp8, flash_attn3

    q, k, v = inputs(1, 4, 1000, 1000, 128, seed=7)
    out: dict[str, Any] = {}
    for name, fn in (("flash-attn-3", flash_attn3), ("fa3-fp8", fa3_fp8)):
        def f(q, k, v, fn=fn):  # type: ignore[no-untyped-def]
            return fn(q * 1.5, k, v) + 1.0

        try:
            eager = f(q, k, v)
            explain = torch._dynamo.explain(f)(q, k, v)
            compiled = torch.compile(f, fullgraph=True, dynamic=False)(q, k, v)
            out[name] = {"graph_breaks": explain.graph_break_count, "equal_to_eager": bool(torch.equal(compiled, eager)),
                         "max_abs_vs_eager": float((compiled.float() - eager.float()).abs().max())}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
    return out


def main() -> int:
    args = bench_args(__doc__)
    rec, path = start_record("attention_fa3", args)
    ks, avail = kernels()
    rec.update(available=avail, kernels=list(ks), shapes=[])
    print(json.dumps({"available": avail}), flush=True)

    def measure(row: dict[str, Any], shape: tuple[int, ...]) -> None:
        B, H, Lq, Lk, D = shape
        row.update(batch=B, heads=H, q_tokens=Lq, k_tokens=Lk, head_dim=D)
        time_and_check(row, ks, functools.partial(inputs, B, H, Lq, Lk, D), Lq, 4 * B * H * Lq * Lk * D, args)
        for a, b in (("flash-attn-3", "sdpa-cudnn"), ("fa3-fp8", "cudnn-fp8"), ("fa3-fp8-preq", "cudnn-fp8-preq")):
            if a in row["ms"] and b in row["ms"]:
                row[f"speedup_{a}_vs_{b}"] = round(row["ms"][b] / row["ms"][a], 3)

    picks = [SHAPES[int(i)] for i in args.shapes.split(",") if i] or SHAPES
    run_shapes(rec, path, picks, measure, ("heads", "q_tokens", "head_dim", "ms", "tflops", "vs_fp32_ref_rows", "error"),
               compile_check if "flash-attn-3" in ks else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
