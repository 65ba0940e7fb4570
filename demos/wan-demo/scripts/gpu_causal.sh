#!/usr/bin/env bash
# Train wan-demo-causal on a lent GPU machine (run from the repo root; $OUT = folder whose files
# come back; the run tool must carry .whl). Extra arguments go to
# omniloop_wan_demo_training.train_causal, e.g.
#   bash demos/wan-demo/scripts/gpu_causal.sh --budget-s 240
# Writes $OUT/causal/ (the diffusers checkpoint + train_causal.json) and $OUT/causal-log.txt.
# Wheels for what the machine lacks (diffusers, cattrs, attrs) are carried in .whl/.
source "$(dirname "$0")/gpu_env.sh"
check_imports omniloop_wan.causal omniloop_wan.stages
run_logged "$OUT/causal-log.txt" omniloop_wan_demo_training.train_causal --out "$OUT/causal" "$@"
