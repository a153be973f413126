"""One safe way to write an output file.

Every file the package writes (plans, instances, exports, bench rows, tables,
figures) goes through :func:`atomic_write` or :func:`atomic_open`:

- the target is checked first: if it exists it must be a regular file (not a
  device, FIFO, directory or symlink), and it must not be one of the files the
  command is reading (``inputs``); otherwise :class:`UnsafeTargetError`;
- the data goes to a fresh temporary file in the target's folder, created with
  ``O_EXCL | O_NOFOLLOW`` under a random name (a planted file or symlink is
  never followed), flushed and fsynced, then renamed over the target;
- an existing target keeps its permission bits; a new one gets the umask's;
- the temporary file is removed on every exit path (exceptions,
  ``KeyboardInterrupt``, ``SystemExit`` raised by a signal handler);
- an ``OSError`` while writing (disk full, no permission) names the user's
  path, never the temporary name.

Appends (:func:`atomic_append`, the bench's ``results.jsonl``) cannot be
renamed into place: they open the target with ``O_APPEND | O_NOFOLLOW``,
refuse anything but a regular file, and write each record whole under an
exclusive ``flock``. Figures go through :func:`save_figure` (rendered to
memory, then :func:`atomic_write`).
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "LockedError",
    "UnsafeTargetError",
    "atomic_append",
    "atomic_open",
    "atomic_write",
    "check_target",
    "locked",
    "save_figure",
]

PathLike = str | os.PathLike[str]


class UnsafeTargetError(ValueError):
    """An output path that must not be written; the message names the path."""

    def __init__(self, path: PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{path}: {reason}")


def _umask() -> int:
    """The process umask, read without changing it where possible (thread-safe)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)  # elsewhere: briefly set a strict one, never 0
    os.umask(umask)
    return umask


def _named(err: OSError, target: PathLike) -> OSError:
    """The same error, naming the user's path instead of a temporary file."""
    out = type(err)(err.errno, err.strerror or str(err), str(target))
    return out


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_target(path: PathLike, inputs: Iterable[PathLike] = ()) -> os.stat_result | None:
    """Check that ``path`` may be replaced by a new regular file.

    Parameters
    ----------
    path
        The output path as the user gave it.
    inputs
        Files the command reads; writing onto one of them is refused.

    Returns
    -------
    os.stat_result or None
        The target's ``lstat`` when it exists, else ``None``.

    Raises
    ------
    UnsafeTargetError
        When the target is not a regular file or is one of ``inputs``.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeTargetError(path, "refusing to write: the path is a symbolic link")
    if stat.S_ISDIR(st.st_mode):
        raise UnsafeTargetError(path, "refusing to write: the path is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeTargetError(
            path, "refusing to write: the path exists and is not a regular file"
        )
    for src in inputs:
        try:
            if _same_file(st, os.stat(src)):
                raise UnsafeTargetError(
                    path, "refusing to write: the output is an input file of this command"
                )
        except FileNotFoundError:
            continue
    return st


@contextlib.contextmanager
def atomic_open(path: PathLike, inputs: Iterable[PathLike] = ()) -> Iterator[IO[bytes]]:
    """Open a binary file whose content replaces ``path`` when the block ends.

    Parameters
    ----------
    path
        Output path; its folder is created when missing.
    inputs
        Files the command reads (never overwritten).

    Yields
    ------
    IO[bytes]
        The temporary file. If the block raises, the target is untouched.
    """
    target = Path(path)
    inputs = list(inputs)
    old = check_target(target, inputs)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_CLOEXEC", 0)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        while True:
            tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(tmp, flags, 0o600)
                break
            except FileExistsError:
                continue
    except OSError as err:
        raise _named(err, target) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            try:
                yield fh
            except OSError as err:  # a write inside the block
                if err.filename is None:
                    raise _named(err, target) from None
                raise
            try:
                fh.flush()
                os.fsync(fh.fileno())
            except OSError as err:
                raise _named(err, target) from None
        if old is not None:
            mode = stat.S_IMODE(old.st_mode)
        else:
            mode = 0o666 & ~_umask()
        check_target(target, inputs)  # the target may have changed meanwhile
        try:
            os.chmod(tmp, mode)
            os.replace(tmp, target)
        except OSError as err:
            raise _named(err, target) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write(path: PathLike, data: bytes | str, inputs: Iterable[PathLike] = ()) -> None:
    """Write ``data`` to ``path`` safely (see the module docstring).

    Parameters
    ----------
    path
        Output path.
    data
        Bytes, or text encoded as UTF-8.
    inputs
        Files the command reads (never overwritten).
    """
    inputs = list(inputs)
    with atomic_open(path, inputs) as fh:
        fh.write(data.encode() if isinstance(data, str) else data)


def _open_regular(path: PathLike, flags: int, verb: str) -> int:
    """``os.open`` with ``flags`` plus ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC``; the
    descriptor of a regular file, else :class:`UnsafeTargetError` ("refusing to ``verb``")."""
    flags |= getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as err:
        if err.errno in (getattr(os, "ELOOP", -1), getattr(os, "ENXIO", -1)):
            raise UnsafeTargetError(path, f"refusing to {verb}: not a regular file") from None
        raise _named(err, path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeTargetError(path, f"refusing to {verb}: not a regular file")
    return fd


def atomic_append(path: PathLike, data: bytes | str, inputs: Iterable[PathLike] = ()) -> None:
    """Append one record to ``path`` whole, or not at all visible to other appenders.

    The target is checked as by :func:`check_target`, then opened with
    ``O_APPEND | O_NOFOLLOW | O_NONBLOCK`` (a symlink planted between the
    check and the open is refused, a FIFO never blocks) and ``fstat``-checked
    to be a regular file. The record is written under an exclusive
    ``flock``, then fsynced.

    Parameters
    ----------
    path
        File to append to (created when missing).
    data
        The record (bytes, or text encoded as UTF-8).
    inputs
        Files the command reads (never written).

    Raises
    ------
    UnsafeTargetError
        When the path is not a regular file, or is an input.
    OSError
        On a write error; it names ``path``.
    """
    payload = data.encode() if isinstance(data, str) else data
    check_target(path, inputs)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks
        fcntl = None  # type: ignore[assignment]
    fd = _open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "write")
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        view = memoryview(payload)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except OSError as err:
        raise _named(err, path) from None
    finally:
        os.close(fd)  # also releases the lock


def save_figure(fig: Any, path: PathLike, inputs: Iterable[PathLike] = (), **kwargs: Any) -> None:
    """Save a matplotlib figure through :func:`atomic_write`.

    Parameters
    ----------
    fig
        A ``matplotlib.figure.Figure``.
    path
        Output path; its suffix gives the format (``.png``, ``.pdf``, ``.svg``).
    inputs
        Files the command reads (never overwritten).
    **kwargs
        Passed to ``Figure.savefig`` (``dpi``, ``bbox_inches``, ...).
    """
    check_target(path, inputs)
    buf = io.BytesIO()
    fmt = Path(path).suffix.lstrip(".") or None
    fig.savefig(buf, format=fmt, **kwargs)
    atomic_write(path, buf.getvalue(), inputs)


class LockedError(OSError):
    """Another process holds the lock; the message names the lock file."""


@contextlib.contextmanager
def locked(path: PathLike, *, wait: bool = True, what: str = "") -> Iterator[None]:
    """Hold an exclusive ``flock`` on the lock file ``path`` (created when missing).

    The lock file is opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be a
    regular file (a planted symlink or FIFO is refused).

    Parameters
    ----------
    path
        The lock file.
    wait
        Wait for the lock (default); with ``False`` raise :class:`LockedError`
        at once when another process holds it.
    what
        Words for the error message (what the lock protects).

    Raises
    ------
    UnsafeTargetError
        When the lock path is not a regular file.
    LockedError
        With ``wait=False``, when the lock is taken.
    """
    check_target(path)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks
        fcntl = None  # type: ignore[assignment]
    fd = _open_regular(path, os.O_RDWR | os.O_CREAT, "lock")
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                raise LockedError(
                    f"{path}: locked by another process{f' ({what})' if what else ''}"
                ) from None
        yield
    finally:
        os.close(fd)  # releases the lock
