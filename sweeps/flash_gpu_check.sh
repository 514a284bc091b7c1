#!/usr/bin/env bash
# One-command GPU check of the FlashAttention-2 kernels, sized for a short lease on a 1- or 2-GPU host:
#   1. the gpu-marked flash tests (pytest-xdist when present), on GPU 0;
#   2. the target benchmark (bf16, causal, batch 1, 16 heads, d 128, seq 16384): raysys Triton (autotuned)
#      against torch SDPA's flash and cuDNN backends, naive torch and the tiled PyTorch version, on GPU 1
#      (on GPU 0 after the tests when there is only one);
#   3. (RUN_TILES=1, default) every built-in launch config of each kernel at the target shape
#      (sweeps/flash_tiles.py, no Ray), on GPU 0 after the tests, best ones to $OUT/flash_attention_tuned.json;
#   4. (RUN_GRID=1) part of the handout's grid study ($GRID_ARGS for sweeps/flash_bench.py), GPU 0 after that;
#   5. a summary table (sweeps/flash_summary.py).
# Writes logs and Parquet files to $OUT (default /tmp/flash_gpu_check). Run from the repository root:
#   OUT=/tmp/x bash sweeps/flash_gpu_check.sh
set -u
OUT=${OUT:-/tmp/flash_gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

$PY -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}, cuda \
{torch.version.cuda}, cudnn {torch.backends.cudnn.version()}, {torch.cuda.device_count()} x \
{torch.cuda.get_device_name(0)}')" | tee "$OUT/env.txt"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-8}" || echo "")

run_tests() {
  CUDA_VISIBLE_DEVICES=0 timeout "${TEST_TIMEOUT:-170}" $PY -m pytest -m gpu tests/kernels/test_flash_attention_gpu.py \
    -q -p no:cacheprovider $XDIST > "$OUT/gpu_tests.log" 2>&1
  echo "pytest exit code $?" >> "$OUT/gpu_tests.log"
}
run_tiles() {
  CUDA_VISIBLE_DEVICES=0 timeout "${TILES_TIMEOUT:-170}" $PY sweeps/flash_tiles.py --launcher local --quick \
    --shapes "${TILES_SHAPES:-16384/128/bfloat16/causal}" --out "$OUT" --json "$OUT/flash_attention_tuned.json" \
    > "$OUT/tiles.log" 2>&1
  echo "flash_tiles exit code $?" >> "$OUT/tiles.log"
}
run_grid() {
  CUDA_VISIBLE_DEVICES=0 timeout "${GRID_TIMEOUT:-200}" $PY sweeps/flash_bench.py --study grid --out "$OUT/grid" \
    ${GRID_ARGS:---dtypes bf16 --head-dims 64,128 --seqs 1024,4096,16384,65536 --no-autotune} > "$OUT/grid.log" 2>&1
  echo "flash_bench grid exit code $?" >> "$OUT/grid.log"
}
run_gpu0() {
  run_tests
  if [ "${RUN_TILES:-1}" = 1 ]; then run_tiles; fi
  if [ "${RUN_GRID:-0}" = 1 ]; then run_grid; fi
}
run_bench() {
  CUDA_VISIBLE_DEVICES=$1 timeout "${BENCH_TIMEOUT:-300}" $PY sweeps/flash_bench.py --study target --out "$OUT" \
    > "$OUT/bench.log" 2>&1
  echo "flash_bench exit code $?" >> "$OUT/bench.log"
}

if [ "$NGPU" -ge 2 ]; then
  run_gpu0 &
  run_bench 1
  wait
else
  run_gpu0
  run_bench 0
fi

echo "===== gpu tests"; grep -v -i "warn" "$OUT/gpu_tests.log" | tail -n 20
echo "===== logs"; tail -n 2 "$OUT"/*.log
$PY sweeps/flash_summary.py "$OUT"
if [ -d "$OUT/grid" ]; then $PY sweeps/flash_summary.py "$OUT/grid"; fi
