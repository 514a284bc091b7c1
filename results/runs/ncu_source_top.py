"""The SASS instructions with the most warp-stall samples in an `ncu --page source --csv --print-source sass`
export (issue 16): where in a kernel its warps wait, and on what.

Run on the GPU host from the repository root, e.g. for the one-pass Gluon backward at 1x16x16384x128:

    ncu --clock-control none -k regex:_gluon_attn_bwd_kernel --launch-skip 1 --launch-count 1 \
        --section SourceCounters --section WarpStateStats --import-source yes -o $R/bwd \
        python3 results/runs/ncu_gluon_bwd.py
    ncu -i $R/bwd.ncu-rep --page source --csv --print-source sass > $R/bwd_sass.csv
    python3 results/runs/ncu_source_top.py $R/bwd_sass.csv [N]

Prints the N (default 40) instructions with the most samples, each with its share of all samples and its three
largest stall reasons, then the samples summed per opcode.
"""

import csv
import sys
from collections import Counter


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: ncu_source_top.py SASS_CSV [N]")
    if len(sys.argv) > 2 and not (sys.argv[2].isdigit() and int(sys.argv[2]) > 0):
        raise SystemExit(f"N {sys.argv[2]!r} must be a positive integer")
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    try:
        f = open(sys.argv[1], newline="")
    except OSError as e:
        raise SystemExit(f"ncu_source_top.py: cannot read {sys.argv[1]!r} ({e.strerror})") from None
    with f:
        lines = [line for line in f if not line.startswith(("==", '"Kernel Name"'))]
    rows = list(csv.DictReader(lines))
    if not rows:
        raise SystemExit(f"{sys.argv[1]}: no rows (ncu wrote no source page?)")
    columns = list(rows[0])
    samples = next((c for c in columns if "Sampling (All" in c), None)
    if samples is None:
        raise SystemExit(f"{sys.argv[1]}: no 'Warp Stall Sampling (All Samples)' column; columns: {columns}")
    source = next((c for c in columns if c.strip().lower() == "source"), columns[1])
    address = next((c for c in columns if "address" in c.lower()), columns[0])
    reasons = [c for c in columns if c.lower().startswith("stall") or "stall_" in c.lower()]
    total = sum(number(r[samples]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} samples; columns for reasons: {len(reasons)}")
    for r in sorted(rows, key=lambda r: -number(r[samples]))[:top]:
        why = sorted(((number(r[c]), c) for c in reasons), reverse=True)[:3]
        why_text = ", ".join(f"{c.split('(')[0].strip()} {v:.0f}" for v, c in why if v)
        print(f"{r[address]:>8} {number(r[samples]) / total:6.2%}  {r[source].strip()[:70]:70}  {why_text}")
    per_op = Counter()
    for r in rows:
        tokens = [t for t in r[source].split() if not t.startswith("@")]
        op = tokens[0].split(".")[0] if tokens else "?"
        per_op[op] += number(r[samples])
    print("samples per opcode:", ", ".join(f"{op} {v / total:.1%}" for op, v in per_op.most_common(15)))


if __name__ == "__main__":
    main()
