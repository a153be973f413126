"""Writing a launch set all at once: :func:`write_launch_set`.

Staged and fsynced, then committed by renames that are undone on any error.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import secrets
import shutil
import signal
import stat
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ntp_opt.app.export.names import (
    EXTRAS_FORMAT,
    EXTRAS_NAME,
    FILE_NAME_RE,
    LAUNCH_NAMES,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
)
from ntp_opt.model.safeio import UnsafeTargetError, check_target


def _previous_names(out: Path) -> set[str] | None:
    """The names a previous export wrote into ``out`` (``None``: not an export).

    Its manifest's list, or for an export made before manifests existed (its
    sidecar is of :data:`EXTRAS_FORMAT`) :data:`LAUNCH_NAMES`.
    """
    try:
        data = json.loads(_read_small(out / MANIFEST_NAME))
    except FileNotFoundError:
        data = None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if data is not None:
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            return None
        names = data.get("files")
        if not isinstance(names, list):
            return None
        return {n for n in names if isinstance(n, str) and FILE_NAME_RE.fullmatch(n)}
    try:
        extras = json.loads(_read_small(out / EXTRAS_NAME))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if isinstance(extras, dict) and extras.get("format") == EXTRAS_FORMAT:
        return set(LAUNCH_NAMES)
    return None


def _read_small(path: Path, limit: int = 1 << 20) -> str:
    """The text of a regular file of at most ``limit`` bytes (else ``OSError``)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, "too large for a manifest", str(path))
    return data.decode()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` (never existing: ``O_EXCL | O_NOFOLLOW``), write ``data``, fsync."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait while inside, then reach their handlers: the commit is whole.

    Python-level (the handlers are swapped for one that notes the signal,
    which is raised again on exit), so it holds whichever thread the kernel
    picks; only in the main thread (elsewhere no handler can be swapped).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    note = functools.partial(_note, pending)
    previous: dict[int, Any] = {}
    for held in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(held)
        if handler is None or handler == signal.SIG_IGN:
            continue
        previous[held] = handler
        signal.signal(held, note)
    try:
        yield
    finally:
        for num, handler in previous.items():
            signal.signal(num, handler)
        for num in dict.fromkeys(pending):
            signal.raise_signal(num)


def _note(pending: list[int], signum: int, frame: object) -> None:
    """The handler :func:`_signals_held` installs: note the signal for later."""
    pending.append(signum)


def write_launch_set(
    files: dict[str, str],
    target_dir: str | os.PathLike[str],
    *,
    inputs: Sequence[str | os.PathLike[str]] = (),
    executable: Sequence[str] | None = None,
    prune: bool = True,
) -> list[str]:
    """Write a set of launch files into ``target_dir`` all at once, or not at all.

    Everything is checked before anything is touched, and every file is
    written and fsynced in a staging directory first: a new target is built
    beside it (``.NAME.RANDOM.tmp``) and renamed into place; in an existing
    target the staging directory is ``.ntp-opt-stage.RANDOM`` inside it, and
    the commit renames the old files out and the new ones in, with SIGINT and
    SIGTERM held (delivered after it) and undone in reverse on any error. An
    error (a full disk), Ctrl-C or SIGTERM therefore leaves the target as it
    was and no staging directory behind (only ``kill -9`` during the renames
    can leave a mix, with the old files in the staging directory). Replaced
    files keep their permission bits (scripts stay executable); the target
    directory itself is never replaced (its owner, group, mode stay).

    What happens to what is already in the target:

    - files a previous export wrote there (listed in its manifest,
      :data:`MANIFEST_NAME`; for an export made before the manifest,
      :data:`LAUNCH_NAMES` when its sidecar is of :data:`EXTRAS_FORMAT`) are
      replaced, or removed when the new set lacks them (``prune``);
    - everything else (the user's files and folders) is left alone;
    - refused, before anything is written: a name of the new set that
      exists but was not written by an export, is a symbolic link or a
      directory, or is one of ``inputs``; a target that is a symbolic link
      or not a directory.

    Parameters
    ----------
    files
        File name (plain, :data:`FILE_NAME_RE`) -> text (written as UTF-8).
    target_dir
        The directory (created when missing, with its parents).
    inputs
        Files the command read (never replaced).
    executable
        Names created with mode ``0o777`` minus the umask (default: the names
        ending in ``.sh``); the others get ``0o666`` minus the umask.
    prune
        Remove the previous export's files that ``files`` does not name
        (``False``: keep them; they stay in the manifest).

    Returns
    -------
    list of str
        The names written (the keys of ``files``).

    Raises
    ------
    UnsafeTargetError
        When the target or one of its entries must not be replaced (nothing
        is written).
    OSError
        When writing fails (disk full, no permission); it names the target,
        which is as it was.
    """
    out = Path(os.path.abspath(target_dir))
    names = list(files)
    for name in names:
        if not FILE_NAME_RE.fullmatch(name) or name == MANIFEST_NAME:
            raise ValueError(f"launch file name {name!r} is not a plain file name")
    runnable = {n for n in names if n.endswith(".sh")} if executable is None else set(executable)
    payload = {name: files[name].encode() for name in names}
    exists = os.path.lexists(out)
    if exists:
        old_modes, stale, owned = _check_existing(out, names, inputs, prune)
    else:
        old_modes, stale, owned = {}, [], sorted(names)
    manifest = json.dumps({"format": MANIFEST_FORMAT, "files": owned}, indent=1) + "\n"
    _stage_and_commit(out, exists, payload, runnable, old_modes, manifest, stale)
    return names


def _stage_and_commit(
    out: Path,
    exists: bool,
    payload: dict[str, bytes],
    runnable: set[str],
    old_modes: dict[str, int],
    manifest: str,
    stale: list[str],
) -> None:
    """Write the files in a staging directory, then put them in place (see write_launch_set)."""
    names = list(payload)
    stage: Path | None = None
    try:
        try:
            parent = out if exists else out.parent
            parent.mkdir(parents=True, exist_ok=True)
            stage = _new_stage(parent, out.name, exists)
            _fill_stage(stage, payload, runnable, old_modes, manifest)
            if exists:
                os.mkdir(stage / "old", 0o700)
        except OSError as err:
            raise OSError(err.errno, err.strerror or str(err), str(out)) from None
        with _signals_held():
            try:
                if exists:
                    _commit(out, stage, [*names, MANIFEST_NAME], stale)
                    shutil.rmtree(stage, ignore_errors=True)  # now the old files
                else:
                    os.rename(stage, out)
            except OSError as err:
                raise OSError(err.errno, err.strerror or str(err), str(out)) from None
            stage = None
            with contextlib.suppress(OSError):
                _fsync_dir(out if exists else out.parent)
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)


def _check_existing(
    out: Path, names: list[str], inputs: Sequence[str | os.PathLike[str]], prune: bool
) -> tuple[dict[str, int], list[str], list[str]]:
    """Check an existing target before anything is written (:func:`write_launch_set`).

    Returns the permission bits of the files to replace, the previous export's
    files to remove (``stale``) and the names the new manifest lists.
    """
    st = os.lstat(out)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeTargetError(out, "refusing to write: the directory is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeTargetError(out, "refusing to write: the path is not a directory")
    previous = (_previous_names(out) or set()) - {MANIFEST_NAME}
    old_modes: dict[str, int] = {}
    stale: list[str] = []
    for name in names:
        old = check_target(out / name, inputs)
        if old is None:
            continue
        if name not in previous:
            raise UnsafeTargetError(
                out / name,
                "refusing to replace a file that no previous export wrote here: "
                "move it away or choose another output directory",
            )
        old_modes[name] = stat.S_IMODE(old.st_mode)
    for name in sorted(previous - set(names)):
        try:
            mode = os.lstat(out / name).st_mode
        except FileNotFoundError:
            continue
        if prune and stat.S_ISREG(mode):
            check_target(out / name, inputs)
            stale.append(name)
    kept = {n for n in previous - set(names) - set(stale) if os.path.lexists(out / n)}
    return old_modes, stale, sorted(set(names) | kept)


def _new_stage(parent: Path, name: str, exists: bool) -> Path:
    """A new, empty staging directory: inside an existing target, else beside the new one."""
    prefix = ".ntp-opt-stage." if exists else f".{name}."
    suffix = "" if exists else ".tmp"
    while True:
        cand = parent / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            os.mkdir(cand, 0o700 if exists else 0o777)
            return cand
        except FileExistsError:
            continue


def _fill_stage(
    stage: Path,
    payload: dict[str, bytes],
    runnable: set[str],
    old_modes: dict[str, int],
    manifest: str,
) -> None:
    """Write and fsync every file and the manifest into the staging directory."""
    for name, data in payload.items():
        _write_new(stage / name, data, 0o777 if name in runnable else 0o666)
        if name in old_modes:  # a replaced file keeps its bits; scripts stay runnable
            mode = old_modes[name]
            if name in runnable:
                mode |= (mode & 0o444) >> 2
            os.chmod(stage / name, mode)
    _write_new(stage / MANIFEST_NAME, manifest.encode(), 0o666)
    _fsync_dir(stage)


def _commit(out: Path, stage: Path, names: list[str], stale: list[str]) -> None:
    """Move ``stage``'s files into ``out`` (old ones to ``stage/old``); undo all on error."""
    done: list[tuple[Path, Path]] = []  # renames made, (from, to), undone in reverse
    try:
        for name in [*names, *stale]:
            if os.path.lexists(out / name):
                os.rename(out / name, stage / "old" / name)
                done.append((out / name, stage / "old" / name))
            if name in stale:
                continue
            os.rename(stage / name, out / name)
            done.append((stage / name, out / name))
    except BaseException:
        for src, dst in reversed(done):
            with contextlib.suppress(OSError):
                os.rename(dst, src)
        raise
