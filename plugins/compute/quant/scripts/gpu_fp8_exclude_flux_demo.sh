#!/usr/bin/env bash
# Issue 40, the run after session 27: flux-demo's FP8 effect is the weights' e4m3 rounding (bench/README.md, "Session
# 27"); on the CPU, keeping the attention value projections (to_v, add_v_proj: ~8 % of FLUX.1-dev's linear FLOPs) in
# bf16 removed most of the objects' ~1 % shrink, and q/k/v together all of it. This runs, on one GPU, bf16 and then FP8
# with those layers kept -- through the deploy (linear_precision: fp8, linear_precision_options: {keep: [...]},
# omniloop-quant's README) -- at the seeds where the GPU's FP8 loses its shape verdicts (0 and 1: 29 lost / 12 gained
# with every layer in FP8). Then, here, for each variant V:
#   omniloop eval compare flux-demo-bf16-x.json flux-demo-deploy-x-V.json --features
# Run from the repo root with .whl-fp8 (or .whl) carried, one GPU, timeout_s ~560 (bf16 ~95 s, each FP8 variant
# ~175 s for 432 images). VARIANTS (default "v qkv"): v = keep [attn.to_v, attn.add_v_proj]; qkv = keep q/k/v of
# both streams; any other word is taken as one keep glob itself (a module path within a block).
# Run once (session 29, H100, VARIANTS=v): keeping v removed the shrink on the GPU too but not the lost verdicts
# (24 lost / 10 gained against 29 / 12; bench/README.md, "Session 29"). Session 30 ran VARIANTS=qkv at SEEDS 0,1 / 2,3 /
# 4,5 (one call each, ~230 s): 36 lost / 26 gained over 1,296 images (p 0.25) against every-linear FP8's 50 / 27.
# SEEDS (default 0,1); BF16=0 skips the bf16 run. Writes $OUT/fd/flux-demo-bf16-x.json, flux-demo-deploy-x-<V>.json
# (each with its deploy in the report) and the deploy files fp8-keep-<V>.json.
set -u
OUT=${OUT:-/tmp/out}
S=plugins/compute/quant/scripts/gpu_fp8lin_flux_demo.sh
mkdir -p "$OUT/fd"
[ "${BF16:-1}" = 1 ] && OUT=$OUT/fd SEEDS=${SEEDS:-0,1} RUNS=bf16 TAG=-x timeout "${BF16_S:-150}" bash $S
i=0
for v in ${VARIANTS:-v qkv}; do
  i=$((i + 1))
  case $v in
    v) keep='"attn.to_v", "attn.add_v_proj"'; name=v ;;
    qkv) keep='"attn.to_[qkv]", "attn.add_[qkv]_proj"'; name=qkv ;;
    *) keep="\"$v\""; name=glob$i ;;
  esac
  printf '{"linear_precision": "fp8", "linear_precision_options": {"keep": [%s]}}\n' "$keep" > "$OUT/fd/fp8-keep-$name.json"
  DEPLOY=$OUT/fd/fp8-keep-$name.json OUT=$OUT/fd SEEDS=${SEEDS:-0,1} RUNS=deploy TAG=-x-$name \
    timeout "${FP8_S:-200}" bash $S
done
ls -la "$OUT/fd"
