"""Issue 16: where the one-pass Gluon backward's time goes, by ablation (timing only: the gradients are wrong).

`flash_bwd_ablation.patch` adds a build-time level (`RAYSYS_BWD_ABLATE`) to a copy of this checkout's `kernels/`:
  0  the kernel as it is;
  1  each tile's dQ stored to its shared tile but not reduced into global memory (no TMA reduce-add);
  2  no dQ at all: no wait for the other group's dS^T, no dQ wgmma, no reduction (dS^T still stored);
  3  level 2 without the dS^T store either;
  4  the kernel as it is but P without its exp2 (P = the scaled, shifted score, masked).
Each level runs in a process of its own (the level is a compile-time constant), the levels alternating over the
rounds; each process times the backward the gluon path launches (`fgo.problem_config`) at each shape with
`triton.testing.do_bench`, and level 0's also cuDNN's backward. Rows: `median_s` per (level, shape, round) and
`vs_level0` = level 0's time / this level's in the same round (> 1: the ablated part costs that much).

    PYTHONPATH=$PWD python3 results/runs/flash_bwd_ablation.py OUT_DIR [--rounds 3] [--levels 0,1,2,3,4]

OUT_DIR/flash_bwd_ablation.parquet is refused if it exists (before any work). Needs an sm_90 GPU, Triton 3.6.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(8, 16, 4096, 64), (1, 16, 16384, 128)]
LEVELS = (0, 1, 2, 3, 4)


def child(level: int) -> None:
    """Time this process's build at every shape; one JSON line per shape on stdout."""
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import kernels.flash_attention_gluon as fg
    import kernels.flash_attention_gluon_bwd as fgb
    import kernels.flash_attention_gluon_bwd_onepass as fgo
    assert fgo.__file__.startswith(os.environ["ABLATION_KERNELS"]), fgo.__file__
    for shape in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out, lse = fg.gluon_attention_fwd(q, k, v, True)
        config = fgo.problem_config(q)
        ms = triton.testing.do_bench(
            lambda: fgb.gluon_attention_bwd(q, k, v, out, lse, do, True, config=config, mode="one_pass"),
            warmup=50, rep=400)
        row = dict(level=level, shape="x".join(map(str, shape)), config=config.name, median_s=ms * 1e-3)
        if level == 0:
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            row["cudnn_bwd_s"] = 1e-3 * triton.testing.do_bench(
                lambda: o.backward(do, retain_graph=True), warmup=50, rep=400, grad_to_none=[qg, kg, vg])
        print("ROW " + json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)))
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child)
    levels = [int(x) for x in args.levels.split(",")]
    if bad := [x for x in levels if x not in LEVELS]:
        parser.exit(2, f"flash_bwd_ablation.py: --levels {bad} must be among {list(LEVELS)}\n")
    if 0 not in levels or args.rounds < 1 or args.out_dir is None:
        parser.exit(2, "flash_bwd_ablation.py: needs OUT_DIR, level 0 among --levels (the reference) and "
                       "--rounds >= 1\n")
    out = Path(args.out_dir) / "flash_bwd_ablation.parquet"
    if out.exists():
        parser.exit(2, f"flash_bwd_ablation.py: {out} exists; choose another OUT_DIR\n")
    sys.path.insert(0, str(ROOT))
    import pandas as pd

    from raysys.results import make_row, write_parquet
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(ROOT / "kernels", Path(tmp) / "kernels")
        subprocess.run(["git", "apply", str(ROOT / "results/runs/flash_bwd_ablation.patch")], cwd=tmp, check=True)
        env = dict(os.environ, PYTHONPATH=f"{tmp}{os.pathsep}{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   ABLATION_KERNELS=str(Path(tmp) / "kernels"))
        found = []
        for rnd in range(args.rounds):
            for level in levels:
                done = subprocess.run([sys.executable, __file__, "--child", str(level)],
                                      env=dict(env, RAYSYS_BWD_ABLATE=str(level)), capture_output=True, text=True)
                if done.returncode:
                    print(f"level {level} round {rnd}: FAILED\n{done.stderr[-1500:]}", flush=True)
                    continue
                for line in done.stdout.splitlines():
                    if line.startswith("ROW "):
                        found.append(dict(json.loads(line[4:]), round=rnd))
                        print(line[4:], flush=True)
    df = pd.DataFrame(found)
    ref = df[df.level == 0].set_index(["round", "shape"]).median_s
    rows = []
    for r in found:
        base = ref.get((r["round"], r["shape"]))
        metrics = {"median_s": r["median_s"], "vs_level0": (base / r["median_s"]) if base else float("nan")}
        if "cudnn_bwd_s" in r:
            metrics["cudnn_bwd_s"] = r["cudnn_bwd_s"]
        rows.append(make_row("flash_bwd_ablation", dict(level=r["level"], shape=r["shape"], config=r["config"],
                                                        round=r["round"]), metrics))
    table = pd.DataFrame(rows)
    write_parquet(table, out)
    print(table.groupby(["shape", "level"]).agg(ms=("median_s", lambda s: 1e3 * statistics.median(s)),
                                                vs_level0=("vs_level0", "median")).to_string())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
