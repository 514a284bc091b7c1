"""Print the FlashAttention tables of a results directory: the ones `sweeps/flash_tiles.py` and
`sweeps/flash_bench.py` wrote beside their Parquet files (`flash_tiles.md`, `flash_bench.md`), with the
provenance of their rows (`python -m raysys report DIR --only flash_tiles flash_bench`). The studies draw their
tables once; this prints them (a generic table for a file whose study did not get to write its own).

    python sweeps/flash_summary.py results
"""

from __future__ import annotations

import argparse
import sys


from raysys.results.report import report

STUDIES = ("flash_tiles", "flash_bench")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="directory holding flash_tiles.parquet and/or flash_bench.parquet")
    args = parser.parse_args(argv)
    print(report(args.results, only=list(STUDIES), missing_ok=True))  # either study's file, or both
    return 0


if __name__ == "__main__":
    from raysys.cluster.studies import run_script

    sys.exit(run_script(main))
