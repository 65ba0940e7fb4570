#!/usr/bin/env bash
# wan-demo-fast by DMD2 (issue 41): ONE training on one lent GPU for the longest budget one run-tool command
# allows -- the student trained directly as a LoRA (student and critic adapters on one frozen v2; not a full
# student whose LoRA is extracted by SVD afterwards), started from the shipped adapter
# (omniloop_wan_demo/adapters/fast.safetensors, rank 32), CRITIC_WARMUP critic-only updates first (the
# critic starts as v2 while the student does not), then evaluated on 96 prompts x seeds 0-31 (3 072 clips,
# the GPU protocol of bench/results/adherence-wan-demo-fast-dmd-gpu-2026-12-03.json) -- and everything in
# ONE tar (the run tool returns at most 8 files from $OUT). Run from the repo root with .whl/ carried (the
# wheels of gpu_env.sh plus peft), kind nvidia-h200, timeout_s 590:
#   bash demos/wan-demo/scripts/gpu_dmd.sh [SECONDS [LORA_FROM]]     # default 380, the shipped adapter
# LORA_FROM: a LoRA file in dmd_fast's layout to start from ("none": from v2, B = 0); to go on from an
# earlier call, extract its tar into an ignored folder here, carry it and pass its lora/fast_lora.safetensors.
# $OUT/fast-dmd.tar holds lora/{fast_lora.safetensors,result.json,preview.png} and lora.log.
# To ship it (on the CPU machine, in the repo, FILES_AT = where the run tool put the files):
#   mkdir -p /tmp/fd && tar xf FILES_AT/fast-dmd.tar -C /tmp/fd
#   # compare /tmp/fd/lora/result.json's "eval" with docs/wan-demo-recipe-and-measurements.md (step 12:
#   # duplicates 0.39 %, shape 97.8 %, no ghost 94.9 %); only if better:
#   python -m omniloop_wan_demo_training.v2 --ship /tmp/fd/lora     # -> adapters/fast.safetensors, checkpoint_fast/
#   git add families/wan-demo/omniloop_wan_demo/adapters/fast.safetensors families/wan-demo/omniloop_wan_demo/checkpoint_fast/omniloop.json
#   # then the CPU figures through the runtime: bench/adherence.py --model wan-demo-fast --prompts full --seeds 0,1
S=${1:-380}
LORA_FROM=${2:-families/wan-demo/omniloop_wan_demo/adapters/fast.safetensors}
CRITIC_WARMUP=${CRITIC_WARMUP:-100}
# SNAPSHOT_EVERY=N: keep the adapter every N student updates (and the start), ship the one that scores best on
# seeds 100-107 (dmd_fast --snapshot-every; ~18 s of GPU per snapshot for its 768 clips: the limit gets 150 s
# more, so keep SECONDS <= 250 in one 590 s call)
SNAPSHOT_EVERY=${SNAPSHOT_EVERY:-0}
source "$(dirname "$0")/gpu_env.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/peft-*.whl || exit 1
check_imports peft omniloop_wan_demo_training.dmd_fast
W=${WORK:-/tmp/fast-dmd}; mkdir -p "$W" "$OUT"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
FROM_ARGS=(--lora-from "$LORA_FROM"); [ "$LORA_FROM" = none ] && FROM_ARGS=()
F="Loading|it/s\]|s/it\]|torch_dtype|peft_config|warnings.warn"
# teacher CFG 3, student lr 3e-4 / critic 6e-4, 5 critic steps per student step, batch 128: the 2026-12-03 recipe
# the time limit: training S, then ~160 s for the 3,072-clip evaluation; snapshots add ~18 s each (2026-12-05:
# 300 s with SNAPSHOT_EVERY=48 made six, and S + 160 cut the final evaluation), so they get 150 s more
EXTRA=0; [ "$SNAPSHOT_EVERY" -gt 0 ] && EXTRA=150
timeout $((S + 160 + EXTRA)) python3 -m omniloop_wan_demo_training.dmd_fast --out "$W/lora" --form lora --seconds "$S" \
  "${FROM_ARGS[@]}" --critic-warmup "$CRITIC_WARMUP" --snapshot-every "$SNAPSHOT_EVERY" 2>&1 | grep --line-buffered -v -E "$F" > "$W/lora.log"
el "training + evaluation rc ${PIPESTATUS[0]}"; tail -n 6 "$W/lora.log"
(cd "$W" && tar cf "$OUT/fast-dmd.tar" lora.log $(ls -d lora/fast_lora.safetensors lora/result.json lora/preview.png 2>/dev/null) \
   && tar tf "$OUT/fast-dmd.tar")
el "done"
