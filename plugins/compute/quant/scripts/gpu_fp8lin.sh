#!/usr/bin/env bash
# Issues 19 and 40, FP8 linears on one H200 (~9 min wall expected): run from the repository root with
# .whl-fp8 carried (below; kind nvidia-h200, timeout_s 595). Writes to $OUT:
#   13b/wan_gpu-<date>.json   1.3B pipeline (480x832x81, CFG 5, 4 steps x 2 repeats): diffusers eager,
#                             FP8 attention + FP8 linears, + options.qkv: fused, + fp8-fast linears
#   14b/wan_gpu-<date>.json   14B forward: diffusers eager, FP8 attention + FP8 linears, + qkv fused
#                             and fp8-fast linears
#   q/attention_fp8-<date>.json  wan-demo clips (24 prompts x seeds 0,1 = 48 per configuration): bf16, bf16-flash (control),
#                             bf16 + FP8 linears, cudnn-fp8 + FP8 linears, cudnn-fp8 + fp8-fast linears:
#                             adherence, verdicts changed, PSNR/SSIM vs bf16 (cudnn-fp8 alone: 48 clips in
#                             attention_fp8-h200-2026-11-30.json); the record is rewritten after every
#                             clip configuration (the per-layer error and GEMM-time part: --parts linears,
#                             run on 2026-12-01)
#   log.txt                   everything printed
# Each step is bounded (--budget-s: no new configuration after it; timeout for the quality script),
# so one failing part does not sink the others. Expected: 1.3b ~110 s, 14b ~70 s, quality ~360 s,
# installs and imports ~40 s. SMOKE=1 adds --smoke everywhere (a CPU check of the script); PARTS, C13,
# C14, BUDGET13, BUDGET14 (seconds after which no new configuration starts), CLIPS, SEEDS, GUIDANCE (the clips' CFG, default 5), QUALITY_S choose what runs (below). CLIPS=bf16,bf16-flash,... adds the exact-class
# control (torch's FlashAttention-2 in bf16): its verdict changes vs bf16 are the noise floor.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/13b" "$OUT/14b" "$OUT/q"
# The GPU machine lacks diffusers, nvidia-cudnn-frontend, attrs, cattrs and stevedore. The tracked tree
# (~50 MB) leaves no room for the five wheels (18 MB) under a call's 64 MiB, so they travel as
# .whl-fp8/site.tar.xz (8.1 MB, git-ignored: diffusers, attrs, cattrs, stevedore and nvidia-cudnn-frontend
# 1.32.0, the cp312 manylinux wheels, unzipped into one folder and xz-compressed; made with
#   mkdir -p /tmp/s && for w in WHEELS; do unzip -q -o $w -d /tmp/s; done && tar -cJf .whl-fp8/site.tar.xz -C /tmp/s .
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
# PARTS (default speed,quality): speed = the Wan step beside diffusers (C13 / C14: the configurations),
# quality = the wan-demo clips (CLIPS: the clip configurations, bf16 first), plans = cuDNN's FP8 attention
# plans timed on Wan's shapes (attention_fp8_quality.py --parts plans), kernels = bench/quant_kernels.py
# (the FFN kernel's variants against the bytes they move; writes $OUT/k), profile = one profiled FP8 forward
# of each model in PROFILE_MODELS (default 14b: where its step goes, not yet profiled; 1.3b-fwd for the 1.3B;
# writes $OUT/prof; PROFILE_CONFIG, default omniloop-fp8-compile-fused-fp8fast)
PARTS=",${PARTS:-speed,quality},"
C13=${C13:-diffusers,omniloop-fp8-compile-fused-fp8lin,omniloop-fp8-compile-fused-fp8lin-qkv,omniloop-fp8-compile-fused-fp8fast-qkv}
C14=${C14:-diffusers,omniloop-fp8-compile-fused-fp8lin,omniloop-fp8-compile-fused-fp8fast-qkv}
CLIPS=${CLIPS:-bf16,bf16-flash,bf16+fp8lin,fp8+fp8lin,fp8+fp8fast}
if [[ $PARTS == *,plans,* ]]; then
  timeout 120 python3 bench/attention_fp8_quality.py --parts plans --out "$OUT/plans" ${SMOKE:+--smoke} 2>&1 | filter
fi
if [[ $PARTS == *,kernels,* ]]; then  # the FFN's GELU + quantisation kernel and its launch variants (~30 s), the norm kernel at Wan's sites (~90 s)
  timeout 300 python3 bench/quant_kernels.py --out "$OUT/k" ${SMOKE:+--smoke} 2>&1 | filter
fi
if [[ $PARTS == *,profile,* ]]; then
  for m in ${PROFILE_MODELS:-14b}; do
    python3 bench/wan_gpu.py --models "$m" --compile-mode '' --budget-s 60 --profile --out "$OUT/prof" ${SMOKE:+--smoke} \
      --only "${PROFILE_CONFIG:-omniloop-fp8-compile-fused-fp8fast}" 2>&1 | filter
  done
fi
if [[ $PARTS == *,speed,* ]]; then
  python3 bench/wan_gpu.py --models 1.3b --compile-mode '' --budget-s "${BUDGET13:-130}" --out "$OUT/13b" ${SMOKE:+--smoke} \
    --only "$C13" 2>&1 | filter
  python3 bench/wan_gpu.py --models 14b --compile-mode '' --budget-s "${BUDGET14:-75}" --out "$OUT/14b" ${SMOKE:+--smoke} \
    --only "$C14" 2>&1 | filter
fi
if [[ $PARTS == *,quality,* ]]; then
  # SEEDS (default 0,1): 24 clips per seed and configuration, issue 40's quality protocol is >= 48 (issue
  # 19 ran 24); ~30 s (bf16) to ~100 s (FP8 attention + linears) per 48 clips on the H200
  timeout ${QUALITY_S:-400} python3 bench/attention_fp8_quality.py --parts clips --clip-configs "$CLIPS" \
    --seeds "${SEEDS:-0,1}" --guidance "${GUIDANCE:-5}" --out "$OUT/q" ${SMOKE:+--smoke} 2>&1 | filter
fi
echo "exit codes: ${PIPESTATUS[*]}; files:" | tee -a "$OUT/log.txt"; ls -R "$OUT" | tee -a "$OUT/log.txt"
