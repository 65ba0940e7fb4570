#!/usr/bin/env bash
# One time-boxed training session on a lent GPU machine (run from the repo root; $OUT = folder
# whose files come back). Extra arguments go to omniloop_wan_demo_training.gpu_run, e.g.
#   bash demos/wan-demo/scripts/gpu_session.sh --vae-seconds 140 --dit-seconds 270
#   bash demos/wan-demo/scripts/gpu_session.sh --resume .ckpt --dit-seconds 300
# Wheels for what the machine lacks (diffusers, cattrs, ...) are carried in .whl/.
source "$(dirname "$0")/gpu_env.sh"
check_imports cattrs omniloop_policies omniloop_wan.family
run_logged "$OUT/log.txt" omniloop_wan_demo_training.gpu_run --out "$OUT" "$@"
