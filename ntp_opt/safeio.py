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
  ``KeyboardInterrupt``, ``SystemExit`` raised by a signal handler).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

__all__ = ["UnsafeTargetError", "atomic_open", "atomic_write", "check_target"]

PathLike = str | os.PathLike[str]


class UnsafeTargetError(ValueError):
    """An output path that must not be written; the message names the path."""

    def __init__(self, path: PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{path}: {reason}")


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
    old = check_target(target, inputs)
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    while True:
        tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o600)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        if old is not None:
            mode = stat.S_IMODE(old.st_mode)
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        check_target(target, inputs)  # the target may have changed meanwhile
        os.replace(tmp, target)
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
