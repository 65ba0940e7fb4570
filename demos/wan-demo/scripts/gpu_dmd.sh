#!/usr/bin/env bash
# wan-demo-fast by DMD2 (issue 41): on one lent GPU, three processes side by side -- wan-demo v2
# evaluated at its defaults, a LoRA student and a full student (each trained for SECONDS, then
# evaluated on 96 prompts x seeds 0-31). Run from the repo root with .whl/ carried (the wheels of
# gpu_env.sh plus peft); $OUT gets v2/ lora/ full/ (result.json, weights, preview.png) and logs.
#   bash demos/wan-demo/scripts/gpu_dmd.sh 200
# (The 2026-12-03 run used this script's commands with the wheels under .gpu-lead/ and .gpu-i41f/;
# bench/results/adherence-wan-demo-fast-dmd-gpu-2026-12-03.json.) The run tool returns 8 files:
# keep what matters first (full/ came back, lora/ and v2/result.json did not).
S=${1:-200}
source "$(dirname "$0")/gpu_env.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/peft-*.whl || exit 1
check_imports peft omniloop_wan_demo_training.dmd_fast
M=omniloop_wan_demo_training.dmd_fast
F="Loading|it/s\]|s/it\]|torch_dtype|peft_config|warnings.warn"
python3 -m $M --out "$OUT/v2" --eval-only v2 2>&1 | grep -v -E "$F" > "$OUT/v2.log" &
python3 -m $M --out "$OUT/lora" --form lora --seconds "$S" 2>&1 | grep -v -E "$F" > "$OUT/lora.log" &
python3 -m $M --out "$OUT/full" --form full --seconds "$S" 2>&1 | grep -v -E "$F" > "$OUT/full.log" &
wait
for f in v2 lora full; do echo "== $f"; tail -n 8 "$OUT/$f.log"; done
