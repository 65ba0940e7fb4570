#!/usr/bin/env bash
# wan-demo-fast's adapter strength as an inference setting (issue 41): v2 + scale * B A of the shipped
# LoRA (omniloop_wan_demo/adapters/fast.safetensors), evaluated on 96 prompts x seeds 0-31 (3 072 clips,
# the GPU protocol of bench/results/adherence-wan-demo-fast-dmd-gpu-2026-12-03.json) for each scale; trains
# nothing. ~70 s per scale on an H200 plus ~40 s of start-up. Run from the repo root with .whl/ carried
# (gpu_env.sh's wheels), kind nvidia-h200, timeout_s 590:
#   bash demos/wan-demo/scripts/gpu_fast_scales.sh [SCALES [LORA_FILE]]     # default 1.1,0.9,1.2,0.8,1.35,1
#   EVAL_SEEDS=40-71 bash demos/wan-demo/scripts/gpu_fast_scales.sh 0.85,0.9,1   # other seeds (choose a scale on
#     seeds held out from the evaluation's 0-31, then confirm it there)
#   V2=1 ...   wan-demo v2 (20 steps, CFG 2, the same decoder) on the same seeds after the scales: issue 41's
#     shape bar compares the two presets on one set of clips
# $OUT/scales[-SEEDS]/result.json holds one evaluation per scale (rewritten after each), $OUT/v2[-SEEDS]/result.json
# wan-demo's, $OUT/scales[-SEEDS].log the log (-SEEDS when EVAL_SEEDS is given).
# A scale that beats 1 ships as the adapter with its B multiplied by the scale (python -m
# omniloop_wan_demo_training.v2 --ship, after scaling), then its CPU figures through the runtime.
SCALES=${1:-1.1,0.9,1.2,0.8,1.35,1}
LORA=${2:-families/wan-demo/omniloop_wan_demo/adapters/fast.safetensors}
source "$(dirname "$0")/gpu_env.sh"
check_imports omniloop_wan_demo_training.dmd_fast
SEEDS=${EVAL_SEEDS:-0-31}
TAG=${EVAL_SEEDS:+-$EVAL_SEEDS}
F="Loading|it/s\]|s/it\]|torch_dtype"
mkdir -p "$OUT"
timeout "${SCALES_S:-540}" python3 -m omniloop_wan_demo_training.dmd_fast --out "$OUT/scales$TAG" --eval-only lora --lora-from "$LORA" \
  --lora-scales "$SCALES" --eval-seeds "$SEEDS" 2>&1 | grep --line-buffered -v -E "$F" | tee "$OUT/scales$TAG.log"
echo "rc ${PIPESTATUS[0]}"
if [ -n "${V2:-}" ]; then
  timeout "${V2_S:-120}" python3 -m omniloop_wan_demo_training.dmd_fast --out "$OUT/v2$TAG" --eval-only v2 --eval-seeds "$SEEDS" 2>&1 \
    | grep --line-buffered -v -E "$F" | tee -a "$OUT/scales$TAG.log"
  echo "v2 rc ${PIPESTATUS[0]}"
fi
