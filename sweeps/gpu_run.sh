#!/usr/bin/env bash
# GPU runs in phases that each fit one 10-minute command on a 2x H200 host, with every study under its own
# timeout, `--resume` (an interrupted study keeps its finished trials; running the phase again continues it; the
# collectives grid excepted, whose Ray / mp comparison needs one run) and the results packed into $OUT/results.tgz.
# Run from the repository root, e.g. on a lent GPU host:
#
#   bash sweeps/gpu_run.sh dist      # 2 GPUs: NCCL-setting scan + collectives grid, DDP, sharded optimizer (~9 min)
#   bash sweeps/gpu_run.sh allreduce # 2 GPUs: the NCCL-setting scan + collectives grid alone               (~4 min)
#   bash sweeps/gpu_run.sh fsdp      # 2 GPUs: FSDP study (all variants), the gpu-marked tests (-n 8)     (~7 min)
#   bash sweeps/gpu_run.sh paired    # 2 GPUs: bf16 DDP and FSDP, every variant also against single in
#                                    #   alternating blocks (--paired-rounds), into $RESULTS/paired          (~8 min)
#   bash sweeps/gpu_run.sh compiled  # 2 GPUs: the same with compiled blocks (--compile), into $RESULTS/compiled (~8 min)
#   bash sweeps/gpu_run.sh alone     # 1 GPU: Dynamo's guards per compiled block (single, FSDP), then the wrappers'
#                                    #   whole machinery on a group of one (bf16 DDP eager and compiled, FSDP
#                                    #   compiled, --collectives-alone, paired vs single)                  (~6 min)
#   bash sweeps/gpu_run.sh ckpt      # checkpointing trials (Ray Tune, one GPU per trial)                  (~4 min)
#   bash sweeps/gpu_run.sh flash     # Ray Tune tile sweep (one GPU per trial), the FlashAttention grid    (~9.5 min)
#   bash sweeps/gpu_run.sh gluon     # 1 GPU: Gluon GPU tests, the paired hopper study, host time per call   (~7 min)
#   bash sweeps/gpu_run.sh gluoncheck # 1 GPU: every Gluon config checked on odd shapes and timed          (~6 min)
#   bash sweeps/gpu_run.sh gluontiles # 1 GPU: the Gluon kernels' launch knobs, paired (flash_tiles --variants gluon) (~6 min)
#   bash sweeps/gpu_run.sh leaderboard # 1 GPU: the 8B step's ablation and --check (issue 15)             (~8.5 min)
#   bash sweeps/gpu_run.sh lbtune    # 1 GPU: the advisor's plan against its neighbours, a profile of the step (~8 min)
#   bash sweeps/gpu_run.sh lb2       # 2 GPUs: the 8B step on two ranks (Ray gang) and on one, same commit (~8 min)
#   bash sweeps/gpu_run.sh tests     # the gpu-marked tests (-n 8 needs pytest-xdist)                      (~1 min)
#   bash sweeps/gpu_run.sh e2e       # the end-to-end model study (handout 2)                             (~7 min)
#
# Ray comes from wheels when the host has none: set WHEELS=.whl (the README's "Studies" section says how to make it).
# Exit status: 2 without the GPUs the phase needs (nothing runs), 1 if a study failed, else 0.
set -u
PHASES="dist allreduce fsdp paired compiled alone ckpt flash gluon gluoncheck gluontiles leaderboard lbtune lb2 tests e2e"
phase=${1:?usage: gpu_run.sh PHASE, one of: $PHASES}
# An unknown phase is refused first, before the GPU check (one line, exit 2).
known=0
for name in $PHASES; do [ "$phase" = "$name" ] && known=1; done
if [ $known = 0 ]; then
  echo "gpu_run.sh: unknown phase '$phase' (one of: $PHASES)" >&2
  exit 2
fi
OUT=${OUT:-/tmp/raysys-gpu}
# Results go to a run directory of their own (never straight into the committed results/): running a phase again
# continues it (--resume of the same commit); copy what you keep into results/ afterwards.
RESULTS=${RESULTS:-runs/gpu}
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site "$WHEELS"/*.whl 2>/dev/null
  export PYTHONPATH=$PWD:$PWD/.site${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# Rows name their commit from RAYSYS_GIT_SHA when set, else from git (with "-dirty" for local changes). A host that
# got a copy of a working tree may hold a stale .git: set RAYSYS_GIT_SHA=<commit> there, 12 digits
# (`git rev-parse --short=12 HEAD`, as rows write it); a shorter one is expanded by `python -m raysys migrate`.

# GPUs each phase needs; none runs without them (one line, exit 2, before any study starts).
case $phase in
  dist|allreduce|fsdp|paired|compiled|lb2) need=2 ;;
  *) need=1 ;;
esac
have=$(python3 -c "import torch; print(torch.cuda.device_count())" 2> /dev/null || echo 0)
if [ "$have" -lt "$need" ]; then
  echo "gpu_run.sh $phase: needs $need CUDA GPU(s); this machine has $have" >&2
  exit 2
fi
mkdir -p "$OUT" "$RESULTS"

FAILED=0
study() {  # study NAME SECONDS command...: run with a timeout, keep its log, never stop the phase
  local name=$1 seconds=$2 code
  shift 2
  echo "== $name (at most ${seconds}s)"
  timeout --signal=TERM --kill-after=20 "$seconds" "$@" > "$OUT/$name.log" 2>&1
  code=$?
  [ $code -ne 0 ] && FAILED=1
  echo "   exit $code ; last lines:"
  grep -v -E "USDT|^\s*$|logging.cc" "$OUT/$name.log" | tail -n 12 | cut -c1-220
}

# NCCL settings the collectives scan compares (mp launch, all-reduce, 2 ranks); the best at 1 GiB then runs the
# whole grid next to NCCL's defaults, Ray and multiprocessing launches alike.
NCCL_SCAN=(default NCCL_MIN_NCHANNELS=24,NCCL_MAX_NCHANNELS=24 NCCL_MIN_NCHANNELS=32,NCCL_MAX_NCHANNELS=32
           NCCL_MIN_NCHANNELS=48,NCCL_MAX_NCHANNELS=48 NCCL_MIN_NCHANNELS=64,NCCL_MAX_NCHANNELS=64
           NCCL_BUFFSIZE=16777216 NCCL_MIN_NCHANNELS=32,NCCL_MAX_NCHANNELS=32,NCCL_BUFFSIZE=16777216
           NCCL_MIN_NCHANNELS=32,NCCL_MAX_NCHANNELS=32,NCCL_P2P_NVL_CHUNKSIZE=1048576
           NCCL_MIN_NCHANNELS=32,NCCL_MAX_NCHANNELS=32,NCCL_ALGO=Ring,NCCL_PROTO=Simple
           NCCL_PROTO=LL128 NCCL_NTHREADS=512)
DDP_VARIANTS=single,naive,flat,overlapped,bucketed:1,bucketed:10,bucketed:100,bucketed:1000
DDP_VARIANTS+=,torch,bucketed:100@8,bucketed:100@8+carve,bucketed:1000@8

allreduce() {  # the scan (mp launch, all-reduce, 2 ranks; its own file), then the whole grid with the best setting
  # and the defaults in ONE run (--overwrite, not --resume: each Ray / mp pair the targets compare is measured together)
  local scan=() env best
  for env in "${NCCL_SCAN[@]}"; do scan+=(--nccl-env "$env"); done
  study allreduce_scan 240 python3 sweeps/allreduce.py --device cuda --out "$RESULTS" --resume --world-sizes 2 \
    --launchers mp --ops all_reduce --sizes 256MiB,1GiB --sweep-name allreduce_scan "${scan[@]}"
  if [ ! -f "$RESULTS/allreduce_scan.parquet" ]; then
    echo "   no scan rows: the collectives grid is not run"
    return
  fi
  best=$(python3 - "$RESULTS" <<'PY'
import sys, pandas as pd
d = pd.read_parquet(f"{sys.argv[1]}/allreduce_scan.parquet")
d = d[(d.status == "ok") & (d.op == "all_reduce") & (d.size_bytes == 2**30) & (d.launcher == "mp")]
print((d.loc[d.busbw_GBps.idxmax(), "nccl_env"] or "default") if len(d) else "default")
PY
)
  echo "   best NCCL setting at 1 GiB: $best"
  local grid=(--nccl-env default)
  [ "$best" != default ] && grid+=(--nccl-env "$best")
  study allreduce 180 python3 sweeps/allreduce.py --device cuda --out "$RESULTS" --overwrite "${grid[@]}"
}

paired_studies() {  # paired_studies FOLDER [--compile]: the bf16 DDP and FSDP targets, each variant against single
  local dir=$1
  shift
  mkdir -p "$dir"
  study ddp_paired 270 python3 sweeps/ddp.py --device cuda --out "$dir" --resume --dtypes bf16 \
    --warmup 2 --steps 8 --max-steps 12 --paired-rounds 6 --profile "" "$@" \
    --variants single,overlapped,bucketed:100,bucketed:1000,torch
  study fsdp_paired 200 python3 sweeps/fsdp.py --device cuda --out "$dir" --resume --dtypes bf16 --profile "" \
    --paired-rounds 6 "$@" --variants single,ddp_sharded,fsdp,fsdp_flat,fsdp_hp,fsdp2
}

case $phase in
  dist)
    allreduce
    study ddp 270 python3 sweeps/ddp.py --device cuda --out "$RESULTS" --resume --warmup 2 --steps 8 \
      --max-steps 12 --variants "$DDP_VARIANTS" --profile naive,overlapped
    study sharded_optimizer 60 python3 sweeps/sharded_optimizer.py --device cuda --out "$RESULTS" --resume \
      --warmup 2 --steps 8
    ;;
  allreduce)
    allreduce
    ;;
  fsdp)  # FSDP (every variant of a dtype in one run, for the same-run ratios), then the tests (8 workers)
    study fsdp 400 python3 sweeps/fsdp.py --device cuda --out "$RESULTS" --resume --profile fsdp,fsdp_hp,fsdp2
    study gpu_tests 120 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 tests
    ;;
  paired)
    paired_studies "$RESULTS/paired"
    ;;
  compiled)
    paired_studies "$RESULTS/compiled" --compile
    ;;
  alone)  # issue 19 on one GPU: every collective a larger group issues, over no peer, against single and torch's
    # wrappers; torch's NCCL flight recorder off in every variant (it doubles each NCCL call's host cost; TRACE=N
    # keeps N entries), ROUNDS paired rounds (default 10; even 20 did not resolve 2% on the lent hosts)
    w1=(--device cuda --world-sizes 1 --launcher mp --dtypes bf16 --collectives-alone --paired-rounds "${ROUNDS:-10}"
        --warmup 2 --steps 4 --profile "" --nccl-trace-buffer "${TRACE:-0}")
    # Dynamo's cache lookup per call of a compiled block and its guards, single against FSDP (once per results folder)
    mkdir -p "$RESULTS/alone"
    guards="$RESULTS/alone/dynamo_guard_check_fsdp_cuda.parquet"
    [ -e "$guards" ] || study guard_check 180 python3 results/runs/dynamo_guard_check_fsdp.py --device cuda --out "$guards"
    study ddp_alone 200 python3 sweeps/ddp.py "${w1[@]}" --out "$RESULTS/alone" --resume --max-steps 4 \
      --no-single-rerun --variants single,overlapped,bucketed:1000,torch
    study ddp_alone_compiled 250 python3 sweeps/ddp.py "${w1[@]}" --out "$RESULTS/alone" --resume --max-steps 4 \
      --no-single-rerun --variants single,overlapped,overlapped_each,bucketed:1000,torch --compile
    study fsdp_alone_compiled 260 python3 sweeps/fsdp.py "${w1[@]}" --out "$RESULTS/alone" --resume \
      --variants single,fsdp,fsdp2 --compile
    ;;
  ckpt)  # the checkpointing trials (Ray Tune, one GPU per trial: two at a time)
    study checkpointing 250 python3 sweeps/checkpointing.py --device cuda --out "$RESULTS" --resume
    ;;
  flash)  # the Ray Tune tile sweep (one GPU per trial), then the FlashAttention grid on one GPU
    study flash_tiles 300 python3 sweeps/flash_tiles.py --out "$RESULTS" --resume --time-budget-s 270 \
      --shapes 4096/128/bf16/causal,16384/64/bf16/causal,4096/128/bf16/full,4096/64/fp32/causal
    study flash_grid 250 python3 sweeps/flash_bench.py --studies grid --device cuda --out "$RESULTS" --resume \
      --time-budget-s 230
    ;;
  gluon)  # issue 16 on one GPU: the gluon path's GPU tests, then the hopper study with the gluon path beside the tl
    # paths and both SDPA backends, auto also paired against cuDNN in alternating rounds, then the host time of a
    # call (~7 min)
    study flash_gluon_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -k gluon \
      tests/kernels/attention/test_interface_gpu.py tests/kernels/attention/gluon/test_gluon.py
    study flash_hopper 260 python3 sweeps/flash_bench.py --studies hopper --time-budget-s 210 --out "$RESULTS" --resume \
      --providers triton,triton_gluon,triton_gluon_1pass,triton_tma,triton_portable,sdpa_cudnn,sdpa_flash \
      --paired-rounds 9
    # host time per call at 4x32x2048x128 (the shape a slow host binds), into $RESULTS/flash_host_cost.parquet (redone
    # whole when the phase runs again: --overwrite)
    study flash_host_cost 90 python3 results/runs/flash_host_cost.py "$RESULTS" --overwrite
    ;;
  gluoncheck)  # issue 16 on one GPU: every Gluon config of flash_gluon_check.py checked on odd shapes and timed
    # (forward and backward; one pass, redone whole when the phase runs again: --overwrite; MATCH=REGEX picks
    # configs) (~6 min cold)
    study flash_gluon 500 python3 sweeps/flash_gluon_check.py --part all --out "$RESULTS" --overwrite \
      ${MATCH:+--config-match "$MATCH"}
    ;;
  gluontiles)  # issue 16 on one GPU: the Gluon forward's and one-pass backward's knobs at two d-128 and one d-64 shape, each
    # checked against the tl kernels and timed (the local launcher: 8 processes compile the grid first), into
    # $RESULTS/flash_tiles.parquet and the tuned file beside it (its `gluon` part; install it by copying it to kernels/);
    # VARIANTS=gluon,gluon_persistent adds the persistent grids of the forward and the one-pass backward (~3 min more);
    # the backward's dQ axis (halves, whole, whole with `dk_late`) triples its grid and its dQ tiles per group (1, 2)
    # double it, the forward's emulated exp2s (none, one in 8) and its rescale order (`rescale_under_s`) double its
    # twice: a phase cut off by its timeout
    # continues when run again (--resume); each trial also pairs its config against the launcher's in PAIRED
    # alternating rounds (default 4; 0: off), and the winners go by those ratios
    study flash_tiles_gluon 420 python3 sweeps/flash_tiles.py --launcher local --variants "${VARIANTS:-gluon}" --kernels fwd,dkdvq \
      --shapes 16384/128/bf16/causal,4x32/2048/128/bf16/causal,8x16/4096/64/bf16/causal --compile-workers 8 \
      --paired-rounds "${PAIRED:-4}" --out "$RESULTS" --resume
    ;;
  leaderboard)  # issue 15 on one GPU: --check, then the ablation (the fast step at batch 1 by the course's do_bench,
    # shortened; the other rows by CUDA events after their first step), into $RESULTS/leaderboard (~8.5 min)
    study leaderboard 560 python3 sweeps/leaderboard.py --size leaderboard --device cuda --studies ablation --no-ray \
      --timer do_bench --do-bench-only best:b1 --rep-ms 1 --warmup-ms 1 --steps 2 --warmup-steps 0 --check \
      --out "$RESULTS/leaderboard" --resume
    ;;
  lbtune)  # issue 15: the advisor's plan of the fast step and its neighbours, then a profile of one fast step (~8 min)
    # The events timer (first step, one warm-up, median of 3), as the ablation's rows other than best:b1: the
    # course's do_bench defaults (10 s warm-up, 30 s of repeats) would spend about a minute on each of the five plans.
    study leaderboard_tune 330 python3 sweeps/leaderboard.py --size leaderboard --device cuda --studies neighbours \
      --no-ray --best-attention cudnn --timer events --warmup-steps 1 --steps 3 --out "$RESULTS/leaderboard" --resume
    study leaderboard_profile 150 env OUT="$RESULTS/leaderboard" LABEL=fast python3 results/runs/leaderboard_profile.py
    ;;
  lb2)  # issue 17 on two GPUs: the 2-GPU step (batch 1 per rank, 2 in all) through the Ray gang by the course's
    # harness (its call counts agreed across the ranks) with one profiled step, then this commit's one-GPU step at
    # batch 1 by the same harness, in a process of its own (a driver that held the 8B model would crowd rank 0) (~8 min)
    study leaderboard_ddp 300 python3 sweeps/leaderboard.py --size leaderboard --device cuda --studies ddp \
      --world-sizes 2 --launcher ray --timer do_bench --rep-ms 20000 --warmup-ms 5000 --out "$RESULTS/leaderboard" --resume
    study leaderboard_one 200 python3 sweeps/leaderboard.py --size leaderboard --device cuda --studies ablation \
      --variants best --no-batch2 --timer do_bench --rep-ms 20000 --warmup-ms 5000 --out "$RESULTS/leaderboard" --resume
    ;;
  tests)
    study gpu_tests 170 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 tests
    ;;
  e2e)
    study end_to_end 420 python3 sweeps/end_to_end.py --device cuda --out "$RESULTS" --resume
    ;;
  *)  # (refused above)
    exit 2
    ;;
esac
tar czf "$OUT/results.tgz" --exclude='*.pickle' --exclude='traces' "$RESULTS" 2>/dev/null
echo "packed $OUT/results.tgz"
exit $FAILED
