#!/usr/bin/env bash
# wan-demo-causal by DMD2, Self-Forcing style (issue 41): ONE training for the longest budget one run-tool
# command allows, everything in
# ONE tar (the run tool returns at most 8 files from $OUT). The streamed evaluation runs on the CPU machine
# afterwards (it builds a Runtime, which finds the family through installed entry points; the device
# machine has the repo on PYTHONPATH only). Run from the repo root with .whl/ carried
# (gpu_env.sh's wheels), kind nvidia-h200, timeout_s 590:
#   bash demos/wan-demo/scripts/gpu_causal_dmd.sh [DMD_SECONDS [FROM]]
# The defaults reproduce the shipped student (run 6, 2026-12-06; 537 s on an H100): wan-demo v2's transformer,
# TF_SECONDS=200 of block-causal teacher forcing (train_causal's stage, batch 128), CRITIC_WARMUP=100 critic-only
# updates (the critic starts as the teacher, so DM gradients are ~0 until it has learnt the student), then
# DMD_SECONDS=220 of DMD2 on the student's own KV-cached rollouts against the bidirectional v2 with
# TEACHER_GUIDANCE=3.0 (runs 2-5 used 5.0; 3.0 with the longer teacher forcing moved shape 82 -> 92 %), student
# lr 5e-5, critic 1e-4, 5 critic steps per student step, batch 64, the runtime's Euler rollout (--renoise euler;
# --renoise fresh would save the checkpoint with rollout_options.sampler fresh, the runtime's DMD2 sampler),
# raw + EMA weights saved every 60 s (a run cut short still leaves progress.pt), raw or EMA picked by a batched
# GPU check on seed 100 (not an evaluation seed). The teacher-forced model is checked on seed 100 before DMD2 too
# (train_causal_dmd.json's check_after_teacher_forcing, a 'check after_teacher_forcing' line in the log).
# The recipe: omniloop_wan_demo_training.train_causal_dmd; docs/wan-demo-recipe-and-measurements.md.
# TF_SECONDS=0 (env): no teacher-forcing stage; the student resumes FROM, a causal checkpoint folder (default: the
# shipped wan-demo-causal, families/wan-demo/omniloop_wan_demo/checkpoint_causal); to go on from an earlier call's
# result, extract its tar into an ignored folder here, carry it, and pass it (e.g. .gpu-causal/causal-dmd).
# DMD_SECONDS 0 with TF_SECONDS > 0: stage 1 alone -- the teacher-forced model is saved (raw or EMA by the
# same seed-100 check), no critic, no DMD2 (run 7: TF_SECONDS=160 bash demos/wan-demo/scripts/gpu_causal_dmd.sh 0)
# REUSE_SAMPLES=true (env): the critic-only iterations reuse the last student update's samples instead of
# rolling out again (DMDConfig.reuse_samples; ~1.6-2x the student updates per budget on CPU; untried for quality).
# $OUT/causal-dmd.tar holds causal-dmd/{omniloop.json,train_causal_dmd.json,transformer/}, the training
# log. The tar holds only the student's own files, so evaluate it from a whole folder (the shipped causal
# checkpoint, links followed, with the new transformer and omniloop.json), 96 prompts x seeds 0,1 and 2,3 streamed on
# the CPU, the shipped figures' protocol (FILES_AT = where the run tool put the files):
#   mkdir -p /tmp/cd && tar xf FILES_AT/causal-dmd.tar -C /tmp/cd
#   cp -rL families/wan-demo/omniloop_wan_demo/checkpoint_causal /tmp/cd/full && rm -rf /tmp/cd/full/transformer
#   cp -r /tmp/cd/causal-dmd/{transformer,omniloop.json} /tmp/cd/full/
#   OMP_NUM_THREADS=1 python bench/adherence.py --model /tmp/cd/full --rollout causal --prompts full \
#     --seeds 0,1 --steps 4 --workers 2 --out /tmp/cd/eval01        # and --seeds 2,3 --out /tmp/cd/eval23
# To ship it (on the CPU machine, in the repo), only if better than the shipped student on colour / direction /
# shape / no ghost / duplicates (the table in docs/wan-demo-recipe-and-measurements.md, "Session 17": run 6):
#   python -m omniloop_wan_demo_training.train_causal_dmd --ship /tmp/cd/causal-dmd
#   cp /tmp/cd/eval01/adherence-*.json bench/results/adherence-wan-demo-causal-RUN-runtime-stream-cpu-DATE.json
#   git add families/wan-demo/omniloop_wan_demo/checkpoint_causal/{transformer,omniloop.json} bench/results
#   # optional check on this machine: bench/adherence.py --model wan-demo-causal --prompts full --seeds 0 --steps 4
DS=${1:-220}
FROM=${2:-families/wan-demo/omniloop_wan_demo/checkpoint_causal}
CRITIC_WARMUP=${CRITIC_WARMUP:-100}
REUSE_SAMPLES=${REUSE_SAMPLES:-false}   # true: DMDConfig.reuse_samples (more student updates, untried)
TEACHER_GUIDANCE=${TEACHER_GUIDANCE:-3.0}   # the real score's CFG (run 6, shipped: 3.0; runs 2-5: 5.0)
TF=${TF_SECONDS:-200}
source "$(dirname "$0")/gpu_env.sh"
check_imports omniloop_wan_demo_training.train_causal_dmd omniloop_wan_demo_training.dmd omniloop.runtime
W=${WORK:-/tmp/causal-dmd}; mkdir -p "$W" "$OUT"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# the training's own budget: TF + DS seconds, plus load, data encoding, warm-up, checks and saving
timeout $((TF + DS + 140 + (TF > 0 ? 30 : 0))) python3 -m omniloop_wan_demo_training.train_causal_dmd --out "$W/causal-dmd" \
  --tf-seconds "$TF" $([ "$TF" = 0 ] && echo --student-from "$FROM") --critic-warmup "$CRITIC_WARMUP" --batch 64 --renoise euler \
  --dmd "{\"teacher_guidance\": $TEACHER_GUIDANCE, \"student_lr\": 5e-5, \"critic_lr\": 1e-4, \"critic_steps\": 5, \"reuse_samples\": $REUSE_SAMPLES}" \
  --dmd-seconds "$DS" --save-every-s 60 --eval-seeds 100 2>&1 \
  | grep --line-buffered -v -E "Loading|it/s\]|s/it\]|should be kept in float32|torch_dtype" > "$W/train.log"
el "training rc ${PIPESTATUS[0]}"; grep -E "^(dmd|check|saved|critic-warmup)" "$W/train.log" | tail -6
el "packing"
(cd "$W" || exit 1
 parts="train.log"
 for p in causal-dmd/omniloop.json causal-dmd/train_causal_dmd.json causal-dmd/transformer; do
   [ -e "$p" ] && parts="$parts $p"
 done
 # no finished checkpoint (the time box cut it): the last periodic raw + EMA weights instead
 [ -f causal-dmd/transformer/diffusion_pytorch_model.safetensors ] || { [ -f causal-dmd/progress.pt ] && parts="$parts causal-dmd/progress.pt"; }
 tar cf "$OUT/causal-dmd.tar" $parts && tar tf "$OUT/causal-dmd.tar")
el "done"
