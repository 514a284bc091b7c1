"""Builds of the Gluon kernels for sm_90 without a GPU, from their launchers' own arguments (the compile tests).

    built = sm90_build("fwd", config, head_dim, dtype, causal)              # [Built] on the installed Triton
    built = sm90_build("bwd", config, head_dim, dtype, causal, triton="3.6")   # on another release

A recipe (`fwd`, `bwd`: the one-pass backward) builds its launcher's
arguments for a (1, 3, 1000, d) query and a (1, 3, 777, d) key and compiles each kernel for sm_90 with that Triton's
own ptxas. It runs in this process when this is the installed Triton outside the interpreter; else in a worker
process (one per Triton, started once, fed pickled requests) with TRITON_INTERPRET=0 (the interpreter replaces the
language's jit helpers, so no build passes under it) and, for another release, its folder first on the path.
`extra_tritons()` reads the releases to build under besides the installed one from RAYSYS_EXTRA_TRITONS
(`3.6=/path/to/site-dir`, comma-separated; `.ci/run` installs the GPU host's 3.6 there).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import pickle
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
EXTRA_TRITONS_ENV = "RAYSYS_EXTRA_TRITONS"


@dataclasses.dataclass
class Built:
    """What a test reads of one compiled kernel."""

    ptx: str
    cubin: bytes
    shared: int
    """Shared memory bytes the kernel asks for."""
    tools: str
    """The folder of the Triton's own ptxas and cuobjdump (what built it)."""
    ptxas: str
    """That ptxas's file name (Triton 3.6 and later build sm_90 with `ptxas-blackwell`)."""

    @functools.cached_property
    def ptxas_log(self) -> str:
        """`ptxas -v` of the PTX: registers, spills and C75xx notes."""
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "k.ptx").write_text(self.ptx)
            done = subprocess.run([str(Path(self.tools, self.ptxas)), "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o",
                                   f"{tmp}/k.cubin"], capture_output=True, text=True, check=True)
        return done.stdout + done.stderr

    @functools.cached_property
    def sass(self) -> str:
        """`cuobjdump -sass` of the cubin."""
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "k.cubin").write_bytes(self.cubin)
            return subprocess.run([str(Path(self.tools, "cuobjdump")), "-sass", f"{tmp}/k.cubin"], capture_output=True,
                                  text=True, check=True).stdout


def extra_tritons() -> dict[str, str]:
    """Release label -> folder holding that Triton, from RAYSYS_EXTRA_TRITONS."""
    out = {}
    for item in filter(None, (part.strip() for part in os.environ.get(EXTRA_TRITONS_ENV, "").split(","))):
        label, sep, folder = item.partition("=")
        if not sep or not Path(folder, "triton").is_dir():
            raise ValueError(f"{EXTRA_TRITONS_ENV} entry {item!r} must be LABEL=FOLDER with FOLDER/triton in it")
        out[label] = folder
    return out


# ------------------------------------------------------------------------------------------------------------
# Recipes (run in whichever process builds).

def _tensors(head_dim, dtype):
    import torch

    q = torch.zeros((1, 3, 1000, head_dim), dtype=dtype)
    k = torch.zeros((1, 3, 777, head_dim), dtype=dtype)
    return q, k, torch.zeros(1, 3, 1000)


def _fwd(config, head_dim, dtype, causal):
    import kernels.attention.gluon.forward as fg

    q, k, lse = _tensors(head_dim, dtype)
    _, args, meta = fg.launch_args(q, k, k, q.clone(), lse, causal, config)
    return [(config.kernel, args, meta)]


def _bwd(config, head_dim, dtype, causal):
    import torch

    import kernels.attention.gluon.backward as fgo

    q, k, lse = _tensors(head_dim, dtype)
    _, args, meta = fgo.bwd_launch_args(q, k, k, q, k, k, lse, lse, torch.zeros(q.shape), causal, config)
    return [(config.kernel, args, meta)]


RECIPES = {"fwd": _fwd, "bwd": _bwd}


def _compile(kernel, args: tuple, meta: dict) -> Built:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    meta = dict(meta)
    options = {name: meta.pop(name) for name in ("num_warps", "maxnreg")}
    signature = {p.name: mangle_type(a) for p, a in zip(kernel.params, args)}
    signature.update({name: "constexpr" for name in meta})
    source = GluonASTSource(fn=kernel, signature=signature, constexprs=dict(meta))
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptxas = Path(get_ptxas(90).path)
    return Built(compiled.asm["ptx"], compiled.asm["cubin"], compiled.metadata.shared, str(ptxas.parent), ptxas.name)


def _run(recipe: str, args: tuple) -> list[Built]:
    return [_compile(*launch) for launch in RECIPES[recipe](*args)]


# ------------------------------------------------------------------------------------------------------------
# Worker processes.

def _send(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream):
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the build worker closed its pipe")
    return pickle.loads(stream.read(struct.unpack("<Q", head)[0]))


class _Worker:
    def __init__(self, folder: str | None):
        path = [p for p in (folder, str(REPO), os.environ.get("PYTHONPATH")) if p]
        env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(path)}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.kernels.attention.gluon.sm90_builds"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=REPO)
        atexit.register(self.close)

    def build(self, recipe: str, args: tuple) -> list[Built]:
        _send(self.proc.stdin, (recipe, args))
        ok, value = _receive(self.proc.stdout)
        if not ok:
            raise RuntimeError(f"the sm_90 build of {recipe}{args} failed in the worker:\n{value}")
        return value

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_WORKERS: dict[str | None, _Worker] = {}


def sm90_build(recipe: str, *args, triton: str | None = None) -> list[Built]:
    """Compile `recipe`'s kernels for sm_90 on the installed Triton (`triton` None) or on the release `triton` names
    in `extra_tritons()`."""
    folder = None if triton is None else extra_tritons()[triton]
    if folder is None and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return _run(recipe, args)
    if folder not in _WORKERS:
        _WORKERS[folder] = _Worker(folder)
    return _WORKERS[folder].build(recipe, args)


def _serve() -> None:
    """The worker: requests (recipe, args) on stdin, (ok, [Built] or the traceback) on the original stdout; anything
    the builds print goes to stderr."""
    import traceback

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    while True:
        try:
            recipe, args = _receive(sys.stdin.buffer)
        except EOFError:
            return
        try:
            _send(out, (True, _run(recipe, args)))
        except Exception:  # noqa: BLE001 - the test reports it
            _send(out, (False, traceback.format_exc()))


if __name__ == "__main__":  # the worker pickles Built under the module's importable name
    from tests.kernels.attention.gluon.sm90_builds import _serve as serve

    serve()
