"""Result files that are never half-written, shared or silently lost.

`atomic_write(path, data)` writes a temp file beside `path` (0666 minus the umask), fsyncs it, renames it over
`path` and fsyncs the directory: readers see the old file or the new one; a killed writer leaves at most its temp
file, which the next writer removes (`remove_stale_tmp`: only names this module made, on this host, of dead pids);
a full disk raises `DiskFull` and keeps the old file. `write_text`, `save_figure` and `write_parquet` do the same
for markdown, figures and Parquet; `trial_id(config)` is the stable id that names a trial's rows. `FileLock(path)`
takes an exclusive non-waiting `flock` (no symbolic links followed): a second holder gets `FileBusy` naming the first.

    lock = FileLock(out / "ddp.parquet")        # FileBusy if another run writes it
    atomic_write(out / "ddp.parquet", data)     # DiskFull if the disk is full; ddp.parquet unchanged
    lock.release()
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import re
import socket
import stat
import sys
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import pandas as pd

_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:6]
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class ResultsError(ValueError):
    """A results file or directory this run must not or cannot write (exists, busy, of another run, unreadable)."""


class FileBusy(ResultsError):
    """Another writer holds the file's lock."""


class DiskFull(OSError):
    """The disk (or quota) is full: the file was not replaced; its previous version, if any, is intact."""


def _token(name: str, pid: int, nonce: str) -> str:
    """A temp name's token: a random nonce and a check over (file name, pid, host, nonce). Only a name this module
    made carries a matching check, so cleanup never takes a user's `.<name>.<something>.tmp` for a writer's."""
    return nonce + hashlib.sha1(f"{name}\0{pid}\0{_HOST}\0{nonce}".encode()).hexdigest()[:8]


def _tmp_name(path: Path, pid: int | None = None) -> Path:
    pid = os.getpid() if pid is None else pid
    return path.with_name(f".{path.name}.raysys-{pid}-{_HOST}-{_token(path.name, pid, uuid.uuid4().hex[:8])}.tmp")


def _tmp_owner(path: Path, tmp: Path) -> int | None:
    """The pid of the writer on this host that made `tmp` as a temp file of `path`, or None if `tmp` is not one."""
    pattern = rf"\.{re.escape(path.name)}\.raysys-(\d{{1,10}})-{_HOST}-([0-9a-f]{{8}})([0-9a-f]{{8}})\.tmp"
    m = re.fullmatch(pattern, tmp.name)
    if m is None or _token(path.name, int(m[1]), m[2]) != m[2] + m[3]:
        return None
    return int(m[1])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or beyond any pid the OS hands out
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_tmp(path: Path) -> list[Path]:
    """Delete the temp files of `path` that writers on this host made (their name says so, `_tmp_owner`) and left
    when they died (their pid is gone). Nothing else is touched: a live writer's temp file, another host's, or any
    other file whose name merely looks like one. Returns what it removed."""
    removed = []
    for tmp in path.parent.glob(f".{glob_escape(path.name)}.raysys-*.tmp"):
        pid = _tmp_owner(path, tmp)
        if pid is None or _pid_alive(pid) or tmp.is_symlink() or not tmp.is_file():
            continue
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
            removed.append(tmp)
    return removed


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened or synced
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes) -> Path:
    """Replace `path` by `data` atomically and durably (see the module docstring)."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            state = (f"the previous {path.name} is intact" if path.exists() else f"{path.name} was not written")
            full = DiskFull(f"no space left writing {path} ({os.strerror(exc.errno)}); {state}")
            full.errno = exc.errno
            raise full from exc
        raise
    _fsync_dir(path.parent)
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write` of UTF-8 text (a sweep's markdown report)."""
    return atomic_write(path, text.encode())


def save_figure(fig: Any, path: str | os.PathLike, **savefig_kwargs: Any) -> Path:
    """`fig.savefig` rendered in memory, then `atomic_write`: a full disk never truncates the old picture."""
    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format=savefig_kwargs.pop("format", path.suffix.lstrip(".") or "png"), **savefig_kwargs)
    remove_stale_tmp(path)
    return atomic_write(path, buf.getvalue())


def _unlock(fd: int, lock_path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(lock_path)  # while still holding it: a waiter that opened this inode re-checks and retries
    os.close(fd)


def _open_lock_file(lock_path: Path) -> int:
    """`lock_path` opened for reading and writing, created if missing; never through a symbolic link (whose target
    the lock text would overwrite) and only a plain file (`ResultsError` in one line otherwise)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ResultsError(f"lock file {lock_path} is a symbolic link; remove it (a lock file must be a plain "
                               f"file)") from None
        raise ResultsError(f"cannot open lock file {lock_path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ResultsError(f"lock file {lock_path} is not a plain file; remove it")
    return fd


class FileLock:
    """An exclusive, non-blocking `flock` on `.<name>.lock` beside `path`; `FileBusy` if another writer has it."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.lock_path = self.path.with_name(f".{self.path.name}.lock")
        for _ in range(20):
            fd = _open_lock_file(self.lock_path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                os.close(fd)
                raise FileBusy(f"{self.path} is being written by another run ({holder or 'unknown process'}); "
                               f"wait for it to finish or choose another --out") from None
            try:  # the previous holder may have removed the file between our open and our flock
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise FileBusy(f"{self.path}: could not take its lock {self.lock_path} (it keeps being replaced)")
        os.ftruncate(fd, 0)
        command = " ".join(sys.argv)[:300] or sys.executable
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}: {command}\n".encode(), 0)
        self._release = weakref.finalize(self, _unlock, fd, str(self.lock_path))

    def release(self) -> None:
        self._release()


def trial_id(config: Mapping[str, Any]) -> str:
    """Stable 12-hex-digit id of a trial's configuration (key order does not matter)."""
    blob = json.dumps({k: config[k] for k in sorted(config)}, default=str, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def write_parquet(df: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write `df` to `path` atomically (`atomic_write`): a reader that opens it once (`read_results`) sees the old
    file or the new one, a full disk raises `DiskFull` and leaves the old one. The caller owns `path` (a
    `ResultWriter` holds its lock)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, df.to_parquet(index=False))
