"""Host time per call of two kernel trees, A/B in alternating processes on one host (issue 16).

Run on the GPU host from the repository root (with the wheels' PYTHONPATH of sweeps/gpu_run.sh):

    git archive OLD_COMMIT kernels | (mkdir -p ab_old && tar x -C ab_old)      # here, before the call
    python3 results/runs/flash_host_ab.py run ab_old OUT_DIR OLD_COMMIT [--rounds 3]

Each round runs `flash_host_cost.py --cases CASES` twice, in fresh processes: first with `ab_old/kernels` ahead of
the checkout's on PYTHONPATH (`old`), then with the checkout's own (`new`). The lent hosts' speed moves by up to 2x
between processes (results/flash_hopper_notes.md, section 18), so `unsupported` and `desc x4` (code the two trees
share) and SDPA's cuDNN calls are in CASES as controls. Writes OUT_DIR/{side}_{round}.txt (the printed lines) and
OUT_DIR/flash_host_ab.parquet: `flash_host_cost`'s rows of every run, with its side, round and `kernels_sha`, the
commit of the side's kernels (new: RAYSYS_GIT_SHA, else the checkout's HEAD).

    python3 results/runs/flash_host_ab.py logs DIR OUT.parquet NEW_COMMIT OLD_COMMIT

builds the same Parquet file from the printed lines alone (DIR/{old,new}_{round}.txt, or the `ab_{side}_{round}.txt`
of the c5c21ab call, whose Parquet files did not come back from the GPU host).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd

from flash_host_cost import UNKNOWN, parse  # this folder: the script whose printed lines these are
from raysys.results import make_row

CASES = "op,fwd+bwd auto,unsupported,desc x4,sdpa cudnn,fwd+bwd sdpa cudnn"
NAME = re.compile(r"^(?:ab_)?(?P<side>old|new)_(?P<round>\d+)\.txt$")


def from_logs(folder: Path, new_sha: str, old_sha: str) -> pd.DataFrame:
    """Rows in the results convention from the printed lines alone (the default shape and calls of
    `flash_host_cost.py`); the provenance they do not carry is `unknown`, `git_sha` the harness's commit."""
    rows = []
    for path in sorted(folder.iterdir()):
        m = NAME.match(path.name)
        if m:
            sha = new_sha if m["side"] == "new" else old_sha
            for r in parse(path.read_text()):
                config = dict(case=r.pop("case"), shape="4x32x2048x128", calls=200, side=m["side"],
                              round=int(m["round"]), kernels_sha=sha)
                rows.append(make_row("flash_host_cost", config, r, **{**UNKNOWN, "git_sha": new_sha}))
    if not rows:
        raise SystemExit(f"flash_host_ab.py: no {{old,new}}_N.txt with flash_host_cost lines in {folder}")
    return pd.DataFrame(rows)


def run(old_tree: Path, out: Path, old_sha: str, rounds: int) -> pd.DataFrame:
    here = Path(__file__).resolve().parents[2]
    base = os.environ.get("PYTHONPATH", "")
    new_sha = os.environ.get("RAYSYS_GIT_SHA") or subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip()
    frames = []
    for r in range(1, rounds + 1):
        for side in ("old", "new"):
            path = os.pathsep.join(([str(old_tree.resolve())] if side == "old" else []) + [str(here), base])
            proc = subprocess.run([sys.executable, str(here / "results/runs/flash_host_cost.py"),
                                   str(out / f"{side}_{r}"), "--cases", CASES], cwd=here, capture_output=True,
                                  text=True, env=dict(os.environ, PYTHONPATH=path), timeout=300)
            (out / f"{side}_{r}.txt").write_text(proc.stdout + proc.stderr)
            print(side, r, "rc", proc.returncode, *(f"{x['case']}={x['host_s'] * 1e6:.1f}" for x in parse(proc.stdout)))
            if proc.returncode == 0:  # its own rows, with their provenance, and which side and round they were
                rows = pd.read_parquet(out / f"{side}_{r}" / "flash_host_cost.parquet")
                frames.append(rows.assign(side=side, round=r, kernels_sha=new_sha if side == "new" else old_sha))
    if not frames:
        raise SystemExit("flash_host_ab.py: no run of flash_host_cost.py succeeded (their printed lines are in "
                         f"{out})")
    return pd.concat(frames, ignore_index=True)


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["logs"] and len(args) == 5:
        folder, target = Path(args[1]), Path(args[2])
        if target.exists():
            raise SystemExit(f"flash_host_ab.py: {target} already exists")
        frame = from_logs(folder, args[3], args[4])
    elif args[:1] == ["run"] and len(args) in (4, 6):
        rounds = 3
        if len(args) == 6:
            if args[4] != "--rounds" or not args[5].isdigit() or int(args[5]) < 1:
                raise SystemExit(f"flash_host_ab.py: expected --rounds N (N >= 1), got {' '.join(args[4:])}")
            rounds = int(args[5])
        old_tree, folder = Path(args[1]), Path(args[2])
        if not (old_tree / "kernels" / "flash_attention.py").is_file():
            raise SystemExit(f"flash_host_ab.py: {old_tree}/kernels/flash_attention.py not found (git archive ...)")
        target = folder / "flash_host_ab.parquet"
        if target.exists():
            raise SystemExit(f"flash_host_ab.py: {target} already exists")
        folder.mkdir(parents=True, exist_ok=True)
        frame = run(old_tree, folder, args[3], rounds)
    else:
        raise SystemExit(__doc__)
    frame.to_parquet(target, index=False)
    summary = frame.groupby(["case", "side"]).host_s.median().unstack() * 1e6
    print(summary.round(1).to_string())
    print("wrote", target)


if __name__ == "__main__":
    main()
