"""Instruction counts of the Gluon forward's steady-state loop in its sm_90 SASS (issue 16), built on a CPU host.

Run from the repository root with Triton 3.6 (Gluon's Hopper API) and TRITON_INTERPRET unset or 0, no GPU needed:
`PYTHONPATH=$PWD python3 results/runs/flash_gluon_sass.py OUT_DIR [--overwrite] [--with JSON ...]` (an existing
OUT_DIR/flash_gluon_sass.parquet is refused without `--overwrite`, before any work; `--with '{"field": value}'` also
builds each head dim's tuned config with those GluonConfig fields: another commit's knobs, with PYTHONPATH and the
working directory on a checkout of that commit). For each head dim's tuned forward
config (`kernels.attention.dispatch.gluon_fwd_default`, bf16, causal; at d 64 also with each other share of
emulated exp2s, `exp2_emulated`), the kernel is compiled for sm_90 and its
SASS disassembled (Triton's bundled cuobjdump); the steady-state loop is, of the innermost loops with HGMMA in their
body, the one with the most MUFU (the consumer's iteration j: S(j), P(j-1) V(j-1), softmax(j); its body also
holds the diagonal tile's masking, which only diagonal iterations run). One row per (config, opcode): how many
instructions of that opcode the loop body holds, per consumer thread and iteration.
"""

import argparse
import collections
import dataclasses
import json
import re
import sys
from pathlib import Path

import pandas as pd
import torch

from raysys.results import make_row, write_parquet

import kernels.attention.gluon.forward as fg
from kernels.attention.checks import GLUON_HEAD_DIMS
from kernels.attention.dispatch import gluon_fwd_default
from kernels.attention.gluon.compat import HAS_GLUON_HOPPER

SWEEP = "flash_gluon_sass"
EXP2_SHARES = (0, 2, 4, 8, 16)
"""`GluonConfig.exp2_emulated` values built beside the tuned d-64 config's."""


def sass_of(config: fg.GluonConfig, head_dim: int) -> str:
    from tests.kernels.attention.gluon.sm90_builds import sm90_build

    return sm90_build("fwd", config, head_dim, torch.bfloat16, True)[0].sass


def loop_counts(sass: str) -> collections.Counter:
    """Opcodes of the consumer's steady-state loop: of the innermost loops (a backward branch whose range holds no
    other) with HGMMA in their body, the one with the most MUFU (the exp2s)."""
    ins = [(int(a, 16), text.strip()) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    loops = []
    for addr, text in ins:
        target = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1]) if "BRA" in text else None
        if target is not None and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    innermost = [(lo, hi) for lo, hi in loops
                 if not any(lo <= a < b <= hi and (a, b) != (lo, hi) for a, b in loops)]
    best = collections.Counter()
    for lo, hi in innermost:
        ops = collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", t).group(1)
                                  for a, t in ins if lo <= a <= hi)
        if ops["HGMMA"] and ops["MUFU"] > best["MUFU"]:
            best = ops
    if not best:
        raise RuntimeError("no innermost loop with HGMMA and MUFU instructions in the SASS")
    return best


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The arguments, checked before any build (one line and exit 2 on a bad one)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier flash_gluon_sass.parquet")
    p.add_argument("--with", dest="variants", action="append", default=[], metavar="JSON",
                   help='also build each head dim\'s tuned config with these GluonConfig fields, e.g. '
                        '\'{"lazy_rescale": true}\' (repeatable; fields of the checkout whose kernels are imported)')
    args = p.parse_args(argv)
    fields = {f.name for f in dataclasses.fields(fg.GluonConfig)}
    for text in args.variants:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            p.error(f"--with {text!r} is not JSON: {exc}")
        if not isinstance(value, dict) or not set(value) <= fields:
            p.error(f"--with {text!r} must be a JSON object of GluonConfig fields ({', '.join(sorted(fields))})")
    return args


def main(out_dir: str, overwrite: bool, variants: list[dict] = ()) -> None:
    path = Path(out_dir) / f"{SWEEP}.parquet"
    if path.exists() and not overwrite:
        sys.exit(f"flash_gluon_sass.py: {path} exists (an earlier run); pass --overwrite to replace it")
    if not HAS_GLUON_HOPPER:
        sys.exit("flash_gluon_sass.py: needs Triton's Gluon Hopper API (Triton 3.6)")
    rows = []
    tuned = [(head_dim, gluon_fwd_default(head_dim, torch.bfloat16)) for head_dim in GLUON_HEAD_DIMS]
    configs = list(tuned)
    tuned64 = tuned[0][1]  # and the tuned d-64 config with every share of emulated exp2s (section 15)
    configs += [(64, dataclasses.replace(tuned64, exp2_emulated=e)) for e in EXP2_SHARES if e != tuned64.exp2_emulated]
    configs += [(head_dim, dataclasses.replace(config, **fields)) for fields in variants for head_dim, config in tuned]
    for head_dim, config in configs:
        counts = loop_counts(sass_of(config, head_dim))
        print(f"d {head_dim} {config.name}: {sum(counts.values())} instructions; "
              + ", ".join(f"{op} {n}" for op, n in counts.most_common(12)))
        rows += [make_row(SWEEP, {"head_dim": head_dim, "config": config.name, "opcode": op},
                          {"count_per_iteration": float(n)}) for op, n in sorted(counts.items())]
    print(f"wrote {write_parquet(pd.DataFrame(rows), str(path))}")


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    main(args.out_dir, args.overwrite, [json.loads(text) for text in args.variants])
