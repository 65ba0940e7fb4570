#!/usr/bin/env bash
# Train tone-demo on a lent GPU machine, from a folder laid out as the repo (demos/tone-demo,
# families/tone-demo) with the wheels the machine lacks in $WHEELS (default .whl: diffusers,
# torchsde, trampoline); $OUT = the folder whose files come back. Extra arguments go to
# omniloop_tone_demo_training.train, e.g.
#   bash demos/tone-demo/scripts/gpu_train.sh --vae-seconds 130 --dit-seconds 210
# TAR_CHECKPOINT=1: replace $OUT/checkpoint by $OUT/checkpoint.tgz at the end (the lent-GPU tool
# returns a limited number of files per call: an untarred checkpoint folder does not come back).
set -u
WHEELS=${WHEELS:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$WHEELS"/diffusers-*.whl "$WHEELS"/torchsde-*.whl "$WHEELS"/trampoline-*.whl || exit 1
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
export PYTHONPATH=/tmp/site:$ROOT/demos/tone-demo:$ROOT/families/tone-demo PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, diffusers, transformers, torchsde; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" || exit 1
set -o pipefail
python3 -m omniloop_tone_demo_training.train --out "$OUT" --device cuda "$@" 2>&1 \
  | grep --line-buffered -v -E "it/s\]|s/it\]|Writing model shards|FutureWarning|WeightNorm.apply|brownian_interval|warnings.warn" \
  | tee "$OUT/log.txt"
rc=$?
if [ "${TAR_CHECKPOINT:-0}" = 1 ] && [ -d "$OUT/checkpoint" ]; then
  tar czf "$OUT/checkpoint.tgz" -C "$OUT" checkpoint && rm -rf "$OUT/checkpoint"
fi
exit $rc
