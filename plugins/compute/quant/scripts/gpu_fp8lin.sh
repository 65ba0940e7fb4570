#!/usr/bin/env bash
# Issue 19, FP8 linears on one H200 (~6 min wall expected): run from the repository root with
# .whl-fp8 carried (below). Writes to $OUT:
#   13b/wan_gpu-<date>.json   1.3B pipeline (480x832x81, CFG 5, 4 steps x 2 repeats): diffusers eager,
#                             FP8 attention +- FP8 linears, bf16 cuDNN attention +- FP8 linears
#   14b/wan_gpu-<date>.json   14B forward: diffusers eager, FP8 attention +- FP8 linears
#   q/attention_fp8-<date>.json  wan-demo: FP8-linear error per layer on captured activations, bf16 vs
#                             FP8 GEMM timings on Wan shapes, clips (24 prompts x seeds 0,1 = 48) bf16,
#                             bf16 + FP8 linears, cudnn-fp8 + FP8 linears: adherence, PSNR/SSIM vs
#                             bf16 (cudnn-fp8 alone: 48 clips in attention_fp8-h200-2026-11-30.json);
#                             the record is rewritten after every clip configuration
#   log.txt                   everything printed
# Each step is bounded (--budget-s: no new configuration after it; timeout for the quality script),
# so one failing part does not sink the others. Expected: 1.3b ~130 s, 14b ~75 s, quality ~200 s,
# installs and imports ~40 s. SMOKE=1 adds --smoke everywhere (a CPU check of the script).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/13b" "$OUT/14b" "$OUT/q"
# The GPU machine lacks diffusers, nvidia-cudnn-frontend, attrs, cattrs and stevedore. The tracked tree
# (~52 MB) leaves no room for .whl/ (18 MB) under a call's 64 MiB, so they travel as .whl-fp8/site.tar.xz
# (8.1 MB: the five wheels of .whl/ unzipped into one folder, xz-compressed; made with
#   mkdir -p /tmp/s && for w in .whl/*.whl; do unzip -q -o $w -d /tmp/s; done && tar -cJf .whl-fp8/site.tar.xz -C /tmp/s .
# ), or as .whl/ wheels where that fits.
if [ -z "${SMOKE:-}" ]; then  # (a CPU smoke uses the venv's packages)
  mkdir -p /tmp/site
  if [ -f .whl-fp8/site.tar.xz ]; then
    python3 -c "import tarfile; t = tarfile.open('.whl-fp8/site.tar.xz'); t.extractall('/tmp/site', filter='data')" || exit 1
  else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  fi
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | tee "$OUT/log.txt"
filter() { grep --line-buffered -v -E "should be kept in float32|it/s\]|s/it\]" | tee -a "$OUT/log.txt"; }
python3 bench/wan_gpu.py --models 1.3b --compile-mode '' --budget-s 120 --out "$OUT/13b" ${SMOKE:+--smoke} \
  --only diffusers,omniloop-fp8-compile-fused,omniloop-fp8-compile-fused-fp8lin,omniloop-cudnn-compile-fused,omniloop-cudnn-compile-fused-fp8lin 2>&1 | filter
python3 bench/wan_gpu.py --models 14b --compile-mode '' --budget-s 70 --out "$OUT/14b" ${SMOKE:+--smoke} \
  --only diffusers,omniloop-fp8-compile-fused,omniloop-fp8-compile-fused-fp8lin 2>&1 | filter
# seeds 0,1: 48 clips per configuration, issue 40's quality protocol (issue 19 ran 24)
timeout 200 python3 bench/attention_fp8_quality.py --parts linears,clips --clip-configs bf16,bf16+fp8lin,fp8+fp8lin \
  --seeds 0,1 --out "$OUT/q" ${SMOKE:+--smoke} 2>&1 | filter
echo "exit codes: ${PIPESTATUS[*]}; files:" | tee -a "$OUT/log.txt"; ls -R "$OUT" | tee -a "$OUT/log.txt"
