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
        [--kernels-from b1f88a5]

A patch fits the kernels of the commit it was made at (`results/runs/README.md` names it): `--kernels-from REV` takes
`kernels/` from that commit (`git archive`), else from this checkout; a patch that does not apply stops the script
before any work.

`--patch flash_bwd_owner.patch --variable RAYSYS_BWD_OWNER --levels 0,1 --check --name flash_bwd_owner` times another
build-time choice the same way: which group computes each query tile's dQ (0: the groups alternate, A B A B, the
kernel as it is; 1: A A B B). `--check`: each process also checks its gradients against fp32 attention on an odd
shape (`err_max`, the largest of dQ's, dK's and dV's max error relative to the largest gradient), for a patch whose
levels are all correct.

OUT_DIR/<name>.parquet is refused if it exists (before any work). Needs an sm_90 GPU, Triton 3.6.
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


def check_error() -> float:
    """The largest max error of dQ, dK, dV (relative to the largest gradient) of the launched one-pass config against
    fp32 attention on odd shapes, causal, of both head dims."""
    import torch

    import kernels.flash_attention_gluon as fg
    import kernels.flash_attention_gluon_bwd as fgb
    worst = 0.0
    for q_shape, n_k in (((2, 3, 777, 64), 777), ((1, 3, 1000, 128), 1000), ((1, 2, 1029, 64), 513)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        k_shape = q_shape[:2] + (n_k, q_shape[-1])
        q, k, v = (torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16) for s in (q_shape, k_shape,
                                                                                                 k_shape))
        do = torch.randn(q_shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
        mask = torch.ones(q_shape[2], n_k, dtype=torch.bool, device="cuda").tril()
        scores = (qf @ kf.transpose(-1, -2)) / q_shape[-1] ** 0.5
        (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vf).backward(do.float())
        out, lse = fg.gluon_attention_fwd(q, k, v, True)
        grads = fgb.gluon_attention_bwd(q, k, v, out, lse, do, True, mode="one_pass")
        for g, ref in zip(grads, (qf.grad, kf.grad, vf.grad)):
            worst = max(worst, ((g.float() - ref).abs().max() / ref.abs().max()).item())
    return worst


def child(level: int, check: bool) -> None:
    """Time this process's build at every shape; one JSON line per shape on stdout."""
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import kernels.flash_attention_gluon as fg
    import kernels.flash_attention_gluon_bwd as fgb
    import kernels.flash_attention_gluon_bwd_onepass as fgo
    assert fgo.__file__.startswith(os.environ["ABLATION_KERNELS"]), fgo.__file__
    err = check_error() if check else None
    for shape in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out, lse = fg.gluon_attention_fwd(q, k, v, True)
        config = fgo.problem_config(q)
        ms = triton.testing.do_bench(
            lambda: fgb.gluon_attention_bwd(q, k, v, out, lse, do, True, config=config, mode="one_pass"),
            warmup=50, rep=400)
        row = dict(level=level, shape="x".join(map(str, shape)), config=config.name, median_s=ms * 1e-3,
                   **({"err_max": err} if check else {}))
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
    parser.add_argument("--patch", default="flash_bwd_ablation.patch", help="in results/runs/")
    parser.add_argument("--variable", default="RAYSYS_BWD_ABLATE", help="the patch's build-time level")
    parser.add_argument("--name", default="flash_bwd_ablation", help="the sweep and file name")
    parser.add_argument("--check", action="store_true", help="also check each level's gradients")
    parser.add_argument("--kernels-from", default=None, metavar="REV",
                        help="patch the kernels/ of this commit (default: this checkout's)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child, args.check)
    levels = [int(x) for x in args.levels.split(",")]
    if bad := [x for x in levels if x not in LEVELS]:
        parser.exit(2, f"flash_bwd_ablation.py: --levels {bad} must be among {list(LEVELS)}\n")
    patch = ROOT / "results/runs" / args.patch
    if not patch.is_file():
        parser.exit(2, f"flash_bwd_ablation.py: --patch {args.patch!r} is not a file in results/runs/\n")
    if 0 not in levels or args.rounds < 1 or args.out_dir is None:
        parser.exit(2, "flash_bwd_ablation.py: needs OUT_DIR, level 0 among --levels (the reference) and "
                       "--rounds >= 1\n")
    out = Path(args.out_dir) / f"{args.name}.parquet"
    if out.exists():
        parser.exit(2, f"flash_bwd_ablation.py: {out} exists; choose another OUT_DIR\n")
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        parser.exit(2, "flash_bwd_ablation.py: needs an sm_90 GPU (the Gluon kernels), and this host has none\n")
    sys.path.insert(0, str(ROOT))
    import pandas as pd

    from raysys.results import make_row, write_parquet
    with tempfile.TemporaryDirectory() as tmp:
        if args.kernels_from:
            archive = subprocess.run(["git", "archive", args.kernels_from, "kernels"], cwd=ROOT, capture_output=True)
            if archive.returncode:
                parser.exit(2, f"flash_bwd_ablation.py: --kernels-from {args.kernels_from!r} is not a commit of this "
                               f"repository\n")
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        else:
            shutil.copytree(ROOT / "kernels", Path(tmp) / "kernels")
        applied = subprocess.run(["git", "apply", str(patch)], cwd=tmp, capture_output=True, text=True)
        if applied.returncode:
            parser.exit(2, f"flash_bwd_ablation.py: {args.patch} does not apply to the kernels of "
                           f"{args.kernels_from or 'this checkout'}; pass --kernels-from <the commit it was made "
                           f"at> (results/runs/README.md)\n")
        env = dict(os.environ, PYTHONPATH=f"{tmp}{os.pathsep}{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   ABLATION_KERNELS=str(Path(tmp) / "kernels"))
        found = []
        for rnd in range(args.rounds):
            for level in levels:
                done = subprocess.run([sys.executable, __file__, "--child", str(level), *(["--check"] * args.check)],
                                      env=dict(env, **{args.variable: str(level)}), capture_output=True, text=True)
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
        for key in ("cudnn_bwd_s", "err_max"):
            if key in r:
                metrics[key] = r[key]
        rows.append(make_row(args.name, dict(level=r["level"], shape=r["shape"], config=r["config"],
                                             round=r["round"], patch=args.patch), metrics))
    table = pd.DataFrame(rows)
    write_parquet(table, out)
    print(table.groupby(["shape", "level"]).agg(ms=("median_s", lambda s: 1e3 * statistics.median(s)),
                                                vs_level0=("vs_level0", "median")).to_string())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
