#!/usr/bin/env bash
# Train wan-demo-causal on a lent GPU machine (run from the repo root; $OUT = folder whose files
# come back; the run tool must carry .whl). Extra arguments go to
# omniloop_wan_demo.training.train_causal, e.g.
#   bash families/wan-demo/scripts/gpu_causal.sh --budget-s 240
# Writes $OUT/causal/ (the diffusers checkpoint + train_causal.json) and $OUT/causal-log.txt.
# Wheels for what the machine lacks (diffusers, cattrs, attrs) are carried in .whl/.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/diffusers-*.whl .whl/cattrs-*.whl .whl/attrs-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/core:$PWD/plugins/policies:$PWD/families/wan:$PWD/families/wan-demo PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, diffusers, transformers, accelerate, omniloop_wan.causal, omniloop_wan.stages; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" || exit 1
set -o pipefail
python3 -m omniloop_wan_demo.training.train_causal --out "$OUT/causal" "$@" 2>&1 \
  | grep --line-buffered -v -E "Loading (pipeline|weights|checkpoint)|it/s\]|s/it\]|should be kept in float32" \
  | tee "$OUT/causal-log.txt"
