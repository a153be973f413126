"""The files of a watch's output directory: the journal, atomic writes, the lock, versions.

``DIR/journal.jsonl`` (:class:`Journal`), ``DIR/status.json`` (written by
:func:`write_atomic`), ``DIR/.lock`` (:func:`lock_dir`), the versions
``DIR/vNNNN/`` and the symlink ``DIR/current`` (see ``docs/watch.md``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "CURRENT",
    "JOURNAL",
    "STATUS",
    "Journal",
    "WatchError",
    "current_version",
    "fsync_dir",
    "lock_dir",
    "next_version",
    "version_name",
    "write_atomic",
    "write_synced",
]

JOURNAL = "journal.jsonl"
STATUS = "status.json"
CURRENT = "current"


class WatchError(ValueError):
    """The watch cannot start (its output directory is another watch's)."""


# --- files ---------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (after a rename or a new file).

    Parameters
    ----------
    path
        The directory.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it.

    Parameters
    ----------
    path
        The file (replaced).
    text
        Its content, UTF-8.
    """
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` by a temporary file and a rename (readers never see half).

    Parameters
    ----------
    path
        The file (replaced).
    text
        Its content, UTF-8.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    write_synced(tmp, text)
    os.replace(tmp, path)


class Journal:
    """``DIR/journal.jsonl``: one fsynced JSON line per observation, publication and hook.

    Parameters
    ----------
    path
        The journal file (created when missing; a torn last line is ignored).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        if path.exists():
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue  # a line torn by kill -9 mid-write
                    if isinstance(rec, dict):
                        self.records.append(rec)
        self._f: TextIO = open(path, "a", encoding="utf-8")
        if path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            self._f.write("\n")  # the torn line stays unreadable; the next one is whole

    def append(self, record: dict[str, Any]) -> None:
        """Append one record and fsync it."""
        record = {"t": round(time.time(), 3), **record}
        self._f.write(json.dumps(record, sort_keys=True) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.records.append(record)

    def close(self) -> None:
        """Close the file."""
        self._f.close()


def lock_dir(out: Path) -> int:
    """Hold ``DIR/.lock`` (one watch per directory).

    Parameters
    ----------
    out
        The output directory ``DIR``.

    Returns
    -------
    int
        The descriptor holding the lock (closing it releases the lock).

    Raises
    ------
    WatchError
        When another watch holds it.
    """
    import fcntl

    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise WatchError(f"{out}: another ntp-opt watch publishes there") from None
    return fd


def version_name(version: int) -> str:
    """The directory name of a version.

    Parameters
    ----------
    version
        Its number (from 1).

    Returns
    -------
    str
        ``vNNNN``.
    """
    return f"v{version:04d}"


def current_version(out: Path) -> int | None:
    """The complete version ``DIR/current`` names, if any.

    Parameters
    ----------
    out
        The output directory ``DIR``.

    Returns
    -------
    int or None
        Its number, or ``None`` without a link to a version with its ``summary.json``.
    """
    try:
        name = os.readlink(out / CURRENT)
    except OSError:
        return None
    if len(name) != 5 or not name.startswith("v") or not name[1:].isdigit():
        return None
    if not (out / name / "summary.json").is_file():
        return None
    return int(name[1:])


def next_version(out: Path) -> int:
    """The number after every ``DIR/vNNNN`` directory (1 when there is none).

    Parameters
    ----------
    out
        The output directory ``DIR``.

    Returns
    -------
    int
        The next free version number.
    """
    names = [p.name for p in out.glob("v[0-9][0-9][0-9][0-9]")]
    return max((int(n[1:]) for n in names), default=0) + 1
