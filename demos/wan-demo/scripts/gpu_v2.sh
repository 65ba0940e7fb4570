#!/usr/bin/env bash
# wan-demo v2 / wan-demo-fast: one time-boxed session on a lent GPU machine (run from the repo root;
# $OUT = folder whose files come back; the run tool carries the wheels named below and, to resume,
# the folder given to --resume). Extra arguments go to omniloop_wan_demo_training.v2, e.g.
#   bash demos/wan-demo/scripts/gpu_v2.sh --phases vae,dit,eval --vae-seconds 150 --dit-seconds 250
#   bash demos/wan-demo/scripts/gpu_v2.sh --resume .ckpt/v2-run1 --phases dit,eval --dit-seconds 380
#   bash demos/wan-demo/scripts/gpu_v2.sh --resume .ckpt/v2-run2 --phases distill,eval --distill-seconds 300
#   bash demos/wan-demo/scripts/gpu_v2.sh --resume package --phases dit,eval --dit-shifts 1,3 --dit-seconds 420
#     (package: continue from the checkpoint/ the working tree holds; carry only the wheels)
# Writes at most 7 files to $OUT: pipeline.tar raw-0.safetensors fast.tar run.json eval.json preview.png log.txt
source "$(dirname "$0")/gpu_env.sh"
check_imports tokenizers omniloop_wan_demo_training.v2
run_logged "$OUT/log.txt" omniloop_wan_demo_training.v2 --out "$OUT" "$@"
