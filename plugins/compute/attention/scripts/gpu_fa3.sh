#!/usr/bin/env bash
# FlashAttention-3 on one Hopper GPU (issue 40): run from the repository root with .whl-fp8 (the cp312
# wheels of diffusers, attrs, cattrs, stevedore, nvidia-cudnn-frontend; see quant/scripts/gpu_fp8lin.sh)
# and .fa3 (build_flash_attn_3.sh's output: .fa3/flash_attn_3) carried, timeout_s 590. Writes to $OUT:
#   k/attention_fa3-<date>.json     the kernels alone on Wan's shapes (bench/attention_fa3.py)
#   13b/wan_gpu-<date>.json         Wan 1.3B step (480x832x81, CFG 5) beside diffusers eager: C13
#   14b/wan_gpu-<date>.json         Wan 14B forward beside diffusers eager: C14 (C13 / C14=none skips a model)
#   q/attention_fp8-<date>.json     wan-demo clips (CLIPS, SEEDS; PARTS=quality)
#   flux/flux_gpu-<date>.json       FLUX.1-dev 1024^2 step beside diffusers eager: CF (PARTS=flux; FLUXARGS
#                                   adds flux_gpu.py options, e.g. --profile; ISOLATE=1: each side of CF in its
#                                   own process beside its own anchor -- an H100 holds one FP8 copy beside
#                                   diffusers' model -- flux/p<i>/ merged into flux/flux_gpu-isolated.json)
#   tests.txt                       the FA3 / FA4 GPU tests under pytest (PARTS=tests; pytest is on the machine;
#                                   TESTS: other test files, space-separated)
#   log.txt
# PARTS (default kernels,speed): tests, kernels, speed, flux, quality.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
mkdir -p /tmp/site
python3 -c "import tarfile; t = tarfile.open('.whl-fp8/site.tar.xz'); t.extractall('/tmp/site', filter='data')" || exit 1
export PYTHONPATH=/tmp/site:$PWD/.fa3 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | tee "$OUT/log.txt"
filter() { grep --line-buffered -v -E "should be kept in float32|it/s\]|s/it\]" | tee -a "$OUT/log.txt"; }
python3 -c "import torch, flash_attn_3._C; print('flash_attn_3 ops:', torch.ops.flash_attn_3.fwd)" 2>&1 | filter  # torch first: it loads libtorch
PARTS=",${PARTS:-kernels,speed},"
C13=${C13:-diffusers,omniloop-fp8-compile-fused-fp8fast,omniloop-fa3fp8-compile-fused-fp8fast,omniloop-cudnn-compile-fused,omniloop-fa3-compile-fused}
C14=${C14:-diffusers,omniloop-fp8-compile-fused-fp8fast,omniloop-fa3fp8-compile-fused-fp8fast}
if [[ $PARTS == *,tests,* ]]; then
  # the repo's packages by path (no editable installs here), as the benches do, exported so that the child
  # pytest of run_interpreted_child finds them too; omniloop's pytest plugin by name (its pytest11 entry
  # point is not registered without an install), through PYTEST_ADDOPTS so that the child loads it as well
  REPO_PATHS=$(python3 -c "import sys; sys.path.insert(0, 'bench'); import _repo_paths as r; before = list(sys.path); r.add_repo_packages(); print(':'.join(p for p in sys.path if p not in before))")
  PYTHONPATH=$PYTHONPATH:$REPO_PATHS PYTEST_ADDOPTS="-p omniloop.testing.pytest_plugin" timeout "${TESTS_S:-150}" \
    python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/attention/test_flash3.py tests/attention/test_flash4.py} \
    2>&1 | tee "$OUT/tests.txt" | tail -n 15 | filter
fi
if [[ $PARTS == *,kernels,* ]]; then
  timeout 150 python3 bench/attention_fa3.py --out "$OUT/k" 2>&1 | filter
fi
if [[ $PARTS == *,speed,* ]]; then
  [[ $C13 == none ]] || python3 bench/wan_gpu.py --models 1.3b --compile-mode '' --budget-s "${BUDGET13:-200}" --out "$OUT/13b" --only "$C13" 2>&1 | filter
  [[ $C14 == none ]] || python3 bench/wan_gpu.py --models 14b --compile-mode '' --budget-s "${BUDGET14:-90}" --out "$OUT/14b" --only "$C14" 2>&1 | filter
fi
CF=${CF:-diffusers,omniloop-cudnn-fused-compile-graphs,omniloop-fa3-fused-compile-graphs}
if [[ $PARTS == *,flux,* && ${ISOLATE:-0} == 1 ]]; then
  # each side in its own process beside its own diffusers-eager anchor (an H100 holds diffusers' FLUX.1-dev and one
  # FP8 copy, not two), FLUX_S per process; the records merged into flux/flux_gpu-isolated.json (bench/merge_runs.py)
  i=0
  for side in ${CF//,/ }; do
    [[ $side == diffusers ]] && continue
    i=$((i + 1))
    timeout "${FLUX_S:-400}" python3 bench/flux_gpu.py --steps 12 --repeats 2 --budget-s "${BUDGETF:-150}" \
      --out "$OUT/flux/p$i" --only "diffusers,$side" ${FLUXARGS:-} 2>&1 | filter
  done
  python3 bench/merge_runs.py "$OUT/flux/flux_gpu-isolated.json" "$OUT"/flux/p*/flux_gpu-*.json 2>&1 | filter
elif [[ $PARTS == *,flux,* ]]; then
  timeout "${FLUX_S:-400}" python3 bench/flux_gpu.py --steps 12 --repeats 2 --budget-s "${BUDGETF:-150}" --out "$OUT/flux" \
    --only "$CF" ${FLUXARGS:-} 2>&1 | filter
fi
if [[ $PARTS == *,quality,* ]]; then
  # no clip starts after QUALITY_S - 60 s (the rest: loading, the last clip, scoring): a configuration cut
  # short keeps and compares the clips it made instead of the time box killing it with nothing
  timeout "${QUALITY_S:-300}" python3 bench/attention_fp8_quality.py --parts clips --clip-configs "${CLIPS:-bf16,fp8+fp8fast,fa3fp8+fp8fast}" \
    --seeds "${SEEDS:-0,1,2,3}" --guidance "${GUIDANCE:-2}" --clip-budget-s $(( ${QUALITY_S:-300} - 60 )) --out "$OUT/q" 2>&1 | filter
fi
echo "files:" | tee -a "$OUT/log.txt"; ls -R "$OUT" | tee -a "$OUT/log.txt"
