"""Sparse attention (``sparse-tile``) against dense cuDNN SDPA on Wan 1.3B's self-attention shape.

Shape: 1 x 12 heads x 32,760 tokens x 128 (the 21 x 30 x 52 latent grid of 480 x 832 x 81),
bf16, q/k/v as ``[B, H, L, D]`` views of ``[B, L, H, D]`` memory (what the Wan processor hands a
backend). Side by side in one run, interleaved and repeated (median):

* ``dense-cudnn``: SDPA forced to cuDNN attention (``sdpa-cudnn``, the bf16 exact-class kernel);
* ``sparse-<density>``: the backend (token gather to tile order, compiled ``flex_attention`` with
  the cached BlockMask, scatter back) at densities 0.5 / 0.3 / 0.15 (``--densities``), plus
  ``sparse-1.0`` (the flex kernel computing everything: its own dense speed);
* ``flex-kernel-<density>``: the flex kernel alone on pre-gathered inputs (the gather's cost is the
  difference).

The default tile is the backend's (2 x 8 x 8 = 128 tokens = one kernel block).

Per variant: ms, effective TFLOP/s (dense attention FLOPs ``4 B H L^2 D`` / time — what the call
replaces), computed TFLOP/s (FLOPs of the 128 x 128 blocks the kernel actually visits / time),
the layout (tiles, window, kept token pairs, visited blocks), and the relative RMS error of the
output vs the dense cuDNN output on two inputs:

* ``random``: q, k, v ~ N(0, 1) — attention close to uniform, the worst case for any locality mask;
* ``structured``: q and k share a smooth function of the token's (t, h, w) position (random
  Fourier features, so q·k decays with distance) plus noise — attention concentrated near each
  token, as in a video DiT's self-attention; v ~ N(0, 1).

A kernel check (``check``) compares the backend with float32 SDPA given the same mask as a dense
boolean ``attn_mask``, on a small grid at each density and on the full grid at 0.3, so a wrong
block table would show (bf16 masked SDPA's own error is recorded beside it).

    python bench/attention_sparse.py --out $OUT          # H200: ~1.5 min (mostly kernel compiles; estimate)
    python bench/attention_sparse.py --smoke --out /tmp  # CPU, tiny grid: checks the script

Writes ``attention_sparse-<date>[-smoke].json`` to ``--out`` (default ``$OUT``, else bench/results).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _repo_paths import add_repo_packages  # noqa: E402

add_repo_packages()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import command_line, library_versions, machine, rel_rms, sync  # noqa: E402


def time_once(fn: Any) -> float:
    if torch.cuda.is_available():
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        return a.elapsed_time(e) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def dense_fn(cuda: bool) -> Any:
    if not cuda:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)

    return attend


def make_inputs(kind: str, grid: tuple[int, int, int], heads: int, d: int, device: str, dtype: torch.dtype,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``[1, H, L, D]`` views of ``[1, L, H, D]`` memory."""
    T, Hh, W = grid
    L = T * Hh * W
    g = torch.Generator(device="cpu").manual_seed(seed)
    v = torch.randn(1, L, heads, d, generator=g)
    if kind == "random":
        q = torch.randn(1, L, heads, d, generator=g)
        k = torch.randn(1, L, heads, d, generator=g)
    elif kind == "structured":
        # random Fourier features of the (t, h, w) position: phi(x) . phi(y) ~ exp(-|x - y|^2 / (2 l^2))
        t = torch.arange(T).view(T, 1, 1).expand(T, Hh, W).reshape(-1).float()
        h = torch.arange(Hh).view(1, Hh, 1).expand(T, Hh, W).reshape(-1).float()
        w = torch.arange(W).view(1, 1, W).expand(T, Hh, W).reshape(-1).float()
        pos = torch.stack([t / 1.5, h / 3.0, w / 3.0], dim=1)  # length scale: ~1.5 frames, ~3 rows/columns
        omega = torch.randn(heads, 3, d // 2, generator=g)
        phase = torch.einsum("lc,hcf->lhf", pos, omega)  # [L, H, d/2]
        phi = torch.cat([phase.cos(), phase.sin()], dim=-1) / math.sqrt(d // 2)  # unit norm per token
        gain = math.sqrt(12.0 * math.sqrt(d))  # q.k/sqrt(d) = 12 * similarity: logits spread over ~12
        q = gain * phi.unsqueeze(0) + 0.3 * torch.randn(1, L, heads, d, generator=g)
        k = gain * phi.unsqueeze(0) + 0.3 * torch.randn(1, L, heads, d, generator=g)
    else:
        raise ValueError(kind)
    return tuple(x.to(device=device, dtype=dtype).transpose(1, 2) for x in (q, k, v))  # type: ignore[return-value]


#: exploratory flex kernel options, timed on the random input at the middle density (GPU only)
KERNEL_VARIANTS = {
    "tma": {"USE_TMA": True},
    "m128n128w8s2": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", default="21,30,52", help="latent token grid T,H,W (default: Wan 480x832x81)")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--densities", default="0.5,0.3,0.15")
    ap.add_argument("--tile", default="2,8,8", help="tile size T,H,W in tokens (the backend's default)")
    ap.add_argument("--block", type=int, default=128, help="attention block (the backend's BLOCK; --smoke: 8)")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per variant per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median over all)")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results)")
    ap.add_argument("--smoke", action="store_true", help="tiny grid, float32, CPU is fine: checks the script")
    args = ap.parse_args(argv)

    import torch._dynamo  # every layout (its mask_mod) and kernel option is one more compile of the flex kernel

    from omniloop_attention.sparse import SparseTileAttention, flex_available

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    grid = (3, 4, 6) if args.smoke else tuple(int(x) for x in args.grid.split(","))
    heads, d = (2, 16) if args.smoke else (args.heads, args.head_dim)
    tile = (1, 2, 2) if args.smoke else tuple(int(x) for x in args.tile.split(","))
    block = 8 if args.smoke else args.block
    reps, rounds = (1, 1) if args.smoke else (args.reps, args.rounds)
    densities = [float(x) for x in args.densities.split(",")]
    L = grid[0] * grid[1] * grid[2]
    flops = 4 * heads * L * L * d
    date = dt.date.today().isoformat()
    out_dir = Path(args.out or os.environ.get("OUT") or HERE / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"attention_sparse-{date}{'-smoke' if args.smoke else ''}.json"
    record: dict[str, Any] = {
        "bench": "attention_sparse", "command": command_line("bench/attention_sparse.py", argv), "date": date,
        "machine": {**machine(cudnn=torch.backends.cudnn.version() if cuda else None), **library_versions()},
        "setup": {"grid": list(grid), "tokens": L, "heads": heads, "head_dim": d, "dtype": str(dtype), "tile": list(tile),
                  "dense_flops": flops, "reps": reps, "rounds": rounds,
                  "effective_tflops": "4*B*H*L^2*D / time (the dense attention the call replaces)",
                  "computed_tflops": "effective * fraction of 128x128 blocks visited",
                  "rel_rms": "relative RMS of the output vs the dense cuDNN output, same inputs"},
        "flex_available": flex_available(), "results": {}, "errors": [],
    }

    def write() -> None:
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")

    print(f"torch {torch.__version__} on {device}; grid {grid} ({L} tokens); writing {path}", flush=True)
    dense = dense_fn(cuda)
    backends = {dens: SparseTileAttention(dens, tile=tile, block=block) for dens in [*densities, 1.0]}
    layouts = {}
    for dens, fn in backends.items():
        t = time.perf_counter()
        lay = fn.layout(grid, device)
        layouts[dens] = {"blocks": lay.n_blocks, "kept_blocks_per_query_block": lay.keep,
                         "kept_token_pairs": round(lay.density, 4), "visited_blocks": round(lay.block_density, 4),
                         "layout_build_s": round(time.perf_counter() - t, 3)}
    record["layouts"] = {str(k): v for k, v in layouts.items()}
    write()

    # ---- kernel check against a dense boolean mask, smaller grid -------------------------------
    try:
        checks = {}
        # on the GPU: a small grid, and the full grid at the middle density (the timed backend object:
        # each new layout is one more compile of the kernel)
        mid = densities[len(densities) // 2]
        cases = [((6, 10, 16), mid), (grid, mid)] if cuda else [(grid, x) for x in densities]
        for cgrid, dens in cases:
            cq, ck, cv = make_inputs("structured", cgrid, heads, d, device, dtype, seed=3)
            fn = backends[dens] if cgrid == grid else SparseTileAttention(dens, tile=tile, block=block)
            mask = fn.layout(cgrid, "cpu").token_mask().to(device)
            ref = F.scaled_dot_product_attention(cq.float(), ck.float(), cv.float(), attn_mask=mask)
            out = fn(cq, ck, cv, grid=cgrid)
            masked_lowp = F.scaled_dot_product_attention(cq, ck, cv, attn_mask=mask)
            checks[f"{'x'.join(map(str, cgrid))}@{dens}"] = {
                "rel_rms_vs_masked_fp32": rel_rms(out, ref),
                "masked_sdpa_same_dtype_rel_rms_vs_masked_fp32": rel_rms(masked_lowp, ref)}
            del cq, ck, cv, mask, ref, out, masked_lowp
        record["check"] = checks
        print("check", json.dumps(checks), flush=True)
    except Exception as exc:
        record["errors"].append({"part": "check", "error": f"{type(exc).__name__}: {exc}"[:800],
                                 "traceback_tail": traceback.format_exc()[-1500:]})
    write()

    # ---- speed and error on the full shape ------------------------------------------------------
    results: dict[str, Any] = {}
    for kind in ("random", "structured"):
        try:
            q, k, v = make_inputs(kind, grid, heads, d, device, dtype, seed=1)
            ref = dense(q, k, v)
            variants: dict[str, Any] = {"dense-cudnn" if cuda else "dense-sdpa": lambda q=q, k=k, v=v: dense(q, k, v)}
            outs: dict[str, torch.Tensor] = {}
            for dens, fn in backends.items():
                variants[f"sparse-{dens}"] = (lambda fn=fn, q=q, k=k, v=v: fn(q, k, v, grid=grid))
                if kind == "random" and cuda and dens == mid:  # kernel options other than torch's defaults
                    lay = fn.layout(grid, device)
                    qp, kp, vp = (x.index_select(-2, lay.perm) for x in (q, k, v))
                    from omniloop_attention.sparse import _flex_for

                    flex = _flex_for(torch.device(device))
                    for tag, opts in KERNEL_VARIANTS.items():
                        variants[f"flex-kernel-{tag}-{dens}"] = (
                            lambda qp=qp, kp=kp, vp=vp, lay=lay, flex=flex, opts=opts:
                            flex(qp, kp, vp, block_mask=lay.block_mask, kernel_options=opts))
                if kind == "random":  # the kernel alone: once is enough (speed does not depend on values)
                    lay = fn.layout(grid, device)
                    qp, kp, vp = (x.index_select(-2, lay.perm) for x in (q, k, v))
                    from omniloop_attention.sparse import _flex_for

                    flex = _flex_for(torch.device(device))
                    variants[f"flex-kernel-{dens}"] = (lambda qp=qp, kp=kp, vp=vp, lay=lay, flex=flex:
                                                       flex(qp, kp, vp, block_mask=lay.block_mask))
            warm: dict[str, float] = {}
            for name, fn_ in list(variants.items()):  # warm-up: compiles
                t = time.perf_counter()
                try:
                    o = fn_()
                    sync()
                except Exception as exc:  # an exploratory kernel option the kernel refuses: record, drop
                    record["errors"].append({"part": f"{kind}/{name}", "error": f"{type(exc).__name__}: {exc}"[:600]})
                    del variants[name]
                    continue
                warm[name] = round(time.perf_counter() - t, 2)
                if name.startswith("sparse-"):
                    outs[name] = o
                elif name.startswith("flex-kernel-") and not name.startswith("flex-kernel-0") \
                        and not name.startswith("flex-kernel-1"):
                    ref_k = variants[f"flex-kernel-{name.rsplit('-', 1)[-1]}"]()
                    record.setdefault("kernel_option_checks", {})[name] = rel_rms(o, ref_k)
            times: dict[str, list[float]] = {n: [] for n in variants}
            for _ in range(rounds):  # interleaved
                for name, fn_ in variants.items():
                    for _ in range(reps):
                        times[name].append(time_once(fn_))
            dense_ms = statistics.median(times["dense-cudnn" if cuda else "dense-sdpa"]) * 1e3
            rows = {}
            for name, ts in times.items():
                ms = statistics.median(ts) * 1e3
                row: dict[str, Any] = {"ms": round(ms, 3), "ms_min": round(min(ts) * 1e3, 3),
                                       "effective_tflops": round(flops / (ms / 1e3) / 1e12, 1),
                                       "speedup_vs_dense": round(dense_ms / ms, 3), "warmup_s": warm[name]}
                dens_s = name.rsplit("-", 1)[-1] if not name.startswith("dense") else None
                if dens_s is not None:
                    lay_info = layouts[float(dens_s)]
                    row["computed_tflops"] = round(row["effective_tflops"] * lay_info["visited_blocks"], 1)
                    row["layout"] = lay_info
                if name in outs:
                    row["rel_rms_vs_dense"] = round(rel_rms(outs[name], ref), 5)
                rows[name] = row
                print(kind, name, json.dumps({k: v for k, v in row.items() if k != "layout"}), flush=True)
            results[kind] = rows
            del q, k, v, ref, outs, variants
        except Exception as exc:
            record["errors"].append({"part": kind, "error": f"{type(exc).__name__}: {exc}"[:800],
                                     "traceback_tail": traceback.format_exc()[-1500:]})
            print("error", kind, exc, flush=True)
        record["results"] = results
        write()
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
