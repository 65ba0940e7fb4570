#!/usr/bin/env bash
# Issue 40: what FP8 linears (deploy linear_precision: fp8) cost the image demo in adherence, on one
# H200: `omniloop eval adherence --model flux-demo --prompts full` (216 prompts x seed 0) through the
# runtime in bf16, then the same with --linear-precision fp8; per-clip verdicts in both JSONs (compare
# them clip by clip: "no verdict lost" is the issue's bar). Run from the repo root with .whl/ carried
# (diffusers, attrs, cattrs, stevedore wheels; demos/wan-demo/scripts/gpu_env.sh lists them), kind
# nvidia-h200, timeout_s ~300. Writes $OUT/flux-demo-{bf16,fp8}.json and $OUT/log.txt.
# RUNS (default bf16,fp8): which of them to run (also: deploy, the runtime under DEPLOY, a deploy file, e.g. the
# exact-class fast path's compile + fused options: what a change of arithmetic without FP8 flips); PRELUDE: Python run before the evaluation in each (an
# experiment's module setting, e.g. PRELUDE='import omniloop_quant.fp8 as f; f.FUSE_GELU_QUANT = False'); SEEDS;
# TAG: appended to the JSON and log names (several experiments in one device call: the second and later
# invocations find the packages installed under $PK and skip the install). The wheels may come as .whl/ or as
# .whl-fp8/site.tar.xz (the same packages unpacked; gpu_fa3.sh's carry), so one call can run both scripts.
# The repo's packages are *installed* (not put on PYTHONPATH): the runtime finds families and plugins
# through entry points. Each into its own folder, 16 at a time (~30 s there).
# A CPU check of the script (a venv with the dependencies but not the repo first on PATH):
#   DEVICE=cpu DTYPE=float32 PROMPTS=default OUT=/tmp/fq bash plugins/compute/quant/scripts/gpu_fp8lin_flux_demo.sh
set -u
OUT=${OUT:-/tmp/out}; DEVICE=${DEVICE:-cuda}; DTYPE=${DTYPE:-bfloat16}; PROMPTS=${PROMPTS:-full}; SEEDS=${SEEDS:-0}
PK=${PK:-/tmp/pk}
TAG=${TAG:-}
mkdir -p "$OUT" "$PK"
exec > >(tee "$OUT/log$TAG.txt") 2>&1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ -f "$PK/.installed" ]; then
  :  # an earlier invocation in this call installed everything
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
elif [ -f .whl-fp8/site.tar.xz ]; then
  python3 -c "import tarfile; tarfile.open('.whl-fp8/site.tar.xz').extractall('/tmp/site', filter='data')" || exit 1
fi
if [ ! -f "$PK/.installed" ]; then
  for d in core cli plugins/*/* families/* observers/* interceptors/* demos/*; do
    [ -f "$d/pyproject.toml" ] && echo "$d"
  done | xargs -P 16 -I{} sh -c 'python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --no-cache-dir --target "$1/$(echo "$2" | tr / _)" "./$2" || echo "install failed: $2"' _ "$PK" {}
  touch "$PK/.installed"
fi
PYTHONPATH=/tmp/site$(for p in "$PK"/*; do printf ':%s' "$p"; done)
export PYTHONPATH PYTHONUNBUFFERED=1
el "installed $(ls "$PK" | wc -l) packages"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # run NAME [eval adherence options]
  local name=$1; shift
  python3 -c "${PRELUDE:-pass}"'; import sys; from omniloop_wan_demo.cli import adherence; adherence(sys.argv[1:])' --model flux-demo \
    --prompts "$PROMPTS" --seeds "$SEEDS" --device "$DEVICE" --dtype "$DTYPE" --no-table --json "$OUT/flux-demo-$name$TAG.json" "$@" \
    2>&1 | grep --line-buffered -v -E "it/s\]|s/it\]"
  el "$name done"
}
[[ ,${RUNS:-bf16,fp8}, == *,bf16,* ]] && run bf16
[[ ,${RUNS:-bf16,fp8}, == *,fp8,* ]] && run fp8 --linear-precision fp8
[[ ,${RUNS:-bf16,fp8}, == *,deploy,* ]] && run deploy --deploy "$DEPLOY"
