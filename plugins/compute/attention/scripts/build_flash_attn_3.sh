#!/usr/bin/env bash
# Builds a small FlashAttention-3 (the Hopper forward kernels of flash-attention's hopper/ tree) for
# omniloop's flash-attn-3 / fa3-fp8 attention backends: forward only, sm90a, the head dimensions and
# dtypes asked for (default 64 and 128, bf16 and e4m3), no split-KV / paged / local / softcap / varlen /
# GQA packing — the calls these backends make. The full hopper/setup.py build takes hours; this one takes
# ~80 s per (head dim, dtype) on two cores. The result is the package ``flash_attn_3`` (``_C.abi3.so``
# registers ``torch.ops.flash_attn_3.fwd``), the same module name an upstream ``pip install hopper/``
# installs, so the backends load either one.
#
#   bash plugins/compute/attention/scripts/build_flash_attn_3.sh HOPPER_DIR CUTLASS_INCLUDE OUT_DIR
#     HOPPER_DIR       flash-attention's hopper/ (measured: Dao-AILab/flash-attention 0251105a)
#     CUTLASS_INCLUDE  cutlass/include at flash-attention's csrc/cutlass pin (7127592)
#     OUT_DIR          gets OUT_DIR/flash_attn_3/{__init__.py,_C.abi3.so}; put OUT_DIR on PYTHONPATH
#   HDIMS="64 128" DTYPES="bf16 e4m3" JOBS=2 CUDA_HOME=/usr/local/cuda (environment)
#
# Needs nvcc >= 12.3 (sm90a), g++, and a torch >= 2.9 in `python3` for the stable-ABI headers (a CPU
# build of torch is enough: the library uses torch's stable C ABI only, TORCH_TARGET_VERSION 2.9, so it
# loads in any torch >= 2.9 with CUDA). libtorch and libcudart are resolved at load time from the
# process that imported torch (they are linked by soname through stubs, so no CUDA torch is needed here).
set -euo pipefail
HOPPER=$(realpath "$1"); CUTLASS=$(realpath "$2"); OUT=$3
HDIMS=${HDIMS:-"64 128"}; DTYPES=${DTYPES:-"bf16 e4m3"}; JOBS=${JOBS:-2}
PY=${PYTHON:-python3}
B=$(mktemp -d); trap 'rm -rf "$B"' EXIT
FEAT="-DFLASHATTENTION_DISABLE_BACKWARD -DFLASHATTENTION_DISABLE_PAGEDKV -DFLASHATTENTION_DISABLE_SPLIT
 -DFLASHATTENTION_DISABLE_APPENDKV -DFLASHATTENTION_DISABLE_LOCAL -DFLASHATTENTION_DISABLE_SOFTCAP
 -DFLASHATTENTION_DISABLE_PACKGQA -DFLASHATTENTION_DISABLE_VARLEN -DFLASHATTENTION_DISABLE_CLUSTER
 -DFLASHATTENTION_DISABLE_SM8x -DFLASHATTENTION_DISABLE_HDIMDIFF64 -DFLASHATTENTION_DISABLE_HDIMDIFF192"
for d in 64 96 128 192 256; do [[ " $HDIMS " == *" $d "* ]] || FEAT="$FEAT -DFLASHATTENTION_DISABLE_HDIM$d"; done
[[ " $DTYPES " == *" e4m3 "* ]] || FEAT="$FEAT -DFLASHATTENTION_DISABLE_FP8"
[[ " $DTYPES " == *" fp16 "* ]] || FEAT="$FEAT -DFLASHATTENTION_DISABLE_FP16"
NV="-O3 -std=c++17 --use_fast_math -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -DCUTLASS_ENABLE_GDC_FOR_SM90
 -DCUTLASS_DEBUG_TRACE_LEVEL=0 -DNDEBUG -gencode arch=compute_90a,code=sm_90a -Xcompiler -fPIC
 --expt-relaxed-constexpr --expt-extended-lambda"
SRCS="flash_prepare_scheduler.cu"
for d in $HDIMS; do for t in $DTYPES; do SRCS="$SRCS instantiations/flash_fwd_hdim${d}_${t}_sm90.cu"; done; done
FEAT=$(echo $FEAT); NV=$(echo $NV)  # one line each
export FEAT NV HOPPER CUTLASS B
echo "building $SRCS with $JOBS jobs"
# shellcheck disable=SC2016,SC2086
printf '%s\n' $SRCS | xargs -P "$JOBS" -I{} bash -c \
  'nvcc $NV $FEAT -I "$HOPPER" -I "$CUTLASS" -c "$HOPPER/$0" -o "$B/$(basename "$0" .cu).o" || exit 255' {}
TI=$($PY -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
PYI=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
CUDA=${CUDA_HOME:-/usr/local/cuda}
g++ -O3 -std=c++17 -fPIC -w -DPy_LIMITED_API=0x03090000 -DTORCH_TARGET_VERSION=0x0209000000000000 $FEAT \
  -I "$HOPPER" -I "$CUTLASS" -I "$TI" -I "$PYI" -I "$CUDA/include" -c "$HOPPER/flash_api_stable.cpp" -o "$B/flash_api_stable.o"
# stubs that only carry the sonames: the real libraries are the ones the importing process already loaded
mkdir -p "$B/stub"
for lib in libtorch_cpu.so libtorch_cuda.so libc10.so libcudart.so.13; do
  echo "" | gcc -shared -x c - -o "$B/stub/$lib" -Wl,-soname,$lib
done
mkdir -p "$OUT/flash_attn_3"
g++ -shared -o "$OUT/flash_attn_3/_C.abi3.so" "$B"/*.o -L"$B/stub" -Wl,--no-as-needed \
  -l:libtorch_cpu.so -l:libtorch_cuda.so -l:libc10.so -l:libcudart.so.13 -Wl,--allow-shlib-undefined
cat > "$OUT/flash_attn_3/__init__.py" <<PY
"""FlashAttention-3 forward kernels (built by omniloop's build_flash_attn_3.sh: head dims $HDIMS, dtypes $DTYPES)."""
__version__ = "3.0.0+omniloop.fwd"
PY
ls -la "$OUT/flash_attn_3"
