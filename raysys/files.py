"""Result files that are never half-written, shared or silently lost.

- `atomic_write(path, data)` writes bytes to `.<name>.<pid>-<host>.<hex>.tmp` beside `path` (created 0666 minus
  the umask, as `open()` would, not mkstemp's 0600), fsyncs it, renames it over `path` (`os.replace`) and fsyncs
  the directory. Readers see the old file or the new one; a writer killed at any moment leaves the old file and
  at most its temp file, which the next writer deletes (`remove_stale_tmp`: its pid is gone). A full disk
  (ENOSPC, EDQUOT, EFBIG) raises `DiskFull`, which says that the previous file is intact.
- `write_text(path, text)` and `save_figure(fig, path)` do the same for markdown and matplotlib figures.
- `FileLock(path)` takes an exclusive `flock` on `.<name>.lock` beside `path` without waiting: a second holder
  (another process, another host on a shared file system) gets `FileBusy`, naming the first (pid, host,
  command). The lock goes with the process (kill -9 included); `release()` removes the lock file.

    lock = FileLock(out / "ddp.parquet")        # FileBusy if another run writes it
    atomic_write(out / "ddp.parquet", data)     # DiskFull if the disk is full; ddp.parquet unchanged
    lock.release()
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import os
import re
import socket
import sys
import uuid
import weakref
from pathlib import Path
from typing import Any

_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:6]
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class ResultsError(ValueError):
    """A results file or directory this run must not or cannot write (exists, busy, of another run, unreadable)."""


class FileBusy(ResultsError):
    """Another writer holds the file's lock."""


class DiskFull(OSError):
    """The disk (or quota) is full: the file was not replaced; its previous version, if any, is intact."""


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{_HOST}.{uuid.uuid4().hex[:8]}.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_tmp(path: Path, *, all_stale: bool = False) -> list[Path]:
    """Delete the temp files of `path` left by writers that died (this host, pid gone), or every one of them
    when `all_stale` (the caller holds the file's lock, so no live writer can own one). Returns what it removed."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(?:(\d+)-([0-9a-f]{{6}})\.[0-9a-f]{{8}}|[^.]+)\.tmp$")
    removed = []
    for tmp in path.parent.glob(f".{glob_escape(path.name)}.*.tmp"):
        m = pattern.match(tmp.name)
        if m is None:
            continue
        pid, host = m.group(1), m.group(2)
        if all_stale or pid is None or (host == _HOST and not _pid_alive(int(pid))):
            try:
                tmp.unlink()
                removed.append(tmp)
            except FileNotFoundError:
                pass
    return removed


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # not every file system lets a directory be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
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
        try:
            tmp.unlink()
        except OSError:
            pass
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
    try:
        os.unlink(lock_path)  # while still holding it: a waiter that opened this inode re-checks and retries
    except OSError:
        pass
    os.close(fd)


class FileLock:
    """An exclusive, non-blocking `flock` on `.<name>.lock` beside `path`; `FileBusy` if another writer has it."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.lock_path = self.path.with_name(f".{self.path.name}.lock")
        for _ in range(20):
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
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

    @property
    def held(self) -> bool:
        return self._release.alive

    def release(self) -> None:
        self._release()
