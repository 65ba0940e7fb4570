#!/usr/bin/env bash
# The decoder against the fast student's specks (issue 41's "no ghost" >= 96 %), ONE training on one lent GPU:
# the shipped student's latents for 96 prompts x seeds 40-71 (3 072 clips, held out from the evaluation's
# 0-31; scripts/speck_probe.py latents), the decoder fine-tuned on those whose decode holds a speck
# (omniloop_wan_demo_training.decoder_specks: the speck replaced by the static background, beside the
# other clips' own decode and rendered clips) for SECONDS, then wan-demo-fast evaluated with the new
# decoder on 96 prompts x seeds 0-31 (dmd_fast --eval-only lora --vae-from; the shipped decoder's figures
# on the same clips: no ghost 94.9 %, shape 97.8 %, duplicates 0.39 %) -- everything in ONE tar. Run from
# the repo root with .whl/ carried (gpu_env.sh's wheels), kind nvidia-h200, timeout_s 590:
#   bash demos/wan-demo/scripts/gpu_decoder_specks.sh [SECONDS [LR]]     # default 240, 2e-5
#   FOCUS=red FOCUS_FRAC=0.5 bash demos/wan-demo/scripts/gpu_decoder_specks.sh 180
#     the same, with half the rendered clips red (decoder_specks --focus: both demos' shape misses are
#     mostly red, and the VAE alone loses ~1 in 3 red stars); the held-out check (RECON rendered clips, default 256,
#     before and after) reports shape per colour; student clips whose decode misreads the prompt's
#     shape are not kept (their decode is the miss)
#   DECODER=DIR/vae bash demos/wan-demo/scripts/gpu_decoder_specks.sh
#     trains nothing: evaluates that decoder (e.g. a CPU-trained one) on the same 3 072 wan-demo-fast clips.
#   Either way, wan-demo v2's (20 steps, CFG 2) clips with the same decoder follow as time allows (seeds V2_SEEDS,
#   default 0-31). (How the shipped
#     decoder of 2026-12-05 was chosen: docs/wan-demo-recipe-and-measurements.md, "Session 12".)
# $OUT/decoder-specks.tar holds dec/{vae/,decoder_specks.json}, eval/result.json and the log.
# To ship it (on the CPU machine, FILES_AT = where the run tool put the files), only if the evaluation beats
# the shipped decoder and the rendered clips' check (recon_after) kept shape and PSNR:
#   mkdir -p /tmp/ds && tar xf FILES_AT/decoder-specks.tar -C /tmp/ds
#   # the decoder is shared by every preset: wan-demo (v2 at 20 steps) first, on the GPU
#   #   (dmd_fast --eval-only v2 --vae-from /tmp/ds/dec/vae) and the CPU (bench/adherence.py --model wan-demo)
#   python -m omniloop_wan_demo_training.decoder_specks --ship /tmp/ds/dec   # wan-demo-causal keeps its decoder
#   # then the CPU figures through the runtime: bench/adherence.py --model wan-demo-fast --prompts full --seeds 0,1
S=${1:-240}
LR=${2:-2e-5}
DECODER=${DECODER:-}
source "$(dirname "$0")/gpu_env.sh"
check_imports omniloop_wan_demo_training.decoder_specks omniloop_wan_demo_training.dmd_fast
W=${WORK:-/tmp/decoder-specks}; mkdir -p "$W" "$OUT"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
F="Loading|it/s\]|s/it\]|torch_dtype|warnings.warn"
if [ -z "$DECODER" ]; then
  SEEDS=$(seq -s, 40 "${LAT_END:-71}")  # LAT_END: fewer student clips (their decode and speck check come before the training)
  timeout 60 python3 demos/wan-demo/scripts/speck_probe.py latents --device cuda --seeds "$SEEDS" --out "$W/lat.pt" 2>&1 \
    | grep -v -E "$F" > "$W/log.txt"
  el "latents rc ${PIPESTATUS[0]}"
  # RECON held-out rendered clips are checked before and after (~0.2 s each on the device's CPU: 768 took ~150 s
  # before the training on an H200 host, and the first red-focused call was cut off there)
  RECON=${RECON:-256}
  timeout $((S + 150 + RECON * 2 / 5)) python3 -m omniloop_wan_demo_training.decoder_specks --device cuda --latents "$W/lat.pt" --out "$W/dec" \
    --seconds "$S" --lr "$LR" --batch 32 --recon-check "$RECON" ${FOCUS:+--focus "$FOCUS" --focus-frac "${FOCUS_FRAC:-0.5}"} 2>&1 | grep --line-buffered -v -E "$F" >> "$W/log.txt"
  el "decoder rc ${PIPESTATUS[0]}"; tail -n 3 "$W/log.txt"
  DEC="$W/dec/vae"; BUDGET=200
else
  DEC="$DECODER"; BUDGET=200
fi
[ -f "$DEC/config.json" ] && timeout "$BUDGET" python3 -m omniloop_wan_demo_training.dmd_fast --out "$W/eval" --eval-only lora \
  --lora-scales 1 --vae-from "$DEC" --eval-seeds 0-31 2>&1 | grep --line-buffered -v -E "$F" >> "$W/log.txt"
el "evaluation rc ${PIPESTATUS[0]}"; tail -n 3 "$W/log.txt"
# what is left of the call: wan-demo v2 (20 steps, CFG 2) with the same decoder, seeds V2_SEEDS (default 0-31:
# the bar compares fast's shape with wan-demo's on the same decoder; 3 072 v2 clips took ~40 s of GPU on an H100); it ends by
# V2_END s after the set-up (default 520: a call of timeout_s 590)
timeout $((${V2_END:-520} - $(date +%s) + t0)) python3 -m omniloop_wan_demo_training.dmd_fast --out "$W/eval-v2" --eval-only v2 \
  --vae-from "$DEC" --eval-seeds "${V2_SEEDS:-0-31}" 2>&1 | grep --line-buffered -v -E "$F" >> "$W/log.txt"
el "v2 evaluation rc ${PIPESTATUS[0]}"; tail -n 2 "$W/log.txt"
(cd "$W" && tar cf "$OUT/decoder-specks.tar" log.txt $(ls -d dec/vae dec/decoder_specks.json eval/result.json eval-v2/result.json 2>/dev/null) \
   && tar tf "$OUT/decoder-specks.tar")
el "done"
