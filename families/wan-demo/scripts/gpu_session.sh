#!/usr/bin/env bash
# One time-boxed training session on a lent GPU machine (run from the repo root; $OUT = folder
# whose files come back). Extra arguments go to omniloop_wan_demo.training.gpu_run, e.g.
#   bash families/wan-demo/scripts/gpu_session.sh --vae-seconds 140 --dit-seconds 270
#   bash families/wan-demo/scripts/gpu_session.sh --resume .ckpt --dit-seconds 300
# Wheels for what the machine lacks (diffusers, cattrs, ...) are carried in .whl/.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/diffusers-*.whl .whl/cattrs-*.whl .whl/attrs-*.whl .whl/stevedore-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/core:$PWD/plugins/policies:$PWD/families/wan:$PWD/families/wan-demo PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, diffusers, transformers, accelerate, cattrs, omniloop_policies, omniloop_wan.family; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" || exit 1
set -o pipefail
python3 -m omniloop_wan_demo.training.gpu_run --out "$OUT" "$@" 2>&1 \
  | grep --line-buffered -v -E "Loading (pipeline|weights|checkpoint)|it/s\]|s/it\]|should be kept in float32|Writing model shards" \
  | tee "$OUT/log.txt"
