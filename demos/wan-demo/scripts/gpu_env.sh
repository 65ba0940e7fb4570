# Sourced by the GPU session scripts here (run from the repo root on a lent GPU machine, with
# .whl/ carried): installs the wheels the machine lacks into /tmp/site, puts the repo packages
# on PYTHONPATH (imports only: no entry points, so nothing that builds a Runtime by family name), prints the GPU, and defines
#   check_imports MODULE...            exit 1 unless every module imports (prints versions)
#   run_logged LOG MODULE ARGS...      python3 -m MODULE ARGS, noise filtered, tee'd to LOG
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/diffusers-*.whl .whl/cattrs-*.whl .whl/attrs-*.whl .whl/stevedore-*.whl || exit 1
# every package folder of the repo (the training imports reach e.g. omniloop_kvcache through omniloop_wan.causal)
REPO_PATHS=$(for f in core/pyproject.toml plugins/*/*/pyproject.toml families/*/pyproject.toml demos/*/pyproject.toml; do
  printf ':%s' "$PWD/$(dirname "$f")"; done)
export PYTHONPATH=/tmp/site$REPO_PATHS PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

check_imports() {
  python3 -c "import sys, importlib; [importlib.import_module(m) for m in sys.argv[1:]]; import torch, diffusers, transformers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" \
    torch diffusers transformers accelerate "$@" || exit 1
}

run_logged() {
  local log=$1 module=$2
  shift 2
  set -o pipefail
  python3 -m "$module" "$@" 2>&1 \
    | grep --line-buffered -v -E "Loading (pipeline|weights|checkpoint)|it/s\]|s/it\]|should be kept in float32|Writing model shards|torch_dtype" \
    | tee "$log"
}
