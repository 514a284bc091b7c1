"""Sweeps on Ray: run a list of trials on a gang of ranks and record one Parquet row per trial.

    from raysys.cluster.sweep import init_ray, Gang, RankContext, run_sweep

    def trial(ctx: RankContext, config: dict) -> dict:      # module-level; runs on every rank
        return {"step_median_s": 0.12}

    df = run_sweep("ddp", trials=[{"bucket_mb": 1}, {"bucket_mb": 25}], trial_fn=trial, world_size=2)

`run_sweep` keeps one gang (Ray actors, or processes with `launcher="mp"`) for consecutive trials. A trial that
raises (OOM included), loses a rank or exceeds `trial_timeout_s` is a row (`oom|error|timeout`) and the next trial
gets a fresh gang; a gang the cluster cannot hold makes `skipped` rows. Every row is written at once, so an
interrupt (Ctrl-C, SIGTERM) leaves a complete file and `resume=True` runs only what is missing (failed trials too).
`tune_run` does the same for single-process trials scheduled by Ray Tune. Gang mechanics live in `raysys.cluster.gang`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pandas as pd
import ray
from tqdm.auto import tqdm

from raysys.cluster.gang import Gang, check_placement, cluster_info, cluster_nodes, gang_device, gcs_lost, init_ray
from raysys.cluster.mp_gang import ProcessGang, check_local_placement, local_device
from raysys.cluster.rank import PlacementInfeasible, RankContext, check_seconds
from raysys.cluster.signals import interrupt_on_sigterm
from raysys.cluster.studies import (ClusterLost, interrupted_message, read_sweep, resolve_out_dir, summary_table,
                                    sweep_parser, writer_options)
from raysys.cluster.telemetry import SweepProgress
from raysys.results.records import (NOT_RUN, ResultWriter, check_row_keys, check_sweep_name, error_row, make_row,
                                    trial_id)

__all__ = ["Gang", "PlacementInfeasible", "ProcessGang", "RankContext", "check_gang", "cluster_info",
           "cluster_nodes", "gang_columns", "init_ray", "interrupt_on_sigterm", "interrupted_message", "read_sweep",
           "resolve_out_dir", "run_sweep", "sweep_parser", "tune_run", "writer_options"]

LAUNCHERS = ("ray", "mp")
_METRIC_SKIP = {"trial_id", "config", "date", "timestamp", "time_this_iter_s", "time_total_s", "pid", "hostname",
                "node_ip", "time_since_restore", "iterations_since_restore", "checkpoint_dir_name", "done",
                "training_iteration", "experiment_tag"}


def _default_reduce(config: Mapping[str, Any], per_rank: list) -> dict:
    """Rank 0's result (a dict of metrics, or any value as `result`)."""
    return dict(per_rank[0]) if isinstance(per_rank[0], Mapping) else {"result": per_rank[0]}


def trial_labels(trials: Sequence[Mapping[str, Any]], max_chars: int = 120) -> list[str]:
    """Each trial's name in the dashboard (`<sweep>.rank<r>:[i/n] <label>`): its `key=value` pairs, those that
    differ between the trials first, cut at `max_chars` (so the cut falls on what every trial shares)."""
    keys = list(dict.fromkeys(k for t in trials for k in t))
    varying = [k for k in keys if len({repr(t.get(k)) for t in trials}) > 1]
    order = varying + [k for k in keys if k not in varying]
    return [",".join(f"{k}={t[k]}" for k in order if k in t)[:max_chars] or "trial" for t in trials]


def check_gang(world_size: int, *, device: str, launcher: str = "ray", strategy: str = "STRICT_PACK",
               cpus_per_rank: float = 1) -> str:
    """The device a sweep's gang of `world_size` ranks will use (`auto` resolved); raises `PlacementInfeasible`
    (a ValueError) when the cluster (Ray) or this machine (mp) can never hold that gang. A script with one world
    size calls it before its first trial, to fail at once; `run_sweep` instead records the trials of a world size
    that cannot be placed as skipped rows and goes on with the others."""
    resolved = _resolve_device(launcher, device)
    if launcher == "ray":
        check_placement(world_size, device=resolved, strategy=strategy, cpus_per_rank=cpus_per_rank)
    else:
        check_local_placement(world_size, resolved)
    return resolved


def gang_columns(world_size: int, launcher: str, device: str, gpu_visibility: str = "shared") -> dict[str, Any]:
    """The configuration columns `run_sweep` adds to every trial of a gang (`device` resolved: cuda or cpu)."""
    visibility = (gpu_visibility if launcher == "ray" else "shared") if device == "cuda" else "none"
    return {"world_size": world_size, "launcher": launcher, "device": device, "gpu_visibility": visibility}


def run_sweep(sweep: str, trials: Sequence[Mapping[str, Any]], trial_fn: Callable[..., Any], world_size: int,
              out_dir: str | os.PathLike | None = None, *, device: str = "auto", resume: bool = False,
              mode: str | None = None, allow_mixed: bool = False,
              reduce: Callable[[Mapping[str, Any], list], Mapping[str, Any]] | None = None,
              launcher: str = "ray", strategy: str = "STRICT_PACK", gpu_visibility: str = "shared",
              cpus_per_rank: float = 1, timeout_s: float = 600.0, trial_timeout_s: float | None = None,
              env: Mapping[str, str] | None = None, writer: ResultWriter | None = None,
              show: bool = True) -> pd.DataFrame:
    """Run `trial_fn(ctx, config)` on `world_size` ranks for every config of `trials`; one row per trial.

    The row's configuration is the trial's config plus `world_size`, `launcher`, `device` and
    `gpu_visibility` (a config may name them only with the gang's values); its id hashes that configuration. A
    config key or metric that would overwrite a row column (`raysys.results.records.ROW_COLUMNS`) is a ValueError,
    for configs before anything starts. Metrics are
    `reduce(config, per_rank_results)` (default: rank 0's dict). `timeout_s` is the process-group timeout
    and the default per-trial limit (`trial_timeout_s`). `env` is set in every rank's process before its
    process group starts (e.g. NCCL tuning variables); it is not part of the row, so put what identifies it
    in the trials' configs. Pass a shared `writer` when several calls fill one file; otherwise each call opens
    `<out_dir>/<sweep>.parquet` (default: a fresh run directory) with `mode` (`new`, refusing an existing file;
    `resume` (= `resume=True`); `overwrite`) and `allow_mixed`, and closes it at the end. Returns the rows of
    this call's trials; prints them as a table when `show`.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r} must be one of {LAUNCHERS}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size ({world_size!r}) must be an int >= 1")
    check_seconds("timeout_s", timeout_s)
    if trial_timeout_s is not None:
        check_seconds("trial_timeout_s", trial_timeout_s)
    check_sweep_name(sweep)
    trials = list(trials)  # each trial reaches trial_fn and reduce as given (a dict, or a frozen trial mapping)
    for t in trials:
        check_row_keys(t)
        for key, value in (("world_size", world_size), ("launcher", launcher)):
            if key in t and t[key] != value:
                raise ValueError(f"trial config {key}={t[key]!r} contradicts the gang's {key}={value!r}")
    if len({trial_id(t) for t in trials}) != len(trials):
        raise ValueError(f"sweep {sweep!r}: the trials contain duplicate configurations")
    with _open_writer(writer, out_dir, sweep, mode=mode, resume=resume, allow_mixed=allow_mixed) as writer:
        return _run_sweep(sweep, trials, trial_fn, world_size, writer, device=device, reduce=reduce or _default_reduce,
                          launcher=launcher, strategy=strategy, gpu_visibility=gpu_visibility,
                          cpus_per_rank=cpus_per_rank, timeout_s=timeout_s, trial_timeout_s=trial_timeout_s, env=env,
                          show=show)


def _open_writer(writer: ResultWriter | None, out_dir, sweep: str, *, mode: str | None, resume: bool,
                 allow_mixed: bool):
    """`writer` as it is (its owner closes it), else `<out_dir>/<sweep>.parquet` opened for this call alone."""
    if writer is not None:
        return contextlib.nullcontext(writer)
    return ResultWriter(resolve_out_dir(out_dir, sweep), sweep, mode=mode or ("resume" if resume else "new"),
                        allow_mixed=allow_mixed)


def _resolve_device(launcher: str, device: str) -> str:
    """The device type (`cuda` or `cpu`) a gang of `launcher` asking for `device` runs on."""
    if launcher == "ray":
        init_ray()
        return gang_device(device)
    return local_device(device)


def _interrupted(exc: KeyboardInterrupt, sweep: str, done: int, total: int | None, path, lost: str) -> None:
    """Say in one line where the rows are; raise `ClusterLost` when the cluster is `lost` (`gcs_lost`), else note
    the line on the interrupt (`run_script` then adds nothing), which the caller re-raises."""
    message = interrupted_message(sweep, done, total, path, lost)
    print(message, file=sys.stderr, flush=True)
    if lost:  # not the user's interrupt: the cluster's end (raysys.cluster.gang.GcsWatch)
        raise ClusterLost(message) from None
    exc.add_note(message)


def _frame(rows: list[dict], show: bool) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    if show and not df.empty:
        print(summary_table(df))
    return df


def _run_sweep(sweep: str, trials: list[dict], trial_fn: Callable[..., Any], world_size: int, writer: ResultWriter, *,
               device: str, reduce: Callable, launcher: str, strategy: str, gpu_visibility: str, cpus_per_rank: float,
               timeout_s: float, trial_timeout_s: float | None, env: Mapping[str, str] | None,
               show: bool) -> pd.DataFrame:
    resolved = _resolve_device(launcher, device)
    if launcher == "ray":
        make_gang = functools.partial(Gang, world_size, device=resolved, strategy=strategy, name=sweep,
                                      timeout_s=timeout_s, gpu_visibility=gpu_visibility, cpus_per_rank=cpus_per_rank,
                                      env=env)
    else:
        make_gang = functools.partial(ProcessGang, world_size, device=resolved, name=sweep, timeout_s=timeout_s,
                                      env=env)
    fixed = gang_columns(world_size, launcher, resolved, gpu_visibility)
    for t in trials:
        for key in ("device", "gpu_visibility"):
            if key in t and t[key] != fixed[key]:
                raise ValueError(f"trial config {key}={t[key]!r} contradicts the gang's {key}={fixed[key]!r}")
    configs = [{**t, **fixed} for t in trials]

    rows: list[dict] = []
    labels = trial_labels(trials)
    gang, infeasible = None, ""
    nodes = NodeWatch(sweep) if launcher == "ray" else None
    bar = tqdm(total=len(configs), desc=f"{sweep} [{launcher} x{world_size} {resolved}]", unit="trial")
    progress = SweepProgress(sweep, len(configs))  # the dashboard's view of it (raysys.cluster.telemetry)
    try:
        with interrupt_on_sigterm():  # a stopped sweep shuts its gang down and keeps its rows
            for i, (trial, config) in enumerate(zip(trials, configs)):
                tid = trial_id(config)
                if writer.done(tid):
                    rows.extend(r for r in writer.rows if r.get("trial_id") == tid)
                    bar.set_postfix_str("resumed")
                    bar.update()
                    continue
                extra = {"backend": "nccl" if resolved == "cuda" else "gloo"}
                if infeasible:
                    row = make_row(sweep, config, status="skipped", error=infeasible, **extra)
                else:
                    metrics = None
                    try:
                        if gang is None:
                            gang = make_gang().start()
                        per_rank = gang.call(trial_fn, (trial,), label=f"[{i + 1}/{len(configs)}] {labels[i]}",
                                             timeout_s=trial_timeout_s)
                        extra["device_name"] = gang.ranks[0].get("device_name", "")
                        metrics = dict(reduce(trial, per_rank))
                    except PlacementInfeasible as exc:  # this cluster cannot hold it: --resume tries again
                        lost = nodes.check(i, len(configs)) if nodes is not None else ""
                        infeasible = f"{NOT_RUN} {exc}{lost}"
                        row = make_row(sweep, config, status="skipped", error=infeasible, **extra)
                    except Exception as exc:  # the trial's failure is a result; the sweep goes on
                        if nodes is not None and (lost := nodes.check(i, len(configs))):
                            exc.add_note(lost.strip("; "))
                        row = error_row(sweep, config, exc, **extra)
                        if gang is not None and gang.broken:
                            gang.shutdown()
                            gang = None
                    if metrics is not None:  # a metric naming a row column is a bug of the trial: ValueError
                        row = make_row(sweep, config, metrics, **extra)
                writer.write([row])
                rows.append(row)
                progress.update(len(rows), sum(r.get("status") in ("error", "timeout", "oom") for r in rows))
                bar.set_postfix_str(row["status"])
                bar.update()
    except KeyboardInterrupt as exc:
        bar.close()
        _interrupted(exc, sweep, len(rows), len(configs), writer.path, gcs_lost() if launcher == "ray" else "")
        raise
    finally:
        bar.close()
        if gang is not None:
            gang.shutdown()
    return _frame(rows, show)


class NodeWatch:
    """The Ray nodes alive when a sweep started, checked after a trial fails: a node lost since is said once, in
    one line on stderr, and named in the failed trial's row (whose trials `--resume` runs again)."""

    def __init__(self, sweep: str):
        self.sweep = sweep
        self.known = {n.node_id: n for n in cluster_nodes()}
        self.reported: set[str] = set()

    def check(self, index: int, total: int) -> str:
        """'; Ray node <id> (<address>) lost during the sweep' for the nodes gone since the start (or ''), said on
        stderr the first time. Without a GCS (the head is lost, `gcs_lost`) it asks nothing: no answer would come."""
        if gcs_lost():
            return ""
        alive = {n.node_id for n in cluster_nodes()}
        lost = [n for node_id, n in self.known.items() if node_id not in alive]
        if not lost:
            return ""
        names = ", ".join(f"{n.node_id[:12]} ({n.address})" for n in lost)
        if new := [n for n in lost if n.node_id not in self.reported]:
            self.reported |= {n.node_id for n in new}
            tqdm.write(f"{self.sweep}: lost Ray node {names} by trial {index + 1} of {total}; the trials it failed "
                       f"or skipped are rows that --resume runs again", file=sys.stderr)  # above the progress bar
        return f"; Ray node{'s' * (len(lost) > 1)} {names} lost during the sweep"


# ---------------------------------------------------------------------------------------------------- Ray Tune
def expand_grid(param_space: Mapping[str, Any]) -> list[dict] | None:
    """Cartesian product of a param space of constants and `tune.grid_search`; None if it has samplers."""
    axes = []
    for key, value in param_space.items():
        if isinstance(value, Mapping) and set(value) == {"grid_search"}:
            axes.append([(key, v) for v in value["grid_search"]])
        elif hasattr(value, "sample"):  # a tune.choice / tune.uniform / ... sampler
            return None
        else:
            axes.append([(key, value)])
    return [dict(combo) for combo in itertools.product(*axes)]


def _trial_config(config: Mapping[str, Any] | None) -> dict:
    config = dict(config or {})
    return dict(config.get("_raysys_config", config))


def _trial_exception(trial) -> BaseException:
    """The exception a Tune trial failed with, read from the trial's local error files (the synced copy that
    `Trial.get_pickled_error()` reads does not exist yet inside `on_trial_error`)."""
    try:
        pickled, text = trial.pickled_error_file, trial.error_file
    except Exception:  # Tune internals moved: still a row, with what we know
        pickled = text = None
    if pickled and os.path.exists(pickled):
        with contextlib.suppress(Exception), open(pickled, "rb") as f:  # unpicklable here: fall back to the text
            return ray.cloudpickle.load(f)
    if text and os.path.exists(text):
        return RuntimeError(Path(text).read_text().strip()[-2000:])
    return RuntimeError(f"Tune trial {trial} failed without an error file")


def _row_callback(sweep: str, writer: ResultWriter, rows: list[dict], bar):
    """A `tune.Callback` that writes each trial's row the moment the trial completes or errors."""
    from ray import tune

    class _WriteRows(tune.Callback):
        """One row per finished trial, through `writer` (an atomic rewrite of the Parquet file), so a run
        that is stopped (time budget, SIGTERM, Ctrl-C) keeps every trial that ended before it. Tune calls
        `on_trial_complete` only for a trial that ran to its end, never for one it stops itself."""

        # Tune pickles its run config: this class by value (so its methods close over nothing) and this
        # instance through __getstate__ (so the writer and the bar stay in the driver).
        def __init__(self, sweep: str, writer: ResultWriter, rows: list[dict], bar):
            self.sweep, self.writer, self.rows, self.bar = sweep, writer, rows, bar

        def __getstate__(self):
            return {}

        def _write(self, row: dict) -> None:
            self.writer.write([row])
            self.rows.append(row)
            self.bar.set_postfix_str(row["status"])
            self.bar.update()

        def on_trial_complete(self, iteration, trials, trial, **info):
            metrics = {k: v for k, v in (trial.last_result or {}).items() if k not in _METRIC_SKIP}
            self._write(make_row(self.sweep, _trial_config(trial.config), metrics))

        def on_trial_error(self, iteration, trials, trial, **info):
            self._write(error_row(self.sweep, _trial_config(trial.config), _trial_exception(trial)))

    return _WriteRows(sweep, writer, rows, bar)


@contextlib.contextmanager
def _tune_sigint_as_interrupt():
    """Ray Tune turns Ctrl-C into a graceful stop that returns normally (for its own experiment restore);
    here the Parquet file is the state, so Ctrl-C raises KeyboardInterrupt like SIGTERM does."""
    key = "TUNE_DISABLE_SIGINT_HANDLER"
    old = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def tune_run(trainable: Callable[[dict], Any], param_space: Mapping[str, Any], *, sweep: str,
             out_dir: str | os.PathLike | None = None, resources: Mapping[str, float] | None = None,
             num_samples: int = 1, max_concurrent_trials: int | None = None, max_trials: int | None = None,
             time_budget_s: float | None = None, resume: bool = False, mode: str | None = None,
             allow_mixed: bool = False, writer: ResultWriter | None = None, show: bool = True,
             reuse_actors: bool = False) -> pd.DataFrame:
    """Run `trainable(config)` for every config of `param_space` with Ray Tune; one Parquet row per trial.

    The trainable reports its metrics with `ray.tune.report({...})` (the last report is the row) or returns a dict.
    `resources` per trial: `{"gpu": 1}` (plus one CPU) or `{"cpu": n}` (default: one CPU). A trial that raises is a
    row with status `oom|error|timeout`, written when the trial ends. A grid (constants and `tune.grid_search`) is
    expanded here, so `resume=True` skips the trials already in `<out_dir>/<sweep>.parquet` and `max_trials` runs
    the first that many of the rest; sampled spaces go to Tune as they are (`num_samples` times, no resume, no
    `max_trials`). `time_budget_s` stops the run: trials still running leave no row, so `resume=True` runs them next
    time. `out_dir`, `mode`, `allow_mixed` or `writer` as in `run_sweep`; grid configs naming a row column are
    refused first. `reuse_actors=True`: Tune's `reuse_actors` (a trial's leftovers stay in the process). SIGTERM and
    Ctrl-C shut Ray down (stopping the trials) and propagate as KeyboardInterrupt; the rows written stay. Returns
    this call's rows.
    """
    resources = {"cpu": 1, **{k.lower(): v for k, v in (resources or {}).items()}}
    if not set(resources) <= {"cpu", "gpu"}:
        raise ValueError(f"resources {dict(resources)} may only name 'cpu' and 'gpu'")
    if max_trials is not None and (not isinstance(max_trials, int) or max_trials < 0):
        raise ValueError(f"max_trials ({max_trials!r}) must be an int >= 0")
    if time_budget_s is not None and not time_budget_s > 0:
        raise ValueError(f"time_budget_s ({time_budget_s!r}) must be > 0")
    grid = expand_grid(param_space)
    if grid is None and (resume or max_trials is not None):
        raise ValueError(f"{'resume=True' if resume else 'max_trials'} needs a grid param_space (constants and "
                         f"tune.grid_search), not samplers")
    if grid is not None and num_samples != 1:
        raise ValueError(f"num_samples ({num_samples}) applies to sampled param spaces; a grid runs each config once")
    check_sweep_name(sweep)
    for config in grid or [{k: v for k, v in param_space.items()}]:
        check_row_keys(config)
    with _open_writer(writer, out_dir, sweep, mode=mode, resume=resume, allow_mixed=allow_mixed) as writer:
        return _tune_run(trainable, param_space, grid, sweep=sweep, writer=writer, resources=resources,
                         num_samples=num_samples, max_concurrent_trials=max_concurrent_trials, max_trials=max_trials,
                         time_budget_s=time_budget_s, show=show, reuse_actors=reuse_actors)


def _tune_run(trainable: Callable[[dict], Any], param_space: Mapping[str, Any], grid: list[dict] | None, *,
              sweep: str, writer: ResultWriter, resources: Mapping[str, float], num_samples: int,
              max_concurrent_trials: int | None, max_trials: int | None, time_budget_s: float | None, show: bool,
              reuse_actors: bool) -> pd.DataFrame:
    from ray import tune

    init_ray()
    todo = None if grid is None else [c for c in grid if not writer.done(trial_id(c))]
    if todo is not None and max_trials is not None:
        todo = todo[:max_trials]
    rows: list[dict] = []
    if todo is None or todo:
        space = {"_raysys_config": tune.grid_search(todo)} if todo is not None else dict(param_space)

        def run_trial(cfg: dict) -> None:
            out = trainable(cfg["_raysys_config"] if "_raysys_config" in cfg else cfg)
            if isinstance(out, Mapping):
                tune.report(dict(out))

        bar = tqdm(total=len(todo) if todo is not None else None, desc=f"{sweep} [tune]", unit="trial")
        with tempfile.TemporaryDirectory(prefix=f"tune_{sweep}_") as storage:
            tuner = tune.Tuner(
                tune.with_resources(run_trial, {k: float(v) for k, v in resources.items()}),
                param_space=space,
                tune_config=tune.TuneConfig(num_samples=num_samples, max_concurrent_trials=max_concurrent_trials,
                                            time_budget_s=time_budget_s, reuse_actors=reuse_actors),
                run_config=tune.RunConfig(name=sweep, storage_path=storage, verbose=0,
                                          callbacks=[_row_callback(sweep, writer, rows, bar)]),
            )
            try:
                with interrupt_on_sigterm(), _tune_sigint_as_interrupt():
                    results = tuner.fit()
            except KeyboardInterrupt as exc:
                bar.close()
                _interrupted(exc, sweep, len(rows), len(todo) if todo is not None else None, writer.path, gcs_lost())
                ray.shutdown()  # this driver's Tune trials die with it
                raise
            finally:
                bar.close()
        written = {r["trial_id"] for r in rows}
        for result in results:  # a failure Tune reported without calling on_trial_error (should not happen)
            config = _trial_config(result.config)
            if result.error is not None and config and trial_id(config) not in written:
                exc = result.error if isinstance(result.error, BaseException) else RuntimeError(str(result.error))
                row = error_row(sweep, config, exc)
                writer.write([row])
                rows.append(row)
        if todo is not None and len(rows) < len(todo):
            print(f"{sweep}: {len(todo) - len(rows)} of {len(todo)} trials did not finish"
                  + (f" within the time budget ({time_budget_s:g} s)" if time_budget_s else "")
                  + "; rerun with resume to run them", file=sys.stderr, flush=True)
    return _frame(rows, show)
