#!/usr/bin/env bash
# GPU runs in phases that each fit one 10-minute command on a 2x H200 host, with every study under its own
# timeout, `--resume` (an interrupted study keeps its finished trials; the next run continues it) and the
# results packed into $OUT/results.tgz. Run from the repository root, e.g. on a lent GPU host:
#
#   bash sweeps/gpu_run.sh dist      # 2 GPUs: collectives, DDP + sharded optimizer, FSDP        (~9 min)
#   bash sweeps/gpu_run.sh single    # checkpointing (Tune, one GPU per trial), flash tiles + grid  (~9 min)
#   bash sweeps/gpu_run.sh tests     # the gpu-marked tests                                        (~2 min)
#   bash sweeps/gpu_run.sh e2e       # the end-to-end model study (handout 2)                      (~7 min)
#
# Ray comes from wheels when the host has none: set WHEELS=.whl (see README, "GPU hosts without Ray").
set -u
phase=${1:?usage: gpu_run.sh dist|single|tests|e2e}
OUT=${OUT:-/tmp/raysys-gpu}
RESULTS=${RESULTS:-results}
mkdir -p "$OUT" "$RESULTS"
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site "$WHEELS"/*.whl 2>/dev/null
  export PYTHONPATH=$PWD:$PWD/.site${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export RAYSYS_GIT_SHA=${RAYSYS_GIT_SHA:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}

study() {  # study NAME SECONDS command...: run with a timeout, keep its log, never stop the phase
  local name=$1 seconds=$2
  shift 2
  echo "== $name (at most ${seconds}s)"
  timeout --signal=TERM --kill-after=20 "$seconds" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $? ; last lines:"
  grep -v -E "USDT|^\s*$|logging.cc" "$OUT/$name.log" | tail -n 12 | cut -c1-220
}

case $phase in
  dist)
    study allreduce 140 python3 sweeps/allreduce.py --device cuda --out "$RESULTS" --resume
    study ddp 260 python3 sweeps/ddp.py --device cuda --out "$RESULTS" --resume --max-steps 20 \
      --variants single,naive,flat,overlapped,bucketed:1,bucketed:10,bucketed:100,bucketed:1000,torch
    study fsdp 150 python3 sweeps/fsdp.py --device cuda --out "$RESULTS" --resume
    ;;
  single)
    study checkpointing 330 python3 sweeps/checkpointing.py --device cuda --out "$RESULTS" --resume
    study flash_tiles 100 python3 sweeps/flash_tiles.py --out "$RESULTS" --resume --time-budget-s 80 \
      --shapes 4096/64/bf16/causal
    study flash_grid 90 python3 sweeps/flash_bench.py --study grid --device cuda --out "$RESULTS" --resume \
      --max-seconds 70
    ;;
  tests)
    study gpu_tests 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests
    ;;
  e2e)
    study end_to_end 420 python3 sweeps/end_to_end.py --device cuda --out "$RESULTS" --resume
    ;;
  *)
    echo "unknown phase $phase (dist, single, tests, e2e)" >&2
    exit 2
    ;;
esac
tar czf "$OUT/results.tgz" --exclude='*.pickle' --exclude='traces' "$RESULTS" kernels/flash_attention_tuned.json 2>/dev/null
echo "packed $OUT/results.tgz"
