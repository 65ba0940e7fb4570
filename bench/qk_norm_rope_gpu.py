"""omniloop-kit's joint q/k norm + rotary kernel (``omniloop_kit.qk_norm_rope``) on FLUX.1-dev 1024²'s shapes.

GPU only. Per shape — a single-stream block's query (4,608 tokens, a chunk of the fused Q/K/V GEMM's
``[1, 4608, 9216]`` output) and a double-stream block's (512 context + 4,096 image tokens, chunks of
their own fused outputs), 24 heads of 128, bf16 — milliseconds (CUDA events, median of ``--rounds``
rounds of ``--iters`` calls) and effective GB/s (bytes read and written once: the parts, the output,
the float32 cos/sin tables, the norm weights) of

* ``eager`` — the reference ops (per-head ``torch.nn.RMSNorm``, ``torch.cat``, diffusers' ``apply_rotary_emb``),
* ``inductor`` — the same compiled (``torch.compile(fullgraph=True)``: what the compiled blocks ran before),
* ``kernel-h<N>-w<M>`` — the kit's kernel with ``N`` heads per program and ``M`` warps (``--configs``),

with each output's largest difference from ``eager`` in bf16 ulps of the largest value. JSON to ``--out``.

    python bench/qk_norm_rope_gpu.py --out $OUT
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
from _common import cuda_ms  # noqa: E402

#: (name, part lengths) at 24 heads x 128: FLUX.1-dev 1024² (512 T5 tokens + 64x64 packed latents)
SHAPES = [("single-block q", (4608,)), ("double-block q", (512, 4096))]
HEADS, D = 24, 128


def case(lens: tuple[int, ...]) -> tuple[list[torch.Tensor], list[Any], tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    parts, norms = [], []
    for n in lens:
        qkv = torch.randn(1, n, 3 * HEADS * D, device="cuda", dtype=torch.bfloat16, generator=g)
        parts.append(qkv[..., : HEADS * D])  # a fused-QKV chunk: token stride 9216
        norm = torch.nn.RMSNorm(D, eps=1e-6, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        norm.weight.copy_(1 + 0.1 * torch.randn(D, device="cuda", generator=g))
        norms.append(norm)
    angle = torch.rand(sum(lens), D // 2, device="cuda", generator=g) * 100
    return parts, norms, (angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1))


def ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    step = 2.0 ** (torch.frexp(ref.abs().max().float()).exponent.item() - 8)
    return (out.float() - ref.float()).abs().max().item() / step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", default="8x4,8x8,4x2,4x4,2x1,2x2,1x1",
                    help="kernel launches: heads per program x warps, comma-separated")
    args = ap.parse_args(argv)
    from omniloop_kit import qk_norm_rope as knr

    why = knr.unavailable_reason("cuda")
    if why:
        print(f"cannot run: {why}")
        return 2
    knr.prepare()
    record: dict[str, Any] = {"bench": "qk_norm_rope_gpu", "date": time.strftime("%Y-%m-%d"),
                              "command": " ".join(["python bench/qk_norm_rope_gpu.py", *(argv or sys.argv[1:])]),
                              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    with torch.no_grad():
        for name, lens in SHAPES:
            parts, norms, rotary = case(lens)
            total = sum(lens)
            nbytes = (total * HEADS * D * 2) * 2 + 2 * total * D * 4 + len(lens) * D * 2
            ref = knr.reference(parts, norms, rotary, HEADS)
            compiled = torch.compile(lambda p=parts, n=norms, r=rotary: knr.reference(p, n, r, HEADS), fullgraph=True)
            runs: dict[str, Any] = {"eager": lambda p=parts, n=norms, r=rotary: knr.reference(p, n, r, HEADS),
                                    "inductor": compiled}
            for bh, w in configs:
                if HEADS % bh:
                    continue
                runs[f"kernel-h{bh}-w{w}"] = (lambda p=parts, n=norms, r=rotary, bh=bh, w=w:
                                              knr.joint_norm_rope(p, n, r, HEADS, block_h=bh, num_warps=w))
            rows = {}
            for label, fn in runs.items():
                ms = cuda_ms(fn, args.iters, args.rounds)
                rows[label] = {"ms": round(ms, 4), "GB_s": round(nbytes / ms / 1e6, 1), "ulps_vs_eager": round(ulps(fn(), ref), 2)}
                print(json.dumps({"shape": name, "run": label, **rows[label]}), flush=True)
            record["shapes"][name] = {"tokens": list(lens), "bytes": nbytes, "runs": rows}
    out = Path(args.out) / f"qk_norm_rope_gpu-{record['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps({"wrote": str(out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
