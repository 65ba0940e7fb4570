#!/usr/bin/env bash
# wan-demo-fast's adapter strength as an inference setting (issue 41): v2 + scale * B A of the shipped
# LoRA (omniloop_wan_demo/adapters/fast.safetensors), evaluated on 96 prompts x seeds 0-31 (3 072 clips,
# the GPU protocol of bench/results/adherence-wan-demo-fast-dmd-gpu-2026-12-03.json) for each scale; trains
# nothing. ~70 s per scale on an H200 plus ~40 s of start-up. Run from the repo root with .whl/ carried
# (gpu_env.sh's wheels), kind nvidia-h200, timeout_s 590:
#   bash demos/wan-demo/scripts/gpu_fast_scales.sh [SCALES [LORA_FILE]]     # default 1.1,0.9,1.2,0.8,1.35,1
# $OUT/scales/result.json holds one evaluation per scale (rewritten after each), $OUT/scales.log the log.
# A scale that beats 1 ships as the adapter with its B multiplied by the scale (python -m
# omniloop_wan_demo_training.v2 --ship, after scaling), then its CPU figures through the runtime.
SCALES=${1:-1.1,0.9,1.2,0.8,1.35,1}
LORA=${2:-families/wan-demo/omniloop_wan_demo/adapters/fast.safetensors}
source "$(dirname "$0")/gpu_env.sh"
check_imports omniloop_wan_demo_training.dmd_fast
mkdir -p "$OUT"
timeout 540 python3 -m omniloop_wan_demo_training.dmd_fast --out "$OUT/scales" --eval-only lora --lora-from "$LORA" \
  --lora-scales "$SCALES" --eval-seeds 0-31 2>&1 | grep --line-buffered -v -E "Loading|it/s\]|s/it\]|torch_dtype" \
  | tee "$OUT/scales.log"
echo "rc ${PIPESTATUS[0]}"
