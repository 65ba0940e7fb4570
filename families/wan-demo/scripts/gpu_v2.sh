#!/usr/bin/env bash
# wan-demo v2 / wan-demo-fast: one time-boxed session on a lent GPU machine (run from the repo root;
# $OUT = folder whose files come back; the run tool carries the wheels named below and, to resume,
# the folder given to --resume). Extra arguments go to omniloop_wan_demo.training.v2, e.g.
#   bash families/wan-demo/scripts/gpu_v2.sh --phases vae,dit,eval --vae-seconds 150 --dit-seconds 250
#   bash families/wan-demo/scripts/gpu_v2.sh --resume .ckpt/v2-run1 --phases dit,eval --dit-seconds 380
#   bash families/wan-demo/scripts/gpu_v2.sh --resume .ckpt/v2-run2 --phases distill,eval --distill-seconds 300
# Writes at most 7 files to $OUT: pipeline.tar raw-0.safetensors fast.tar run.json eval.json preview.png log.txt
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/diffusers-*.whl .whl/cattrs-*.whl .whl/attrs-*.whl .whl/stevedore-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/core:$PWD/plugins/policies:$PWD/families/wan:$PWD/families/wan-demo PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, diffusers, transformers, accelerate, tokenizers, omniloop_wan_demo.training.v2; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" || exit 1
set -o pipefail
python3 -m omniloop_wan_demo.training.v2 --out "$OUT" "$@" 2>&1 \
  | grep --line-buffered -v -E "Loading (pipeline|weights|checkpoint)|it/s\]|s/it\]|should be kept in float32|Writing model shards|torch_dtype" \
  | tee "$OUT/log.txt"
