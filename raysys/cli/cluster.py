"""The `submit`, `doctor` and `metrics` commands' flags (their runs are `raysys.cluster.submit`'s)."""

from __future__ import annotations

import argparse

from raysys.cluster.submit import DEFAULT_ADDRESS, HEAD_PORTS, head_command_ports


def build_submit_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--address", default=None, help=f"dashboard URL (default: $RAY_API_SERVER_ADDRESS, an http "
                                                   f"$RAY_ADDRESS, else {DEFAULT_ADDRESS})")
    p.add_argument("--name", default=None, help="job name shown in the dashboard (default: the script's stem)")
    p.add_argument("--working-dir", default=".", help="directory uploaded as the job's working directory "
                                                       "(default: .)")
    p.add_argument("--runs-dir", default="runs", help="where results go when the command names no --out "
                                                      "(default: ./runs, made absolute; a path on the head node)")
    p.add_argument("--no-wait", action="store_true", help="return after submitting instead of following the logs")
    p.add_argument("entrypoint", nargs=argparse.REMAINDER, help="the command after `--`, e.g. -- python "
                                                                "sweeps/ddp.py --device cpu")
    return p


def build_doctor_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    recipe = head_command_ports()
    for what, (port, flag) in HEAD_PORTS.items():
        default = recipe[flag]
        said = "any free port" if default == 0 else str(default)
        p.add_argument(flag, type=int, default=default, dest=flag.lstrip("-").replace("-", "_"),
                       help=f"{what} port the head will use (default: {said}, as the README's head command"
                            + (f"; Ray's own default is {port})" if default != port else ")"))
    return p


def build_metrics_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--temp-dir", default="/tmp/ray", help="the head's `ray start --temp-dir` (default: /tmp/ray)")
    p.add_argument("--timeout-s", type=float, default=3.0, help="seconds to wait for each answer (default: 3)")
    return p
