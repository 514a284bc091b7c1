"""The `advise` and `plan` commands' flags and runs: the advisor (`raysys.planning.advisor`) and the handout's
parallelism planner (`parallel.planner`) as commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parallel.planner import H200_BF16_FLOPS, H200_NVLINK_BYTES_PER_S, FFNProblem, bandwidth_from_results, plan_tables
from raysys.model.config import SIZES, ModelConfig
from raysys.planning.advisor import DEFAULT_TFLOPS, KINDS, advise, parse_bytes
from raysys.planning.recompute_model import LOSSES, OPTIMIZERS, PRECISIONS


def build_advise_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the advise flags to `parser` (a subcommand parser) or to a new one."""
    p = parser or argparse.ArgumentParser(prog="raysys advise", description="per-layer activation-checkpointing plan that fits a GPU")
    p.add_argument("--size", default="small", choices=sorted(SIZES), help="named model size")
    p.add_argument("--context-length", type=int, default=None, help="sequence length (default: the size's)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary override")
    p.add_argument("--gpu-memory", default="80GiB", help="device memory, e.g. 80GiB, 141GB, 8.5e10")
    p.add_argument("--dtype", default=None, choices=PRECISIONS,
                   help="compute dtype: fp32, or bf16/fp16 (autocast over fp32 weights unless --param-dtype is the "
                        "same; default: the --param-dtype)")
    p.add_argument("--param-dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="weights, gradients and AdamW state: fp32 master weights, or pure bf16/fp16 (the course's "
                        "leaderboard harness builds the model in bf16)")
    p.add_argument("--loss", default="materialized", choices=LOSSES,
                   help="materialized logits (cross_entropy(model(x), y)) or the fused LM head + loss (no logits)")
    p.add_argument("--compiled", action="store_true",
                   help="RMSNorm, RoPE and SwiGLU compiled (raysys.training.leaderboard.compile_pieces; pure precision only)")
    p.add_argument("--lean", action="store_true",
                   help="with --compiled: lean blocks (raysys.training.leaderboard.lean_blocks): norm outputs and SwiGLU's "
                        "gated product recomputed, attention's heads merged as a view")
    p.add_argument("--optimizer", default="reference", choices=OPTIMIZERS,
                   help="AdamW implementation (its step's temporary): reference, foreach or fused")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="each parameter's AdamW step runs inside backward and frees its gradient at once")
    p.add_argument("--shards", type=int, default=1,
                   help="FSDP over N ranks: each holds 1/N of the fp32 weights, gradients and AdamW state")
    p.add_argument("--attention", default="naive", help="attention backend: naive, sdpa, flash_triton, flash_pytorch")
    p.add_argument("--tflops", type=float, default=None,
                   help=f"achieved matmul TFLOP/s for the overhead estimate (default {DEFAULT_TFLOPS})")
    p.add_argument("--pcie-gbps", type=float, default=25.0, help="host<->device bandwidth for offload, GB/s")
    p.add_argument("--host-memory", default=None, help="pinned host memory offload may fill, e.g. 100GiB "
                                                       "(default: unlimited)")
    p.add_argument("--margin", type=float, default=0.05, help="fraction of memory kept free for fragmentation")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="per-layer policies allowed")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def run_advise(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in (("context_length", args.context_length), ("vocab_size", args.vocab_size))
                 if v is not None}
    from raysys.model.transformer import attention_backends

    if args.attention not in attention_backends():
        raise ValueError(f"attention {args.attention!r} is not one of {attention_backends()}")
    config = ModelConfig.from_name(args.size, attention=args.attention, **overrides)
    host = parse_bytes(args.host_memory) if args.host_memory else None
    dtype = args.dtype or args.param_dtype
    if args.shards < 1:
        raise ValueError(f"--shards ({args.shards}) must be >= 1")
    plan = advise(config, args.batch_size, parse_bytes(args.gpu_memory), dtype, tflops=args.tflops,
                  pcie_gbps=args.pcie_gbps, margin=args.margin, kinds=tuple(args.kinds), host_memory_bytes=host,
                  param_dtype=args.param_dtype, loss=args.loss, compiled=args.compiled, lean=args.lean,
                  optimizer=args.optimizer, shards=args.shards, optimizer_in_backward=args.optimizer_in_backward)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.format())
    return 0 if plan.fits else 1


def build_plan_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the `plan` flags to `parser` (a subcommand parser) or to a new one."""
    parser = parser or argparse.ArgumentParser(prog="raysys plan", description="parallelism planner (handout 8)")
    parser.add_argument("--size", choices=sorted(SIZES), default="xl",
                        help="named model size for D and D_FF (default xl)")
    parser.add_argument("--d-model", type=int, default=None, help="D (overrides --size)")
    parser.add_argument("--d-ff", type=int, default=None, help="D_FF (overrides --size)")
    parser.add_argument("--batch", type=int, default=8192, help="B: tokens in the global batch (default 8192)")
    parser.add_argument("--flops", type=float, default=H200_BF16_FLOPS,
                        help="C: FLOP/s per device (default 989e12, H200 dense BF16)")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="W: bytes/s per device; default: all-reduce bus bandwidth from --results, else 450e9 "
                             "(H200 NVLink per direction)")
    parser.add_argument("--results", default="results",
                        help="directory or allreduce.parquet of the collectives benchmark (default results/)")
    parser.add_argument("--bytes-per-element", type=float, default=2.0, help="b (default 2: fp16/bf16)")
    parser.add_argument("--devices", default="2,4,8,16,32,64,128", help="device counts for the ratio table")
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    return parser


def run_plan(args: argparse.Namespace) -> int:
    """Print (and optionally write) the plan tables for the parsed `plan` arguments."""
    size = SIZES[args.size]
    d_model, d_ff = args.d_model or size.get("d_model"), args.d_ff or size.get("d_ff")
    if d_model is None or d_ff is None:
        raise ValueError("give --d-model and --d-ff (or --size)")
    try:
        devices = [int(d) for d in str(args.devices).split(",") if d.strip()]
    except ValueError:
        raise ValueError(f"--devices ({args.devices!r}) must be a comma list of integers") from None
    if not devices or min(devices) < 1:
        raise ValueError(f"--devices ({args.devices!r}) must list positive device counts")
    if args.bandwidth is not None:
        sources = [{"busbw_GBps": args.bandwidth / 1e9, "source": "--bandwidth"}]
    else:
        sources = bandwidth_from_results(args.results) or [
            {"busbw_GBps": H200_NVLINK_BYTES_PER_S / 1e9, "source": "H200 NVLink spec (no measured all-reduce found)"}]
    sections = []
    for src in sources:
        p = FFNProblem(batch=args.batch, d_model=d_model, d_ff=d_ff, flops=args.flops,
                       bandwidth=src["busbw_GBps"] * 1e9, bytes_per_element=args.bytes_per_element)
        sections.append(f"## W from {src['source']}\n\n{plan_tables(p, devices)}")
    text = "\n".join(sections)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0
