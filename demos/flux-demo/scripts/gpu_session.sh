#!/usr/bin/env bash
# One time-boxed flux-demo training session on a lent GPU machine (run from the repo root with .whl/
# carried; $OUT = the folder whose files come back). Extra arguments go to
# omniloop_flux_demo_training.gpu_run, e.g.
#   bash demos/flux-demo/scripts/gpu_session.sh --vae-seconds 75 --dit-seconds 240
#   bash demos/flux-demo/scripts/gpu_session.sh --resume DIR --vae-seconds 0 --dit-seconds 300
#   OUT=/tmp/fd bash demos/flux-demo/scripts/gpu_session.sh --smoke --device cpu   # CPU check (no install)
set -u
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import diffusers, cattrs, attrs, stevedore" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/diffusers-*.whl .whl/cattrs-*.whl .whl/attrs-*.whl .whl/stevedore-*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/core:$PWD/plugins/compute/policies:$PWD/families/kit:$PWD/families/flux:$PWD/families/wan-demo:$PWD/families/wan:$PWD/families/flux-demo:$PWD/demos/wan-demo:$PWD/demos/flux-demo
export PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, diffusers, transformers, cattrs, omniloop, omniloop_policies, omniloop_flux.family, omniloop_wan_demo.prompts; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" || exit 1
set -o pipefail
python3 -m omniloop_flux_demo_training.gpu_run --out "$OUT" "$@" 2>&1 \
  | grep --line-buffered -v -E "Loading (pipeline|weights|checkpoint)|it/s\]|s/it\]" \
  | tee "$OUT/log.txt"
