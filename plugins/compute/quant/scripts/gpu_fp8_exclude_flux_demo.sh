#!/usr/bin/env bash
# Issue 40, the run after session 27: flux-demo's FP8 effect is the weights' e4m3 rounding (bench/README.md, "Session
# 27"); on the CPU, keeping the attention q/k/v projections in bf16 removed the objects' ~1 % shrink. This runs, on
# one GPU, bf16 and FP8 with those layers kept (bench/fp8_exclude.py) at the seeds where the GPU's FP8 loses its shape
# verdicts (0 and 1: 29 lost / 12 gained with every layer in FP8). Then, here:
#   omniloop eval compare flux-demo-bf16-x.json flux-demo-fp8-x.json --features
# Run from the repo root with .whl-fp8 (or .whl) carried, one GPU, timeout_s ~420 (bf16 ~95 s, FP8 ~175 s for 432
# images). EXCLUDE: the regular expression over the linears' paths within a block (default: q/k/v, also fused);
# SEEDS (default 0,1); RUNS (default bf16,fp8). Writes $OUT/fd/flux-demo-{bf16,fp8}-x.json.
set -u
OUT=${OUT:-/tmp/out}
export FP8_EXCLUDE=${EXCLUDE:-'^attn\.(to_[qkv]|add_[qkv]_proj|to_qkv|to_added_qkv)$'}
S=plugins/compute/quant/scripts/gpu_fp8lin_flux_demo.sh
mkdir -p "$OUT/fd"
[[ ,${RUNS:-bf16,fp8}, == *,bf16,* ]] && OUT=$OUT/fd SEEDS=${SEEDS:-0,1} RUNS=bf16 TAG=-x timeout "${BF16_S:-150}" bash $S
[[ ,${RUNS:-bf16,fp8}, == *,fp8,* ]] && OUT=$OUT/fd SEEDS=${SEEDS:-0,1} RUNS=fp8 TAG=-x \
  PRELUDE='import runpy; runpy.run_path("bench/fp8_exclude.py")' timeout "${FP8_S:-250}" bash $S
ls -la "$OUT/fd"
