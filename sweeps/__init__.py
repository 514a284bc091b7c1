"""One script per study (`python sweeps/<study>.py`, which `ray job submit` runs); `sweeps/common.py` holds what
they share.

`PLOTS` names, per result file stem, the function of its study that draws it and what it takes (the PNG path of
`(df, path) -> path | None`, or the directory of `(df, out_dir) -> [paths]`): what
`python -m raysys report DIR --plots OUT` calls, importing the study only then.
"""

PLOTS = {
    "allreduce": ("sweeps.allreduce", "plot", "png"), "allreduce_scan": ("sweeps.allreduce", "plot", "png"),
    "ddp": ("sweeps.ddp", "plot", "png"), "ddp_compiled": ("sweeps.ddp", "plot", "png"),
    "sharded_optimizer": ("sweeps.sharded_optimizer", "plot", "png"),
    "checkpointing": ("sweeps.checkpointing", "plot", "dir"),
    "e2e_timing": ("sweeps.end_to_end", "plot_timing", "dir"),
}
