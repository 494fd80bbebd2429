"""The one way ggufkit writes files: temporary files beside the targets, fsync, rename over the targets.

A crash, an exception or SIGTERM/SIGHUP leaves every target untouched and removes the temporary files.
SIGKILL cannot be caught; the temporary file it leaves is named after its target and its process id,
and the next write to that target removes it once that process is gone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from ggufkit.errors import OutputExistsError

_T = TypeVar("_T")

_SUFFIX = ".ggufkit-part"


def _temp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.{os.getpid()}{_SUFFIX}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Delete temporary files left for ``target`` by writers that no longer run. Returns what was removed."""
    removed: list[Path] = []
    prefix = f".{target.name}."
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(_SUFFIX)):
            continue
        pid_text = name[len(prefix):-len(_SUFFIX)]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            with contextlib.suppress(OSError):
                entry.unlink()
                removed.append(entry)
    return removed


class _Terminated(BaseException):
    """Raised inside a write when SIGTERM/SIGHUP arrives, so the temporary files are cleaned up."""


@contextlib.contextmanager
def _terminate_as_exception() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise _Terminated(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    except _Terminated as exc:
        signum = exc.args[0]
        for s, h in previous.items():
            signal.signal(s, h)
        previous = {}
        os.kill(os.getpid(), signum)  # re-deliver with the original disposition
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class EarlyWriteback:
    """While a large file is written, start writing its dirty pages to disk in the background.

    Every ``every`` bytes an ``fdatasync`` runs in a helper thread (one at a time), so the kernel writes the
    file out while more is produced and :func:`atomic_write`'s final fsync waits only for the tail: for a
    0.7 GB file here, 0.05 s instead of 0.4 s. Only timing changes; the bytes and the final fsync do not.
    """

    def __init__(self, f: BinaryIO, every: int = 64 << 20) -> None:
        self._f = f
        self._every = every
        self._pending = 0
        self._thread: threading.Thread | None = None

    def __enter__(self) -> EarlyWriteback:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._thread.join()

    def wrote(self, nbytes: int) -> None:
        self._pending += nbytes
        if self._pending < self._every or (self._thread is not None and self._thread.is_alive()):
            return
        self._f.flush()
        self._pending = 0
        self._thread = threading.Thread(target=self._sync, args=(self._f.fileno(),), daemon=True)
        self._thread.start()

    @staticmethod
    def _sync(fd: int) -> None:
        with contextlib.suppress(OSError):  # the final fsync reports real errors
            getattr(os, "fdatasync", os.fsync)(fd)


def _check_target(target: Path) -> None:
    """Refuse, naming the user's path, a target that is a folder or lies in a folder that does not exist
    (the temporary file's name would otherwise appear in the error)."""
    if target.is_dir():
        raise OutputExistsError(f"{target} is a folder; name a file to write (or a path ending in /)")
    parent = target.parent
    if not parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "folder does not exist (create it first)", str(parent))


def _open_exclusive(path: Path) -> BinaryIO:
    return open(path, "xb")  # closed by atomic_write


def _as_target_error(target: Path, func: Callable[..., _T], *args: Any) -> _T:
    """``func(*args)`` with an OSError on the temporary file reported on ``target``, the path the user named."""
    try:
        return func(*args)
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror or str(exc), str(target)) from None


@contextlib.contextmanager
def atomic_write(*targets: Path) -> Iterator[list[BinaryIO]]:
    """Open one temporary file per target; on success rename them all over their targets.

    Args:
        targets: the final paths (their directories must exist).

    Yields:
        Binary file objects, one per target, in order.

    Example:
        >>> with atomic_write(Path("out.gguf")) as (f,):   # doctest: +SKIP
        ...     f.write(b"GGUF...")
    """
    paths = [Path(t) for t in targets]
    for p in paths:
        _check_target(p)
        remove_stale_temporaries(p)
    temps = [_temp_name(p) for p in paths]
    files: list[BinaryIO] = []
    committed = False
    with _terminate_as_exception():
        try:
            for t, p in zip(temps, paths):
                files.append(_as_target_error(p, _open_exclusive, t))
            yield files
            for f in files:
                f.flush()
                os.fsync(f.fileno())
                f.close()
            for t, p in zip(temps, paths):
                _as_target_error(p, os.replace, t, p)
            committed = True
            for d in {p.parent for p in paths}:
                _fsync_dir(d)
        finally:
            if not committed:
                for f in files:
                    with contextlib.suppress(OSError):
                        f.close()
                for t in temps:
                    with contextlib.suppress(OSError):
                        t.unlink()
