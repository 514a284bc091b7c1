#!/usr/bin/env bash
# One-command GPU check of the FlashAttention kernels (issue 16: the tma path against the portable one and
# cuDNN), sized for a short lease on one GPU. Steps, each with its own timeout and log under $OUT:
#   1. the gpu-marked flash tests (pytest-xdist when present; TEST_K selects with -k), while step 2 compiles;
#   2. (RUN_TILES=1, default) the tile sweep of the tma variants on $TILES_SHAPES (sweeps/flash_tiles.py, no Ray,
#      kernels compiled in $COMPILE_WORKERS processes first), best configs merged with the committed portable
#      ones into $OUT/flash_attention_tuned.json, which the later steps use; RUN_TILES=0: instead, the committed
#      tuned configs compiled in parallel (sweeps/flash_profile.py), each process's first-call cost logged;
#   3. the hopper study (sweeps/flash_bench.py): issue 16's four shapes, triton_tma and triton_portable against
#      SDPA pinned to cuDNN and to flash, forward and forward+backward (autotuning among the tuned entries;
#      $BENCH_PROVIDERS narrows the providers);
#   4. (RUN_NCU=1) ncu on one launch of each kernel per path (--clock-control none; a few sections);
#   5. (RUN_COLD=1) first-call cost at 1x32x32768x128: one fwd+bwd on a fresh Triton cache, tuned file or autotuning.
# Everything it writes lies under $OUT: the tuned file the later steps read is $OUT/flash_attention_tuned.json
# (RAYSYS_FLASH_TUNED), never the committed kernels/attention/triton/tuned.json (copy it there to install it).
# Run from the repository root:   OUT=/tmp/x bash sweeps/flash_gpu_check.sh
set -u
OUT=${OUT:-/tmp/flash_gpu_check}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2> /dev/null; then
  echo "flash_gpu_check.sh: needs a CUDA GPU; this machine has none (torch.cuda.is_available() is False)" >&2
  exit 2
fi
mkdir -p "$OUT"
cp kernels/attention/triton/tuned.json "$OUT/flash_attention_tuned.json"
export RAYSYS_FLASH_TUNED=$OUT/flash_attention_tuned.json
TILES_SHAPES=${TILES_SHAPES:-16384/128/bf16/causal,2048/128/bf16/causal,4096/64/bf16/causal}
TILES_VARIANTS=${TILES_VARIANTS:-tma,tma_r128,tma_persistent}

$PY -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}, cuda \
{torch.version.cuda}, cudnn {torch.backends.cudnn.version()}, {torch.cuda.device_count()} x \
{torch.cuda.get_device_name(0)}')" | tee "$OUT/env.txt"
if [ "${MODE:-check}" = candidates ]; then
  # Issue 16's candidate matrix (sweeps/flash_bench.py CANDIDATES): each candidate's correctness check in its own
  # process (compiling its kernels in parallel, beside the autotuned configs of the hopper study's other paths),
  # then all of them timed in one process against SDPA cuDNN and flash; the fastest tma configs go first in the
  # tuned file (with its auto_path), which the hopper study then runs under ($OUT/hopper); last, ncu on one launch
  # of each kernel at $NCU_SHAPE for the earlier tuned tma configs and the fastest ones.
  $PY -c "import inspect, triton, triton.language as tl; print('tl.range', inspect.signature(tl.range.__init__)); \
print('Config', inspect.signature(triton.Config.__init__))" | tee -a "$OUT/env.txt"
  NAMES=${CANDIDATES:-$($PY -c "from sweeps.flash_bench import CANDIDATES; print(' '.join(CANDIDATES))")}
  for name in $NAMES; do
    timeout "${CHECK_TIMEOUT:-120}" $PY sweeps/flash_bench.py --studies candidates --candidates "$name" --check-only \
      --out "/tmp/flash_check/$name" > "$OUT/check_$name.log" 2>&1 &
  done
  for job in "tma one_pass" "portable one_pass" "portable two_pass"; do
    set -- $job
    for d in 128 64; do
      timeout "${CHECK_TIMEOUT:-120}" $PY sweeps/flash_profile.py --autotune --warmup 0 --shape 1x2x1024x$d --paths $1 \
        --bwd $2 > "$OUT/first_${1}_${2}_$d.log" 2>&1 &
    done
  done
  wait
  grep -h -E "triton_candidate" "$OUT"/check_*.log | sed 's/^candidates triton_candidate //'
  timeout "${BENCH_TIMEOUT:-140}" $PY sweeps/flash_bench.py --studies candidates --time-budget-s "${BENCH_BUDGET:-115}" \
    ${CANDIDATES:+--candidates "$(echo $CANDIDATES | tr ' ' ,)"} --out "$OUT" > "$OUT/bench.log" 2>&1
  echo "flash_bench exit code $?" >> "$OUT/bench.log"
  grep -E "^candidates" "$OUT/bench.log" | sed 's/^candidates //'
  $PY sweeps/flash_bench.py --studies candidates --report-only --out "$OUT" \
    --write-tuned "$RAYSYS_FLASH_TUNED" > "$OUT/write_tuned.log" 2>&1; cat "$OUT/write_tuned.log"
  timeout "${HOPPER_TIMEOUT:-140}" $PY sweeps/flash_bench.py --study hopper --time-budget-s "${HOPPER_BUDGET:-115}" \
    --out "$OUT/hopper" > "$OUT/hopper_bench.log" 2>&1
  echo "flash_bench hopper exit code $?" >> "$OUT/hopper_bench.log"
  grep -E "^hopper" "$OUT/hopper_bench.log"
  if command -v ncu > /dev/null; then
    PICK=$($PY - "$OUT/flash_bench.parquet" "${NCU_SHAPE:-1x32x32768x128}" <<'PYEOF'
import sys
import pandas as pd
df = pd.read_parquet(sys.argv[1])
b, h, n, d = map(int, sys.argv[2].split("x"))
ok = df[(df.status == "ok") & (df.provider == "triton_candidate") & (df.seq == n) & (df.heads == h) & (df.batch == b)]
base = ok[ok.candidate == f"base_tma_d{d}"].iloc[0]
fwd, bwd = ok.loc[ok.fwd_median_s.idxmin()], ok.loc[ok.bwd_median_s.idxmin()]
print(f"{base.fwd_config},{base.dkdv_config},{base.dq_config} {fwd.fwd_config},{bwd.dkdv_config},{bwd.dq_config}")
PYEOF
)
    echo "ncu picks (fwd,dkdv,dq): $PICK"
    i=0
    for pick in $PICK; do
      IFS=, read -r f k q <<< "$pick"
      timeout "${NCU_TIMEOUT:-45}" ncu --clock-control none -k "regex:_flash_(fwd|bwd_dkdv|bwd_dq)_kernel" \
        --launch-skip 3 --launch-count 3 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section ComputeWorkloadAnalysis --csv --page details \
        $PY sweeps/flash_profile.py --shape "${NCU_SHAPE:-1x32x32768x128}" --paths tma --fwd-config "$f" \
        --dkdv-config "$k" --dq-config "$q" > "$OUT/ncu_$i.csv" 2> "$OUT/ncu_$i.log"
      echo "ncu $pick exit code $?" >> "$OUT/ncu_$i.log"
      i=$((i + 1))
    done
  fi
  (cd "$OUT" && tar czf logs.tgz --remove-files $(ls *.log *.csv *.txt 2>/dev/null))
  exit 0
fi
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-8}" || echo "")

rm -f "$OUT/tests.done"
(timeout "${TEST_TIMEOUT:-200}" $PY -m pytest -m gpu tests/kernels/attention/test_interface_gpu.py -q -p no:cacheprovider \
   $XDIST ${TEST_K:+-k "$TEST_K"} > "$OUT/gpu_tests.log" 2>&1
 echo "pytest exit code $?" >> "$OUT/gpu_tests.log"; touch "$OUT/tests.done") &
TESTS=$!
if [ "${RUN_TILES:-1}" = 0 ]; then
  # No sweep: compile the tuned file's configs while the tests run, one process per (path, backward, head dim),
  # each on a fresh cache, so each log's first call is the first-call cost (compile + autotuning the entries).
  for job in "tma two_pass" "tma one_pass" "portable two_pass"; do
    set -- $job
    for d in 128 64; do
      TRITON_CACHE_DIR=/tmp/flash_cache_${1}_${2}_$d timeout 150 $PY sweeps/flash_profile.py --autotune --warmup 0 \
        --shape 1x16x1024x$d --paths $1 --bwd $2 > "$OUT/first_${1}_${2}_$d.log" 2>&1 &
    done
  done
  wait $(jobs -p | grep -v "^$TESTS$")
elif [ "${RUN_TILES:-1}" = 1 ]; then
  # The sweep compiles first (CPU) while the tests run, then waits for them before timing anything.
  timeout "${TILES_TIMEOUT:-170}" $PY sweeps/flash_tiles.py --launcher local --quick --variants "$TILES_VARIANTS" \
    --shapes "$TILES_SHAPES" --min-configs 3 --compile-workers "${COMPILE_WORKERS:-8}" --wait-file "$OUT/tests.done" \
    --out "$OUT" --json "$OUT/flash_attention_tuned.json" > "$OUT/tiles.log" 2>&1
  echo "flash_tiles exit code $?" >> "$OUT/tiles.log"
fi
wait $TESTS
if [ "${RUN_TILES:-1}" = 0 ]; then
  # Into the shared cache only now, after the tests: in the second H200 run the copy overlapped them and 7 test
  # workers segfaulted loading kernels (in Triton's _init_handles); the same kernels passed in later tests.
  CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}; mkdir -p "$CACHE"; cp -r /tmp/flash_cache_*/* "$CACHE"/
fi

# Autotuning on, bounded by the tuned file: each kernel benchmarks only the file's entries for its path and head dim.
timeout "${BENCH_TIMEOUT:-150}" $PY sweeps/flash_bench.py --study hopper --out "$OUT" \
  ${BENCH_PROVIDERS:+--providers "$BENCH_PROVIDERS"} > "$OUT/bench.log" 2>&1
echo "flash_bench exit code $?" >> "$OUT/bench.log"

if [ "${RUN_NCU:-0}" = 1 ] && command -v ncu > /dev/null; then
  for path in portable tma; do
    # 4 launches per call (fwd, D, dK/dV, dQ); the filter keeps 3 of them; skip the warm-up call's.
    timeout "${NCU_TIMEOUT:-60}" ncu --clock-control none -k "regex:_flash_(fwd|bwd_dkdv|bwd_dq)_kernel" \
      --launch-skip 3 --launch-count 3 --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section WarpStateStats --csv --page details \
      $PY sweeps/flash_profile.py --shape "${NCU_SHAPE:-1x16x16384x128}" --paths $path > "$OUT/ncu_$path.csv" \
      2> "$OUT/ncu_$path.log"
    echo "ncu $path exit code $?" >> "$OUT/ncu_$path.log"
  done
fi

if [ "${RUN_COLD:-0}" = 1 ]; then
  for mode in tuned autotune; do
    TRITON_CACHE_DIR=$(mktemp -d) RAYSYS_FLASH_AUTOTUNE=$([ $mode = tuned ] && echo 0 || echo 1) \
      timeout 120 $PY -c "
import time, torch
t = time.perf_counter()
from kernels.attention import flash_attention
q, k, v = (torch.randn(1, 32, 32768, 128, device='cuda', dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
flash_attention(q, k, v, True).sum().backward(); torch.cuda.synchronize()
print(f'first call ($mode, empty Triton cache): {time.perf_counter() - t:.1f} s')" >> "$OUT/cold.log" 2>&1
  done
fi

echo "===== gpu tests"; grep -v -i "warn" "$OUT/gpu_tests.log" | tail -n 8
echo "===== logs"; tail -n 2 "$OUT"/*.log
[ -f "$OUT/tiles.log" ] && grep -E "compiled|tuned configs" "$OUT/tiles.log"
grep -h "first call" "$OUT"/first_*.log 2>/dev/null
$PY sweeps/flash_summary.py "$OUT" 2>&1 | tail -n 40
# The lease returns at most 8 files: the logs travel as one archive.
rm -f "$OUT/tests.done"
(cd "$OUT" && tar czf logs.tgz --remove-files $(ls *.log *.csv *.txt 2>/dev/null))
