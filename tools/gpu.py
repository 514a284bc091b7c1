"""GPU runs in phases, each sized for one 10-minute command on a lent 1- or 2-GPU host: `PHASES` is the table.

    python -m tools.gpu --list                     # every phase: GPUs, minutes, what it runs
    python -m tools.gpu dist [fsdp ...]            # run phases in order, from the repository root
    python -m tools.gpu gluon --dry-run            # print each study's command; runs and writes nothing

Every study runs under its own timeout (SIGTERM, SIGKILL 20 s later) with its log in OUT/<study>.log and the last
lines printed; most take `--resume`, so running a phase again continues it. Results go to RESULTS (`--results`,
env RESULTS, default runs/gpu; never straight into the committed results/) and are packed into OUT/results.tgz
(`--out`, env OUT, default /tmp/raysys-gpu); the FlashAttention checks (`flashcheck`, `candidates`) write into OUT
and pack their logs into OUT/logs.tgz instead. Knobs read from the environment: ROUNDS, TRACE (alone), MATCH
(gluoncheck), VARIANTS, KERNELS, SHAPES, PAIRED (gluontiles), those of `flashcheck` and
`candidates` (their functions say which), RAYSYS_GIT_SHA (rows name that commit; 12 digits), and WHEELS: a folder
of .whl files (Ray and what it imports, for a host without them) installed with `pip --target .site` and put on
the studies' PYTHONPATH. Exit status: 2 for an unknown phase or without the GPUs a phase needs (one line, nothing
written), 1 if a study failed, else 0.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Union

ROOT = Path(__file__).resolve().parents[1]
PROG = "tools.gpu"


@dataclass(frozen=True)
class Study:
    """One command of a phase: `argv` with `python` meaning this interpreter; `{results}` and `{out}` in an argument
    or an env value are filled in. It may run `seconds` at most; its output goes to OUT/<name>.log (or `log`)."""

    name: str
    seconds: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    log: str | None = None
    stderr_log: str | None = None  # a file of its own for stderr (ncu writes its CSV to stdout)


Step = Union[Study, Callable[["Context"], None]]


@dataclass(frozen=True)
class Phase:
    gpus: int
    minutes: float
    summary: str
    steps: tuple[Step, ...]
    pack_logs: bool = False  # the FlashAttention checks: logs into OUT/logs.tgz, no results.tgz


def py(name: str, seconds: int, *argv: str, **env: str) -> Study:
    return Study(name, seconds, ("python", *argv), env)


# ----------------------------------------------------------------------------------------------------- the phases
NCCL_SCAN = ("default", "NCCL_MIN_NCHANNELS=24,NCCL_MAX_NCHANNELS=24", "NCCL_MIN_NCHANNELS=32,NCCL_MAX_NCHANNELS=32",
             "NCCL_MIN_NCHANNELS=48,NCCL_MAX_NCHANNELS=48", "NCCL_MIN_NCHANNELS=64,NCCL_MAX_NCHANNELS=64",
             "NCCL_BUFFSIZE=16777216", "NCCL_MIN_NCHANNELS=32,NCCL_MAX_NCHANNELS=32,NCCL_BUFFSIZE=16777216",
             "NCCL_MIN_NCHANNELS=32,NCCL_MAX_NCHANNELS=32,NCCL_P2P_NVL_CHUNKSIZE=1048576",
             "NCCL_MIN_NCHANNELS=32,NCCL_MAX_NCHANNELS=32,NCCL_ALGO=Ring,NCCL_PROTO=Simple", "NCCL_PROTO=LL128",
             "NCCL_NTHREADS=512")
"""NCCL settings the collectives scan compares (mp launch, all-reduce, 2 ranks)."""
DDP_VARIANTS = ("single,naive,flat,overlapped,bucketed:1,bucketed:10,bucketed:100,bucketed:1000,torch,bucketed:100@8,"
                "bucketed:100@8+carve,bucketed:1000@8")
GPU_TESTS = ("-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-n", "8", "tests")


def allreduce(ctx: Context) -> None:
    """The NCCL-setting scan (its own file), then the whole grid with the best setting at 1 GiB beside NCCL's
    defaults in ONE run (--overwrite, not --resume: each Ray / mp pair the targets compare is measured together)."""
    scan = [a for env in NCCL_SCAN for a in ("--nccl-env", env)]
    ctx.run(py("allreduce_scan", 240, "sweeps/allreduce.py", "--device", "cuda", "--out", "{results}", "--resume",
               "--world-sizes", "2", "--launchers", "mp", "--ops", "all_reduce", "--sizes", "256MiB,1GiB",
               "--sweep-name", "allreduce_scan", *scan))
    if not ctx.dry and not (ctx.results / "allreduce_scan.parquet").is_file():
        print("   no scan rows: the collectives grid is not run", flush=True)
        return
    best = "<best at 1 GiB>" if ctx.dry else ctx.helper("best-nccl", str(ctx.results)) or "default"
    print(f"   best NCCL setting at 1 GiB: {best}", flush=True)
    grid = ["--nccl-env", "default"] + (["--nccl-env", best] if best != "default" else [])
    ctx.run(py("allreduce", 180, "sweeps/allreduce.py", "--device", "cuda", "--out", "{results}", "--overwrite", *grid))


def paired(folder: str, *extra: str) -> tuple[Study, ...]:
    """The bf16 DDP and FSDP targets, each variant against single in alternating blocks, into RESULTS/<folder>."""
    out = "{results}/" + folder
    return (py("ddp_paired", 270, "sweeps/ddp.py", "--device", "cuda", "--out", out, "--resume", "--dtypes", "bf16",
               "--warmup", "2", "--steps", "8", "--max-steps", "12", "--paired-rounds", "6", "--profile", "", *extra,
               "--variants", "single,overlapped,bucketed:100,bucketed:1000,torch"),
            py("fsdp_paired", 200, "sweeps/fsdp.py", "--device", "cuda", "--out", out, "--resume", "--dtypes", "bf16",
               "--profile", "", "--paired-rounds", "6", *extra,
               "--variants", "single,ddp_sharded,fsdp,fsdp_flat,fsdp_hp,fsdp2"))


def alone(ctx: Context) -> None:
    """One GPU: every collective a larger group issues, over no peer, against single and torch's wrappers;
    the NCCL flight recorder off in every variant (TRACE=N keeps N entries), ROUNDS paired rounds (default 10).
    First Dynamo's guards per compiled block, single against FSDP (once per results folder)."""
    w1 = ("--device", "cuda", "--world-sizes", "1", "--launcher", "mp", "--dtypes", "bf16", "--collectives-alone",
          "--paired-rounds", os.environ.get("ROUNDS", "10"), "--warmup", "2", "--steps", "4", "--profile", "",
          "--nccl-trace-buffer", os.environ.get("TRACE", "0"), "--out", "{results}/alone", "--resume")
    guards = ctx.results / "alone" / "dynamo_guard_check_fsdp_cuda.parquet"
    if ctx.dry or not guards.exists():
        ctx.run(py("guard_check", 180, "-m", "tools.dynamo_guard_check_fsdp", "--device", "cuda", "--out",
                   "{results}/alone/dynamo_guard_check_fsdp_cuda.parquet"))
    ctx.run(py("ddp_alone", 200, "sweeps/ddp.py", *w1, "--max-steps", "4", "--no-single-rerun",
               "--variants", "single,overlapped,bucketed:1000,torch"))
    ctx.run(py("ddp_alone_compiled", 250, "sweeps/ddp.py", *w1, "--max-steps", "4", "--no-single-rerun",
               "--variants", "single,overlapped,overlapped_each,bucketed:1000,torch", "--compile"))
    ctx.run(py("fsdp_alone_compiled", 260, "sweeps/fsdp.py", *w1, "--variants", "single,fsdp,fsdp2", "--compile"))


def gluoncheck(ctx: Context) -> None:
    """Every Gluon config of sweeps/flash_gluon_check.py checked on odd shapes and timed (one pass, redone whole:
    --overwrite); MATCH=REGEX picks configs."""
    match = ("--config-match", os.environ["MATCH"]) if os.environ.get("MATCH") else ()
    ctx.run(py("flash_gluon", 500, "sweeps/flash_gluon_check.py", "--part", "all", "--out", "{results}", "--overwrite",
               *match))


def gluontiles(ctx: Context) -> None:
    """The Gluon forward's and one-pass backward's knobs at two d-128 and one d-64 shape, each checked against the tl
    kernels and timed (8 processes compile the grid first) into RESULTS/flash_tiles.parquet and the tuned file
    beside it; VARIANTS=gluon,gluon_persistent adds the persistent grids, KERNELS (fwd,dkdvq) and SHAPES narrow the
    grid (`flash_tiles.py`'s --kernels and --shapes); each trial is also paired against the launcher's config in
    PAIRED alternating rounds (default 4; 0: off). A phase cut off by its timeout continues when run again (--resume)."""
    ctx.run(py("flash_tiles_gluon", 420, "sweeps/flash_tiles.py", "--launcher", "local", "--variants",
               knob("VARIANTS", "gluon"), "--kernels", knob("KERNELS", "fwd,dkdvq"), "--shapes",
               knob("SHAPES", "16384/128/bf16/causal,4x32/2048/128/bf16/causal,8x16/4096/64/bf16/causal"),
               "--compile-workers", "8", "--paired-rounds", knob("PAIRED", "4"), "--out", "{results}", "--resume"))


def knob(name: str, default: str) -> str:
    return os.environ.get(name) or default


def ncu(name: str, seconds: int, sections: tuple[str, ...], *profile_args: str) -> Study:
    """ncu (its CSV into OUT/<name>.csv) on 3 launches of the tl kernels in sweeps/flash_profile.py, clocks as set."""
    sections = tuple(a for s in sections for a in ("--section", s))
    return Study(name, seconds, ("ncu", "--clock-control", "none", "-k", "regex:_flash_(fwd|bwd_dkdv|bwd_dq)_kernel",
                                 "--launch-skip", "3", "--launch-count", "3", *sections, "--csv", "--page", "details",
                                 "python", "sweeps/flash_profile.py", *profile_args), log=f"{name}.csv",
                 stderr_log=f"{name}.log")


def flash_env(ctx: Context, candidates: bool) -> None:
    """What the FlashAttention checks share: OUT's own copy of the tuned file (RAYSYS_FLASH_TUNED for every later
    step; the committed kernels/attention/triton/tuned.json is never written) and the versions, in OUT/env.txt."""
    if not ctx.dry:
        shutil.copy(ROOT / "kernels" / "attention" / "triton" / "tuned.json", ctx.out / "flash_attention_tuned.json")
    ctx.env["RAYSYS_FLASH_TUNED"] = str(ctx.out / "flash_attention_tuned.json")
    ctx.run(Study("env", 60, ("python", "-m", "tools.gpu_helpers", "versions", *(["--signatures"] if candidates
                                                                              else [])), log="env.txt"))


def first_calls(ctx: Context, jobs: tuple[tuple[str, str], ...], heads: int, seconds: int, own_cache: bool) -> list:
    """One process per (path, backward, head dim) compiling the tuned configs, each log's first call its cost."""
    started = []
    for path, bwd in jobs:
        for d in (128, 64):
            env = {"TRITON_CACHE_DIR": f"/tmp/flash_cache_{path}_{bwd}_{d}"} if own_cache else {}
            started.append(ctx.start(Study(f"first_{path}_{bwd}_{d}", seconds, (
                "python", "sweeps/flash_profile.py", "--autotune", "--warmup", "0", "--shape", f"1x{heads}x1024x{d}",
                "--paths", path, "--bwd", bwd), env)))
    return started


def flashcheck(ctx: Context) -> None:
    """The one-command check of the tl kernels on one GPU, into OUT:
    1. the gpu-marked flash tests (TEST_K selects with -k; TEST_WORKERS, TEST_TIMEOUT) while step 2 compiles;
    2. RUN_TILES=1 (default): the tile sweep of TILES_VARIANTS on TILES_SHAPES (no Ray; COMPILE_WORKERS processes
       compile first, then it waits for the tests), its best configs merged into OUT's tuned file; RUN_TILES=0: the
       tuned configs compiled per (path, backward, head dim), each on a fresh cache, logging its first-call cost;
    3. the hopper study (BENCH_PROVIDERS narrows the providers; BENCH_TIMEOUT);
    4. RUN_NCU=1: ncu on one launch of each kernel per path at NCU_SHAPE; 5. RUN_COLD=1: the first call at
       1x32x32768x128 on a fresh Triton cache, tuned file and autotuning."""
    flash_env(ctx, candidates=False)
    done = ctx.out / "tests.done"
    done.unlink(missing_ok=True)
    workers = ("-n", knob("TEST_WORKERS", "8")) if ctx.dry or ctx.helper("has-xdist") == "yes" else ()
    select = ("-k", os.environ["TEST_K"]) if os.environ.get("TEST_K") else ()
    tests = ctx.start(Study("gpu_tests", int(knob("TEST_TIMEOUT", "200")), (
        "python", "-m", "pytest", "-m", "gpu", "tests/kernels/attention/test_interface_gpu.py", "-q", "-p",
        "no:cacheprovider", *workers, *select)), done=done)
    run_tiles = knob("RUN_TILES", "1")
    if run_tiles == "0":
        ctx.wait(first_calls(ctx, (("tma", "two_pass"), ("tma", "one_pass"), ("portable", "two_pass")), 16, 150,
                             own_cache=True))
    elif run_tiles == "1":
        ctx.run(py("tiles", int(knob("TILES_TIMEOUT", "170")), "sweeps/flash_tiles.py", "--launcher", "local",
                   "--quick", "--variants", knob("TILES_VARIANTS", "tma,tma_r128,tma_persistent"), "--shapes",
                   knob("TILES_SHAPES", "16384/128/bf16/causal,2048/128/bf16/causal,4096/64/bf16/causal"),
                   "--min-configs", "3", "--compile-workers", knob("COMPILE_WORKERS", "8"), "--wait-file", str(done),
                   "--out", "{out}", "--json", "{out}/flash_attention_tuned.json"))
    ctx.wait([tests])
    if run_tiles == "0" and not ctx.dry:
        # Into the shared cache only after the tests: a copy that overlaps them can crash workers loading kernels.
        cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
        for own in Path("/tmp").glob("flash_cache_*"):
            shutil.copytree(own, cache, dirs_exist_ok=True)
    providers = ("--providers", os.environ["BENCH_PROVIDERS"]) if os.environ.get("BENCH_PROVIDERS") else ()
    ctx.run(py("bench", int(knob("BENCH_TIMEOUT", "150")), "sweeps/flash_bench.py", "--study", "hopper", "--out",
               "{out}", *providers))
    if knob("RUN_NCU", "0") == "1" and (ctx.dry or shutil.which("ncu")):
        for path in ("portable", "tma"):  # 4 launches a call (fwd, D, dK/dV, dQ); the filter keeps 3; skip the warm-up
            ctx.run(ncu(f"ncu_{path}", int(knob("NCU_TIMEOUT", "60")), ("SpeedOfLight", "ComputeWorkloadAnalysis",
                        "WarpStateStats"), "--shape", knob("NCU_SHAPE", "1x16x16384x128"), "--paths", path))
    if knob("RUN_COLD", "0") == "1":
        for mode in ("tuned", "autotune"):
            ctx.run(Study(f"cold_{mode}", 120, ("python", "-m", "tools.gpu_helpers", "first-call", mode),
                          {"TRITON_CACHE_DIR": "" if ctx.dry else tempfile.mkdtemp(),
                           "RAYSYS_FLASH_AUTOTUNE": "0" if mode == "tuned" else "1"}, log="cold.log"))
    ctx.run(py("summary", 120, "sweeps/flash_summary.py", "{out}"))
    done.unlink(missing_ok=True)


def candidates(ctx: Context) -> None:
    """The launch-config candidate matrix (sweeps/flash_bench.py CANDIDATES, or the space-separated CANDIDATES): each
    candidate's check in its own process (CHECK_TIMEOUT) beside first calls of the tuned paths, then all of them timed
    against SDPA cuDNN and flash (BENCH_TIMEOUT, BENCH_BUDGET), the fastest tma configs written first into OUT's tuned
    file, the hopper study under it into OUT/hopper (HOPPER_TIMEOUT, HOPPER_BUDGET), and ncu on one launch of each
    kernel at NCU_SHAPE for the earlier tuned tma configs and the fastest ones (where ncu is installed)."""
    flash_env(ctx, candidates=True)
    names = os.environ.get("CANDIDATES", "").split() or (
        ["<each of sweeps.flash_bench.CANDIDATES>"] if ctx.dry else ctx.helper("candidates").split())
    check = int(knob("CHECK_TIMEOUT", "120"))
    started = [ctx.start(py(f"check_{name}", check, "sweeps/flash_bench.py", "--studies", "candidates",
                            "--candidates", name, "--check-only", "--out", f"/tmp/flash_check/{name}"))
               for name in names]
    ctx.wait(started + first_calls(ctx, (("tma", "one_pass"), ("portable", "one_pass"), ("portable", "two_pass")), 2,
                                   check, own_cache=False))
    chosen = ("--candidates", ",".join(os.environ["CANDIDATES"].split())) if os.environ.get("CANDIDATES") else ()
    ctx.run(py("bench", int(knob("BENCH_TIMEOUT", "140")), "sweeps/flash_bench.py", "--studies", "candidates",
               "--time-budget-s", knob("BENCH_BUDGET", "115"), *chosen, "--out", "{out}"))
    ctx.run(py("write_tuned", 120, "sweeps/flash_bench.py", "--studies", "candidates", "--report-only", "--out",
               "{out}", "--write-tuned", "{out}/flash_attention_tuned.json"))
    ctx.run(py("hopper_bench", int(knob("HOPPER_TIMEOUT", "140")), "sweeps/flash_bench.py", "--study", "hopper",
               "--time-budget-s", knob("HOPPER_BUDGET", "115"), "--out", "{out}/hopper"))
    if not (ctx.dry or shutil.which("ncu")):
        return
    shape = knob("NCU_SHAPE", "1x32x32768x128")
    picks = ["<base>", "<fastest>"] if ctx.dry else ctx.helper("ncu-picks", str(ctx.out / "flash_bench.parquet"),
                                                               shape).split()
    print(f"   ncu picks (fwd,dkdv,dq): {' '.join(picks)}", flush=True)
    for i, pick in enumerate(picks):
        fwd, dkdv, dq = (pick.split(",") + ["?", "?"])[:3]
        ctx.run(ncu(f"ncu_{i}", int(knob("NCU_TIMEOUT", "45")), ("SpeedOfLight", "Occupancy", "LaunchStats",
                    "WarpStateStats", "ComputeWorkloadAnalysis"), "--shape", shape, "--paths", "tma", "--fwd-config",
                    fwd, "--dkdv-config", dkdv, "--dq-config", dq))


LEADERBOARD = ("sweeps/leaderboard.py", "--size", "leaderboard", "--device", "cuda")
GLUON_TESTS = py("flash_gluon_tests", 200, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-n", "4", "-k",
                 "gluon", "tests/kernels/attention/test_interface_gpu.py", "tests/kernels/attention/gluon")
README_LEADERBOARD = ("-m", "raysys", "leaderboard", "--size", "leaderboard", "--device", "cuda", "--batch-size", "1",
                      "--no-batch2", "--variants", "best,today")
"""The README's leaderboard command (`python -m raysys leaderboard --size leaderboard --device cuda`) at batch 1 with
`best` and `today` only, what fits one call; without its --out."""
PHASES: dict[str, Phase] = {
    "dist": Phase(2, 9, "NCCL-setting scan + collectives grid, DDP, sharded optimizer", (
        allreduce,
        py("ddp", 270, "sweeps/ddp.py", "--device", "cuda", "--out", "{results}", "--resume", "--warmup", "2",
           "--steps", "8", "--max-steps", "12", "--variants", DDP_VARIANTS, "--profile", "naive,overlapped"),
        py("sharded_optimizer", 60, "sweeps/sharded_optimizer.py", "--device", "cuda", "--out", "{results}",
           "--resume", "--warmup", "2", "--steps", "8"))),
    "allreduce": Phase(2, 4, "the NCCL-setting scan + collectives grid alone", (allreduce,)),
    "fsdp": Phase(2, 7, "FSDP study (every variant of a dtype in one run), then the gpu-marked tests (-n 8)", (
        py("fsdp", 400, "sweeps/fsdp.py", "--device", "cuda", "--out", "{results}", "--resume", "--profile",
           "fsdp,fsdp_hp,fsdp2"),
        py("gpu_tests", 120, *GPU_TESTS))),
    "paired": Phase(2, 8, "bf16 DDP and FSDP, each variant against single in alternating blocks, into RESULTS/paired",
                    paired("paired")),
    "compiled": Phase(2, 8, "the same with compiled blocks (--compile), into RESULTS/compiled",
                      paired("compiled", "--compile")),
    "alone": Phase(1, 6, "Dynamo's guards per compiled block, then every wrapper on a group of one through a larger "
                         "group's collectives (bf16 DDP eager and compiled, FSDP compiled), paired vs single",
                   (alone,)),
    "ckpt": Phase(1, 4, "checkpointing trials (Ray Tune, one GPU per trial)", (
        py("checkpointing", 250, "sweeps/checkpointing.py", "--device", "cuda", "--out", "{results}", "--resume"),)),
    "flash": Phase(1, 9.5, "Ray Tune tile sweep (one GPU per trial), the FlashAttention grid", (
        py("flash_tiles", 300, "sweeps/flash_tiles.py", "--out", "{results}", "--resume", "--time-budget-s", "270",
           "--shapes", "4096/128/bf16/causal,16384/64/bf16/causal,4096/128/bf16/full,4096/64/fp32/causal"),
        py("flash_grid", 250, "sweeps/flash_bench.py", "--studies", "grid", "--device", "cuda", "--out", "{results}",
           "--resume", "--time-budget-s", "230"))),
    "gluon": Phase(1, 7, "Gluon GPU tests, the paired hopper study, host time per call at 4x32x2048x128", (
        GLUON_TESTS,
        py("flash_hopper", 260, "sweeps/flash_bench.py", "--studies", "hopper", "--time-budget-s", "210", "--out",
           "{results}", "--resume", "--providers",
           "triton,triton_gluon,triton_gluon_1pass,triton_tma,triton_portable,sdpa_cudnn,sdpa_flash",
           "--paired-rounds", "9"),
        py("flash_host_cost", 90, "-m", "tools.flash_host_cost", "{results}", "--overwrite"))),
    "headline": Phase(1, 9.5, "after a kernel, dispatch or default change: the Gluon GPU tests, then the README's "
                              "leaderboard command at batch 1 (best, today), into RESULTS/headline", (
        GLUON_TESTS, py("leaderboard_readme", 360, *README_LEADERBOARD, "--out", "{results}/headline"))),
    "gluoncheck": Phase(1, 6, "every Gluon config checked on odd shapes and timed (MATCH=REGEX picks)", (gluoncheck,)),
    "gluontiles": Phase(1, 6, "the Gluon kernels' launch knobs, paired (flash_tiles --variants gluon)", (gluontiles,)),
    "leaderboard": Phase(1, 8.5, "the 8B step's --check, then its ablation (issue 15), into RESULTS/leaderboard", (
        py("leaderboard", 560, *LEADERBOARD, "--studies", "ablation", "--no-ray", "--timer", "do_bench",
           "--do-bench-only", "best:b1", "--rep-ms", "1", "--warmup-ms", "1", "--steps", "2", "--warmup-steps", "0",
           "--check", "--out", "{results}/leaderboard", "--resume"),)),
    "lbtune": Phase(1, 8, "the advisor's plan against its neighbours (events timer), a profile of one fast step", (
        py("leaderboard_tune", 330, *LEADERBOARD, "--studies", "neighbours", "--no-ray", "--best-attention", "cudnn",
           "--timer", "events", "--warmup-steps", "1", "--steps", "3", "--out", "{results}/leaderboard", "--resume"),
        py("leaderboard_profile", 150, "-m", "tools.leaderboard_profile", OUT="{results}/leaderboard",
           LABEL="fast"))),
    "lb2": Phase(2, 8, "the 8B step on two ranks (Ray gang, one profiled step) and on one, same commit (issue 17)", (
        py("leaderboard_ddp", 300, *LEADERBOARD, "--studies", "ddp", "--world-sizes", "2", "--launcher", "ray",
           "--timer", "do_bench", "--rep-ms", "20000", "--warmup-ms", "5000", "--out", "{results}/leaderboard",
           "--resume"),
        py("leaderboard_one", 200, *LEADERBOARD, "--studies", "ablation", "--variants", "best", "--no-batch2",
           "--timer", "do_bench", "--rep-ms", "20000", "--warmup-ms", "5000", "--out", "{results}/leaderboard",
           "--resume"))),
    "tests": Phase(1, 1, "the gpu-marked tests (-n 8 needs pytest-xdist)", (py("gpu_tests", 170, *GPU_TESTS),)),
    "e2e": Phase(1, 7, "the end-to-end model study (handout 2)", (
        py("end_to_end", 420, "sweeps/end_to_end.py", "--device", "cuda", "--out", "{results}", "--resume"),)),
    "flashcheck": Phase(1, 9, "the tl kernels' GPU tests, tile sweep and hopper study into OUT (was "
                              "sweeps/flash_gpu_check.sh)", (flashcheck,), pack_logs=True),
    "candidates": Phase(1, 9, "issue 16's launch-config candidates checked, timed, written to OUT's tuned file "
                              "(was MODE=candidates sweeps/flash_gpu_check.sh)", (candidates,), pack_logs=True),
}


# ----------------------------------------------------------------------------------------------------- the runner
@dataclass
class Context:
    out: Path
    results: Path
    env: dict[str, str]
    dry: bool = False
    failed: bool = False
    planned: list[Study] = field(default_factory=list)  # every study run (or printed), in order

    def fill(self, text: str) -> str:
        return text.replace("{results}", str(self.results)).replace("{out}", str(self.out))

    def command(self, study: Study) -> list[str]:
        return [sys.executable if a == "python" else self.fill(a) for a in study.argv]

    def run(self, study: Study, quiet: bool = False, done: Path | None = None) -> int:
        """Run `study` under its timeout; print its exit code and last lines (unless `quiet`); touch `done` after."""
        self.planned.append(study)
        if self.dry:
            env = [f"{k}={self.fill(v)}" for k, v in study.env.items() if k != "TRITON_CACHE_DIR"]
            print(f"{study.name} ({study.seconds}s): {shlex.join(env + self.command(study))}")
            return 0
        if not quiet:
            print(f"== {study.name} (at most {study.seconds}s)", flush=True)
        for flag, value in zip(study.argv, study.argv[1:]):  # RESULTS' subfolders exist first (as `mkdir -p` did)
            if flag == "--out" and value.startswith("{results}/"):
                folder = Path(self.fill(value))
                (folder.parent if folder.suffix == ".parquet" else folder).mkdir(parents=True, exist_ok=True)
        env = {**self.env, **{k: self.fill(v) for k, v in study.env.items()}}
        log = self.out / (study.log or f"{study.name}.log")
        with open(log, "a" if study.log else "w") as stdout, \
                open(self.out / (study.stderr_log or os.devnull), "w") as stderr:
            proc = subprocess.Popen(self.command(study), env=env, stdout=stdout, start_new_session=True,
                                    stderr=stderr if study.stderr_log else subprocess.STDOUT)
            try:
                code = proc.wait(timeout=study.seconds)
            except subprocess.TimeoutExpired:  # as `timeout --signal=TERM --kill-after=20`: exit code 124
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                code = 124
        with open(self.out / (study.stderr_log or study.log or f"{study.name}.log"), "a") as f:
            f.write(f"{study.name} exit code {code}\n")
        if done is not None:
            done.touch()
        self.failed |= code != 0
        if not quiet:
            self.report(study, code, 12)
        return code

    def report(self, study: Study, code: int, lines: int) -> None:
        """The study's exit code and the last `lines` lines of its log (blank and Ray's USDT noise left out)."""
        text = (self.out / (study.log or f"{study.name}.log")).read_text(errors="replace").splitlines()
        kept = [line[:220] for line in text if line.strip() and "USDT" not in line and "logging.cc" not in line]
        print(f"   {study.name}: exit {code} ; last lines:\n" + "\n".join(kept[-lines:]), flush=True)

    def start(self, study: Study, done: Path | None = None) -> threading.Thread:
        """Run `study` in the background, quietly; `wait` reports it."""
        thread = threading.Thread(target=lambda: setattr(thread, "code", self.run(study, True, done)), daemon=True)
        thread.study = study
        thread.start()
        if self.dry:
            thread.join()
        return thread

    def wait(self, threads: list[threading.Thread]) -> None:
        for thread in threads:
            thread.join()
            if not self.dry:
                self.report(thread.study, thread.code, 2)

    def helper(self, *args: str) -> str:
        """What `python -m tools.gpu_helpers ARGS` prints, run with the studies' environment (their PYTHONPATH)."""
        proc = subprocess.run([sys.executable, "-m", "tools.gpu_helpers", *args], env=self.env, capture_output=True,
                              text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""


def study_env(wheels: str | None) -> dict[str, str]:
    """The studies' environment: this checkout (and .site, where WHEELS were installed) first on PYTHONPATH, output
    unbuffered, no usage stats, Ray's token authentication off unless asked, NVLink multicast (NVLS) off."""
    path = [str(Path.cwd())] + ([str(Path.cwd() / ".site")] if wheels else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(path + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return env


def install_wheels(wheels: str) -> None:
    """The carried wheels into ./.site (no index, no dependencies resolved: the folder holds them all)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target",
                    ".site", *map(str, sorted(Path(wheels).glob("*.whl")))], stderr=subprocess.DEVNULL)


DRIVER_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd")
"""Paths of which one exists where a GPU driver runs (NVIDIA's device nodes and proc entry, ROCm's node)."""


def gpu_driver_present() -> bool:
    """Whether this host may have a GPU torch counts: the CUDA driver library loads or a driver's node exists
    (DRIVER_NODES). Without either, torch.cuda.device_count() is 0; asking it costs a torch import (seconds to tens of
    seconds)."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return any(Path(node).exists() for node in DRIVER_NODES)


def gpu_count(env: dict[str, str]) -> int:
    """torch.cuda.device_count() in a child with the studies' environment (0 if that fails)."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], env=env,
                           capture_output=True, text=True)
    return int(probe.stdout.strip()) if probe.returncode == 0 and probe.stdout.strip().isdigit() else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0])
    p.add_argument("phases", nargs="*", help=f"phases to run in order: {', '.join(PHASES)}")
    p.add_argument("--list", action="store_true", help="print every phase (GPUs, minutes, what it runs) and exit")
    p.add_argument("--dry-run", action="store_true", help="print each study's command; run and write nothing")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/raysys-gpu", help="logs and archives (env OUT)")
    p.add_argument("--results", default=os.environ.get("RESULTS") or "runs/gpu",
                   help="where the studies write their rows (env RESULTS; default runs/gpu)")
    args = p.parse_args(argv)
    if not args.phases and not args.list:
        p.error(f"name a phase (one of: {' '.join(PHASES)}) or --list")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, phase in PHASES.items():
            gpus = f"{phase.gpus} GPU{'s' if phase.gpus > 1 else ' '}"
            print(f"{name:<12} {gpus}  ~{phase.minutes:g} min  {phase.summary}")
        return 0
    unknown = [name for name in args.phases if name not in PHASES]
    if unknown:  # refused first, before the GPU check, on any machine
        print(f"{PROG}: unknown phase '{unknown[0]}' (one of: {' '.join(PHASES)})", file=sys.stderr)
        return 2
    phases = [PHASES[name] for name in args.phases]
    wheels = os.environ.get("WHEELS")
    ctx = Context(Path(args.out), Path(args.results), study_env(wheels), dry=args.dry_run)
    if args.dry_run:
        for name, phase in zip(args.phases, phases):
            print(f"# {name}: {phase.gpus} GPU(s), ~{phase.minutes:g} min")
            run_steps(ctx, phase)
        return 0
    need = max(phase.gpus for phase in phases)
    have = 0
    if gpu_driver_present():  # else refused without a torch import, and before the wheels are installed
        if wheels:
            install_wheels(wheels)
        have = gpu_count(ctx.env)
    if have < need:
        print(f"{PROG} {' '.join(args.phases)}: needs {need} CUDA GPU(s); this machine has {have}", file=sys.stderr)
        return 2
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.results.mkdir(parents=True, exist_ok=True)
    for phase in phases:
        run_steps(ctx, phase)
    if any(not phase.pack_logs for phase in phases):
        with tarfile.open(ctx.out / "results.tgz", "w:gz") as tar:
            tar.add(ctx.results, filter=lambda m: None if m.name.endswith(".pickle") or Path(m.name).name == "traces"
                    else m)
        print(f"packed {ctx.out / 'results.tgz'}")
    if any(phase.pack_logs for phase in phases):
        logs = [p for p in ctx.out.iterdir() if p.suffix in (".log", ".csv", ".txt")]
        with tarfile.open(ctx.out / "logs.tgz", "w:gz") as tar:
            for p in logs:
                tar.add(p, arcname=p.name)
        for p in logs:
            p.unlink()
        print(f"packed {ctx.out / 'logs.tgz'}")
    return 1 if ctx.failed else 0


def run_steps(ctx: Context, phase: Phase) -> None:
    for step in phase.steps:
        if isinstance(step, Study):
            ctx.run(step)
        else:
            step(ctx)


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `--list | head` ends quietly, as a shell tool does
    sys.exit(main())
