"""One script per study (`python sweeps/<study>.py`, which `ray job submit` runs); `sweeps/common.py` holds what
they share.

`PLOTS` names, per result file stem, the function of its study that draws it and what it takes: "png", the PNG
path `OUT/<stem>.png` of `(df, path) -> path | None`; "dir", the directory OUT of `(df, out_dir) -> [paths]`;
"plots", the directory `OUT/plots` of the same. What `python -m raysys report DIR --plots OUT` calls, importing the
study only then, so the plots land where each study's `--report-only --out OUT` puts them.
"""

PLOTS = {
    "allreduce": ("sweeps.allreduce", "plot", "png"), "allreduce_scan": ("sweeps.allreduce", "plot", "png"),
    "ddp": ("sweeps.ddp", "plot", "png"), "ddp_compiled": ("sweeps.ddp", "plot", "png"),
    "sharded_optimizer": ("sweeps.sharded_optimizer", "plot", "png"),
    "checkpointing": ("sweeps.checkpointing", "plot", "dir"),
    "e2e_timing": ("sweeps.end_to_end", "plot_timing", "plots"),
}
