"""The table of best known goodput and bound per instance (``instances/best_known.json``).

``ntp-opt bench`` merges its rows into the table after a run; the table only
improves:

- the best goodput is replaced only by a strictly higher relative goodput
  (by more than :data:`TOLERANCE`) of a plan the validator has checked
  (rows with ``validated: true``);
- the best bound is replaced only by a strictly lower relative bound from a
  planner of :data:`ntp_opt.solve.INSTANCE_BOUNDS`, whose bounds hold for the
  instance as it is (the exact planners and ``fast``; not ``optimal-nopower``
  or ``optimal-megatron``, which bound restricted problems).

Each entry carries the SHA-256 of the instance file it is about. A row counts
only if it was computed on the file as it is now; if the file has changed
since the entry was written (the instance was regenerated differently), the
entry starts afresh from the new rows. The JSON table and its rendering,
``best_known.md`` beside it, are written to temporary files and renamed, under
an exclusive lock (``.best_known.lock``) so that two benches sharing a
table do not lose each other's updates. See ``docs/bench.md``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ntp_opt.model.safeio import atomic_write, locked

FORMAT = "ntp-opt/best-known@1"
"""``format`` field of the table file."""

FILENAME = "best_known.json"
"""Name of the table file that ``ntp-opt bench`` looks for by default."""

TOLERANCE = 1e-9
"""Relative improvement below which a value is not replaced (float noise)."""

_GOOD_STATUS = ("optimal", "feasible")


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_path(instance_file: str | os.PathLike[str]) -> Path | None:
    """The table an instance file belongs to by default, or ``None``.

    That is ``best_known.json`` in the file's folder or, failing that, in the
    folder above it (so ``instances/large/*.json.gz`` share
    ``instances/best_known.json``). Without such a file, no table.
    """
    folder = Path(instance_file).resolve().parent
    for d in (folder, folder.parent):
        if (d / FILENAME).is_file():
            return d / FILENAME
    return None


def empty() -> dict[str, Any]:
    """A table with no instances."""
    return {"format": FORMAT, "instances": {}}


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a table; a missing file is an empty table.

    Raises
    ------
    ValueError
        If the file is not a best-known table (naming the file and field).
    """
    p = Path(path)
    if not p.exists():
        return empty()
    try:
        data = json.loads(
            p.read_text(encoding="utf-8"), parse_constant=functools.partial(_no_constant, p)
        )
    except json.JSONDecodeError as err:
        raise ValueError(f"{p}: not JSON: {err}") from None
    except (UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"{p}: not a JSON table: {err}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{p}: format: expected {FORMAT!r}, got {got!r}")
    if not isinstance(data.get("instances"), dict):
        raise ValueError(f"{p}: instances: expected an object keyed by instance name")
    return data


def _better(new: float, old: float | None, *, higher: bool) -> bool:
    if old is None:
        return True
    scale = max(1.0, abs(old))
    return new > old + TOLERANCE * scale if higher else new < old - TOLERANCE * scale


def _rel(path: Path, base: Path) -> str:
    try:
        return Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()
    except ValueError:  # another drive (Windows)
        return path.resolve().as_posix()


def row_file(row: dict[str, Any]) -> str:
    """The instance file of a bench row: the resolved path of its key, else its ``file``."""
    key = row.get("key")
    if isinstance(key, str) and key.count("|") >= 2:
        return key.rsplit("|", 2)[0]
    return str(row.get("file"))


def _no_constant(p: Path, token: str) -> float:
    """Refuse ``NaN`` and ``Infinity`` in table ``p`` (``json.loads``'s ``parse_constant``)."""
    raise ValueError(f"{p}: {token} is not valid JSON")


def merge(
    table: dict[str, Any], rows: list[dict[str, Any]], base: Path, sha: dict[str, str]
) -> list[str]:
    """Merge bench rows into ``table`` in place; returns one line per change.

    Parameters
    ----------
    table
        A table as returned by :func:`load`.
    rows
        Bench rows (``ntp_opt.app.bench`` result rows).
    base
        Folder of the table; file paths are stored relative to it.
    sha
        Current SHA-256 of every instance file, by :func:`row_file`; rows
        whose file is missing here, or whose ``sha256`` differs, are skipped
        (the file changed since the run).
    """
    from ntp_opt.solve import INSTANCE_BOUNDS

    entries: dict[str, Any] = table["instances"]
    changes: list[str] = []
    for row in rows:
        current = sha.get(row_file(row))
        if current is None or row.get("sha256") != current:
            continue
        if str(row.get("status")) not in _GOOD_STATUS:
            continue
        name = str(row["instance"])
        entry = _entry(entries, row, name, current, base, changes)
        goodput = _finite(row.get("relative_goodput"))
        if (
            row.get("validated") is True
            and goodput is not None
            and _better(float(goodput), entry["goodput"], higher=True)
        ):
            old = entry["goodput"]
            entry.update(
                goodput=float(goodput),
                goodput_planner=row["planner"],
                goodput_seed=row.get("seed"),
                goodput_at=row.get("started_at"),
            )
            changes.append(f"{name}: goodput {_fmt(old)} -> {goodput:.6f} ({row['planner']})")
        bound = _finite(row.get("bound"))
        if row.get("bound") is not None and bound is None:
            changes.append(f"{name}: {row.get('planner')}: bound {row.get('bound')!r} dropped")
        if (
            str(row.get("planner")) in INSTANCE_BOUNDS  # bounds this instance as it is
            and bound is not None
            and _better(float(bound), entry["bound"], higher=False)
        ):
            old = entry["bound"]
            entry.update(
                bound=float(bound), bound_planner=row["planner"], bound_at=row.get("started_at")
            )
            changes.append(f"{name}: bound {_fmt(old)} -> {bound:.6f} ({row['planner']})")
    for entry in entries.values():
        entry["gap"] = gap(entry)
    table["instances"] = dict(
        sorted(entries.items(), key=lambda kv: (kv[1].get("gpus") or 0, kv[0]))
    )
    return changes


def _entry(
    entries: dict[str, Any],
    row: dict[str, Any],
    name: str,
    current: str,
    base: Path,
    changes: list[str],
) -> dict[str, Any]:
    """The entry of ``name``, new when missing or when its instance file changed."""
    entry: dict[str, Any] | None = entries.get(name)
    if entry is not None and entry.get("sha256") != current:
        changes.append(f"{name}: instance file changed; its entry starts afresh")
        entry = None
    if entry is None:
        entry = {
            "file": _rel(Path(row_file(row)), base),
            "sha256": current,
            "gpus": row.get("gpus"),
            "failed": row.get("failed"),
            "goodput": None,
            "goodput_planner": None,
            "goodput_seed": None,
            "goodput_at": None,
            "bound": None,
            "bound_planner": None,
            "bound_at": None,
        }
        entries[name] = entry
    return entry


def _finite(x: Any) -> float | None:
    """``x`` as a float if it is a finite number (not a bool), else ``None``."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    try:
        value = float(x)
    except OverflowError:  # a huge int
        return None
    return value if math.isfinite(value) else None


def md_cell(text: Any) -> str:
    """``text`` safe inside a Markdown table cell: no ``|``, line breaks or HTML."""
    out = str(text)
    for a, b in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "\\|")):
        out = out.replace(a, b)
    return " ".join(out.split())


def gap(entry: dict[str, Any]) -> float | None:
    """``(bound - goodput) / bound`` of an entry (``None`` without both; 0 if bound is 0)."""
    g, b = entry.get("goodput"), entry.get("bound")
    if g is None or b is None:
        return None
    return 0.0 if b <= 0 else (b - g) / b


def _fmt(x: float | None, spec: str = ".6f") -> str:
    return "-" if x is None else format(x, spec)


def render(table: dict[str, Any]) -> str:
    """The table as markdown (what ``best_known.md`` holds)."""
    lines = [
        "# Best known goodput per instance",
        "",
        "Written by `ntp-opt bench` from validated plans and proven bounds; do not edit",
        "(docs/bench.md, *Best-known table*). Goodput and bound are relative: 1.0 is the",
        "job with no failures. Gap = (bound - goodput) / bound.",
        "",
        "| instance | GPUs | failed | best goodput | planner | best bound | bound by | gap |",
        "|---|---:|---:|---:|---|---:|---|---:|",
    ]
    for name, e in table["instances"].items():
        g = gap(e)
        lines.append(
            f"| {md_cell(name)} | {_fmt(e.get('gpus'), 'd')} | {_fmt(e.get('failed'), 'd')} "
            f"| {_fmt(e.get('goodput'))} | {md_cell(e.get('goodput_planner') or '-')} "
            f"| {_fmt(e.get('bound'))} | {md_cell(e.get('bound_planner') or '-')} "
            f"| {'-' if g is None else format(g, '.2e')} |"
        )
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    atomic_write(path, text)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    lock = path.with_name(f".{path.stem}.lock")  # not *.json*: no glob takes it for an instance
    with locked(lock, what="best-known table"):
        yield


def update(path: str | os.PathLike[str], rows: list[dict[str, Any]]) -> list[str]:
    """Merge ``rows`` into the table at ``path`` (created if missing); returns the changes.

    Reads, merges and writes under an exclusive lock; the JSON file and
    ``best_known.md`` beside it are replaced atomically, and only when
    something changed.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    sha: dict[str, str] = {}
    for f in dict.fromkeys(row_file(r) for r in rows):
        if f and Path(f).is_file():
            sha[f] = file_sha256(f)
    with _locked(p):
        table = load(p)
        changes = merge(table, rows, p.parent, sha)
        if changes or not p.exists():
            _atomic_write(p, json.dumps(table, indent=1, allow_nan=False) + "\n")
            _atomic_write(p.with_suffix(".md"), render(table))
    return changes
