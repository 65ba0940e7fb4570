#!/bin/bash
# Issue 36: examples/rl/flow_grpo.py runs side by side on one GPU, each a time-boxed post-training
# of flux-demo (placement reward, 8 prompts x 8 samples per iteration, held-out 12 prompts x 8).
#
#   OUT=out/rl BUDGET=170 bash bench/rl_flux_demo_gpu.sh grpo,1e-3,0 nft,1e-3,0 ...   # METHOD,LR,SEED
#
# Each run writes $OUT/<method>-lr<lr>-s<seed>/log.json and its stdout to $OUT/<name>.txt. Needs an
# environment with the repo's packages installed (make setup). On the lent H200 (no installs) the
# packages were put on PYTHONPATH, the missing wheels (attrs, cattrs, stevedore, pbr, pluggy,
# diffusers 0.42.1) installed with pip --target, and the entry points provided by copies of the
# packages' dist-info METADATA + entry_points.txt. The device returns at most 8 files: pack $OUT.
set -u
OUT=${OUT:?set OUT}
BUDGET=${BUDGET:-170}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
for cfg in "$@"; do
  IFS=, read -r method lr seed <<< "$cfg"
  name=$method-lr$lr-s$seed
  timeout $((BUDGET + 120)) python examples/rl/flow_grpo.py --device cuda --method "$method" --lr "$lr" --seed "$seed" \
    --prompts 8 --group 8 --iterations 200 --eval-every 1000 --heldout 12 --eval-seeds 8 --budget-s "$BUDGET" \
    --out "$OUT/$name" > "$OUT/$name.txt" 2>&1 &
done
wait
tar czf "$OUT.tgz" -C "$OUT" .
