"""Batch runner: every planner on every instance with every seed (``ntp-opt bench``).

Each (instance file, planner, seed) is one *run* with a stable key. A run
executes in its own worker process (backend ``process``: a local
``multiprocessing`` pool, :mod:`ntp_opt.app.bench_local`; backend ``ray``: a
Ray task, on a local or remote Ray cluster, :mod:`ntp_opt.app.bench_ray`) with
a hard wall-clock timeout: a run that overruns is killed (``Process.kill``, or
``ray.cancel(force=True)``) and recorded with status ``"timeout"``. A run that
raises (a bad file, a planner error) is recorded with status ``"error"`` and
the message; nothing is raised to the caller.

Rows are appended to ``OUT/results.jsonl``, one JSON object per line, each
followed by ``flush`` and ``fsync``. On start the file is read back: a
truncated last line (a run killed mid-write) is cut off, and every key already
present is skipped, so an interrupted bench resumes without losing or
duplicating rows. With either backend only the driver (the calling process)
writes files. After the run the rows can be merged into a best-known table
(:mod:`ntp_opt.app.best_known`). See ``docs/bench.md``.

Besides the built-in planner names (:data:`ntp_opt.solve.PLANNERS`), a planner
may be given as ``"package.module:function"``: the worker imports it and calls
``function(instance, time_limit=..., seed=...)``, which must return a
:class:`~ntp_opt.solve.Result`. The tests use this to run a planner that sleeps.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rich.progress import Progress, TaskID

from ntp_opt.app.bench_local import execute as execute_local
from ntp_opt.app.best_known import md_cell
from ntp_opt.app.cli.common import MAX_LINE, progress_bar
from ntp_opt.app.runs import Todo, check_planner
from ntp_opt.model.echo import echo
from ntp_opt.model.safeio import atomic_append, atomic_write, check_target, locked

logger = logging.getLogger(__name__)

RESULTS = "results.jsonl"
"""Name of the results file inside the output directory."""

LOCK = ".bench.lock"
"""Lock file inside the output directory: one runner at a time per folder."""

FIELDS: tuple[str, ...] = (
    "key",
    "instance",
    "file",
    "gpus",
    "failed",
    "planner",
    "seed",
    "status",
    "limit",
    "relative_goodput",
    "bound",
    "gap",
    "runtime_s",
    "wall_s",
    "started_at",
    "version",
    "sha256",
    "validated",
    "message",
)
"""Every field of a result row, in CSV column order."""


def run_key(file: Path, planner: str, seed: int) -> str:
    """The stable key of one run: resolved file path, planner and seed."""
    return f"{Path(file).resolve()}|{planner}|{seed}"


def expand_paths(paths: list[Path]) -> list[Path]:
    """Files as given; a directory becomes its ``*.json`` and ``*.json.gz`` files, sorted.

    A directory's best-known table (``best_known.json``) is not an instance and is left out.
    """
    from ntp_opt.app.best_known import FILENAME

    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(
                sorted(
                    q
                    for q in p.iterdir()
                    if q.name.endswith((".json", ".json.gz")) and q.name != FILENAME
                )
            )
        else:
            out.append(p)
    return out


#: Fields a stored row must have, and their JSON types, to be reused on resume.
_ROW_TYPES: dict[str, tuple[type, ...]] = {
    "key": (str,),
    "instance": (str,),
    "planner": (str,),
    "status": (str,),
}


def _row_problem(row: Any) -> str | None:
    """Why a parsed results line cannot be used as a row, or ``None``."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    for name, types in _ROW_TYPES.items():
        if not isinstance(row.get(name), types):
            got = "missing" if name not in row else type(row[name]).__name__
            return f"field {name!r}: expected a string, got {got}"
    for name in ("gpus", "failed", "seed"):
        x = row.get(name)
        if x is not None and (isinstance(x, bool) or not isinstance(x, int)):
            return f"field {name!r}: expected an integer, got {type(x).__name__}"
    for name in ("relative_goodput", "bound", "gap", "runtime_s", "wall_s"):
        x = row.get(name)
        if x is not None and (isinstance(x, bool) or not isinstance(x, int | float)):
            return f"field {name!r}: expected a number, got {type(x).__name__}"
    return None


def read_rows(path: Path, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows of a results file; a truncated last line is cut off the file itself.

    A line that is not a usable row (not JSON, NaN or Infinity, not an object,
    a missing or mistyped ``key``, ``instance``, ``planner`` or ``status``, a
    non-numeric figure) is skipped, so its run is done again, and reported in
    ``problems`` as ``FILE:LINE: reason``. Returns the rows in file order,
    each with every field of :data:`FIELDS` (``None`` where the line has none).

    Raises
    ------
    ntp_opt.model.safeio.UnsafeTargetError
        When ``path`` exists and is not a regular file.
    """
    if check_target(path) is None:
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):  # killed mid-write: drop the partial line so appends stay clean
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.ftruncate(fd, end)
            os.fsync(fd)
        finally:
            os.close(fd)

    rows = []
    for n, line in enumerate(data[:end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, parse_constant=_no_constant)
        except (ValueError, RecursionError) as err:  # JSONDecodeError, bad UTF-8, NaN
            reason: str | None = f"not a JSON row ({str(err).splitlines()[0][:80]})"
        else:
            reason = _row_problem(row)
        if reason is not None:
            if problems is not None:
                problems.append(f"{path}:{n}: skipped: {reason}")
            continue
        rows.append({**dict.fromkeys(FIELDS), **row})  # every field present (None if absent)
    return rows


def _no_constant(token: str) -> float:
    """Refuse ``NaN`` and ``Infinity`` in a row (``json.loads``'s ``parse_constant``)."""
    raise ValueError(f"{token} is not valid JSON")


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with every NaN or infinite figure replaced by ``None`` (and said in ``message``)."""
    dropped = []
    for k, v in row.items():
        if isinstance(v, float) and not math.isfinite(v):
            dropped.append(f"{k} {v!r} dropped")
            row[k] = None
    if dropped:
        note = "; ".join(dropped)
        row["message"] = f"{row['message']}; {note}" if row.get("message") else note
    return row


def _append(path: Path, row: dict[str, Any]) -> None:
    atomic_append(path, json.dumps(row, sort_keys=False, allow_nan=False) + "\n")


Backend = Literal["process", "ray"]
"""Where runs execute: a local process pool, or a Ray cluster."""

BACKENDS: tuple[str, ...] = ("process", "ray")


def run_bench(
    instances: list[Path],
    planners: list[str],
    seeds: list[int],
    out: Path,
    *,
    time_limit: float,
    timeout: float,
    workers: int | None = 1,
    progress: bool = True,
    backend: Backend = "process",
    ray_address: str | None = None,
    best_known: Path | Literal["auto"] | None = None,
) -> list[dict[str, Any]]:
    """Run every planner on every instance with every seed; resume from ``out``.

    Parameters
    ----------
    instances
        Instance files, or folders standing for their ``*.json`` / ``*.json.gz``
        files (:func:`expand_paths`).
    planners
        Names of :data:`ntp_opt.solve.PLANNERS`, or ``"module:function"``.
    seeds
        Seeds passed to every planner.
    out
        Output folder (created); ``out/results.jsonl`` is read back to resume.
    time_limit
        The planner's own time limit in seconds.
    timeout
        Hard wall-clock seconds per run, after which the run is killed.
    workers
        Runs in flight at once (default 1; ``None`` with ``backend="ray"``:
        the cluster's CPU count).
    progress
        Show a progress bar with ETA on stderr.
    backend
        ``"process"`` (local process pool) or ``"ray"`` (needs ``ray``).
    ray_address
        ``ray.init(address=...)`` for ``backend="ray"`` (``"auto"``: the
        cluster this machine belongs to). Default: an already initialised Ray,
        else a new local one.
    best_known
        Best-known table to merge the rows into (:mod:`ntp_opt.app.best_known`):
        a path, ``"auto"`` (each file's :func:`ntp_opt.app.best_known.default_path`,
        if any), or ``None`` (default: none).

    Returns
    -------
    list of dict
        One row per requested run (already recorded or new), in instance,
        planner, seed order. Also writes ``out/results.csv``,
        ``out/summary.md`` and, with matplotlib, the plots of :func:`plot`.

    Raises
    ------
    ntp_opt.model.safeio.LockedError
        When another runner holds ``out``'s lock (:data:`LOCK`).
    """
    workers = _checked_workers(planners, time_limit, timeout, workers, backend)
    files = expand_paths(instances)
    if not files:
        raise ValueError("no instance files given")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with locked(out / LOCK, wait=False, what="another ntp-opt bench is writing to this folder"):
        return _run_locked(
            files,
            planners,
            seeds,
            out,
            time_limit,
            timeout,
            workers,
            progress,
            backend,
            ray_address,
            best_known,
        )


def _checked_workers(
    planners: list[str], time_limit: float, timeout: float, workers: int | None, backend: str
) -> int | None:
    """Check :func:`run_bench`'s arguments; the number of workers (``None``: Ray's CPUs)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if workers is None and backend == "process":
        workers = 1
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if not timeout > 0 or not time_limit > 0:
        raise ValueError("time_limit and timeout must be positive")
    for p in planners:
        check_planner(p)
    return workers


@dataclass
class _Recorder:
    """Turns each finished run into a row: kept in ``done``, appended to ``results``."""

    done: dict[str, dict[str, Any]]
    results: Path
    version: str

    def finish(
        self, item: Todo, info: dict[str, Any], result: dict[str, Any], wall: float, started: str
    ) -> None:
        """Record the run of ``item``."""
        row: dict[str, Any] = dict.fromkeys(FIELDS)
        row.update(
            key=item.key,
            instance=Path(item.file).name.removesuffix(".gz").removesuffix(".json"),
            file=str(item.file),
            planner=item.planner,
            seed=item.seed,
            runtime_s=wall,
            started_at=started,
            version=self.version,
            validated=False,
        )
        row.update(info)
        row.update(result)
        row["wall_s"] = wall
        _clean(row)
        self.done[item.key] = row
        _append(self.results, row)
        logger.info(
            "bench: %s %s seed %s: %s in %.1f s",
            row["instance"],
            item.planner,
            item.seed,
            row["status"],
            wall,
        )


@dataclass
class _Bar:
    """The progress bar's callbacks around :meth:`_Recorder.finish`."""

    bar: Progress
    task: TaskID
    recorder: _Recorder

    def started(self, item: Todo) -> None:
        """Show the run that starts."""
        self.bar.update(
            self.task, description=f"{Path(item.file).name} {item.planner} seed {item.seed}"
        )

    def finished(self, *args: Any) -> None:
        """Record a run and advance the bar."""
        self.recorder.finish(*args)
        self.bar.advance(self.task)


def _run_locked(
    files: list[Path],
    planners: list[str],
    seeds: list[int],
    out: Path,
    time_limit: float,
    timeout: float,
    workers: int | None,
    progress: bool,
    backend: Backend,
    ray_address: str | None,
    best_known: Path | Literal["auto"] | None,
) -> list[dict[str, Any]]:
    from ntp_opt import __version__

    results = out / RESULTS
    done: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for row in read_rows(results, problems):
        done.setdefault(row["key"], row)
    for line in problems:
        print(f"ntp-opt bench: warning: {echo(line, MAX_LINE)}", file=sys.stderr)
    wanted = [(run_key(f, p, s), f, p, s) for f in files for p in planners for s in seeds]
    todo = [Todo(*w) for w in dict((w[0], w) for w in wanted).values() if w[0] not in done]
    recorder = _Recorder(done, results, __version__)
    with progress_bar(not progress) as bar:
        calls = _Bar(bar, bar.add_task("bench", total=len(todo)), recorder)
        started, finished = calls.started, calls.finished
        if backend == "ray":
            from ntp_opt.app.bench_ray import execute

            execute(todo, time_limit, timeout, workers, ray_address, started, finished)
        else:
            execute_local(todo, time_limit, timeout, workers or 1, started, finished)
    rows = [done[k] for k in dict.fromkeys(w[0] for w in wanted)]
    write_csv(rows, out / "results.csv")
    atomic_write(out / "summary.md", summary(rows) + "\n")
    plot(rows, out)
    if best_known is not None:
        update_best_known(rows, best_known)
    return rows


def update_best_known(
    rows: list[dict[str, Any]], best_known: Path | Literal["auto"]
) -> dict[Path, list[str]]:
    """Merge rows into best-known tables; returns the changes by table.

    ``best_known="auto"`` sends each row to its file's default table
    (:func:`ntp_opt.app.best_known.default_path`); rows of files without one are
    left out.
    """
    from ntp_opt.app import best_known as bk

    tables: dict[Path, list[dict[str, Any]]] = {}
    for row in rows:
        if best_known == "auto":
            path = bk.default_path(bk.row_file(row))
            if path is None:
                continue
        else:
            path = Path(best_known)
        tables.setdefault(path, []).append(row)
    return {path: bk.update(path, rs) for path, rs in tables.items()}


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """All rows as CSV, written to a temporary file and renamed (atomic)."""
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=list(FIELDS), extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue())


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r["instance"]), str(r["planner"])), []).append(r)
    return groups


def summary(rows: list[dict[str, Any]]) -> str:
    """Markdown table: one line per instance and planner, averaged over seeds."""
    lines = [
        "| instance | GPUs | failed | planner | runs | rel. goodput | max gap "
        "| mean time s | status |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for (inst, planner), rs in _groups(rows).items():
        goodput = _mean([r["relative_goodput"] for r in rs if r["relative_goodput"] is not None])
        gaps = [r["gap"] for r in rs if r.get("gap") is not None]
        times = [r["runtime_s"] for r in rs if r.get("runtime_s") is not None]
        statuses: dict[str, int] = {}
        for r in rs:
            statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
        status = md_cell(", ".join(f"{k} x{v}" if v > 1 else k for k, v in statuses.items()))
        lines.append(
            f"| {md_cell(inst)} | {_num(rs[0].get('gpus'), 'd')} "
            f"| {_num(rs[0].get('failed'), 'd')} | {md_cell(planner)} | {len(rs)} "
            f"| {_num(goodput, '.4f')} "
            f"| {_num(max(gaps) if gaps else None, '.1e')} | {_num(_mean(times), '.3f')} "
            f"| {status} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Write ``goodput.png``, ``time_vs_size.png`` and ``gap.png`` into ``out``.

    Returns the files written.

    Needs matplotlib (``pip install 'ntp-opt[plot]'``); without it prints a
    message and writes nothing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("ntp-opt bench: matplotlib is not installed; no plots written")
        return []
    out = Path(out)
    planners = list(dict.fromkeys(str(r["planner"]) for r in rows))
    written = [plot_goodput(rows, out / "goodput.png", plt)]
    fig, ax = plt.subplots(figsize=(5, 4))
    for j, p in enumerate(planners):
        pts = [
            (r["gpus"], r["runtime_s"])
            for r in rows
            if r["planner"] == p and r.get("gpus") and r.get("runtime_s") is not None
        ]
        if pts:
            ax.scatter([x for x, _ in pts], [y for _, y in pts], label=p, s=16, **_style(j))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GPUs in the instance")
    ax.set_ylabel("run time (s)")
    ax.set_title("run time against cluster size, one point per run", fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    written.append(_finish(fig, out / "time_vs_size.png", plt))
    written.append(plot_gap(rows, out / "gap.png", plt))
    return written


GAP_FLOOR = 1e-6
"""Gaps below this are drawn at this value in ``gap.png`` (log scale; 0 = proven optimal)."""


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
"""One marker per planner (with its colour), so overlapping points stay apart."""

LOSS_FLOOR = 1e-3
"""Losses below this (in %) are drawn on the ``= best`` line of ``goodput.png``."""


def _style(j: int) -> dict[str, Any]:
    return {"marker": MARKERS[j % len(MARKERS)], "color": f"C{j % 10}"}


def _finish(fig: Any, path: Path, plt: Any) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    atomic_write(path, buf.getvalue())
    return path


def goodput_losses(rows: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """Per (instance, planner): loss against the best planner of the instance, in %.

    ``100 * (1 - g / best)``, with ``g`` the planner's mean relative goodput
    over its runs and ``best`` the largest such mean on that instance; pairs
    with no goodput at all are left out.
    """
    means: dict[tuple[str, str], float] = {}
    for key, rs in _groups(rows).items():
        vals = [float(r["relative_goodput"]) for r in rs if r["relative_goodput"] is not None]
        if vals:
            means[key] = sum(vals) / len(vals)
    best: dict[str, float] = {}
    for (inst, _), g in means.items():
        best[inst] = max(best.get(inst, g), g)
    return {
        (inst, p): (100 * (1 - g / best[inst]) if best[inst] > 0 else 0.0)
        for (inst, p), g in means.items()
    }


def plot_goodput(rows: list[dict[str, Any]], path: Path, plt: Any) -> Path:
    """``goodput.png``: per instance, each planner's goodput loss against the best planner.

    One row per instance (its name, GPUs and the best mean relative goodput
    on the right), one marker per planner; the x axis is the loss in %
    against the best planner of that instance, linear up to 0.01 % and
    logarithmic above (ticks 0.01, 0.1, 1, 10, 100 %), so differences of
    0.1-2 % stay visible next to a paused planner (100 %).
    """
    groups = _groups(rows)
    instances = list(dict.fromkeys(k[0] for k in groups))
    planners = list(dict.fromkeys(k[1] for k in groups))
    losses = goodput_losses(rows)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.42 * max(1, len(instances))))
    n = max(1, len(planners))
    for j, p in enumerate(planners):
        pts = [
            (max(LOSS_FLOOR, losses[(inst, p)]), i + (j - (n - 1) / 2) * 0.6 / n)
            for i, inst in enumerate(instances)
            if (inst, p) in losses
        ]
        ax.scatter([x for x, _ in pts], [y for _, y in pts], s=30, label=p, zorder=3, **_style(j))
    ax.set_xscale("symlog", linthresh=0.01, linscale=0.5)
    ax.set_xlim(0, 150)
    ticks = [0, 0.01, 0.1, 1, 10, 100]
    ax.set_xticks(ticks, ["0 = best", "0.01 %", "0.1 %", "1 %", "10 %", "100 %"])
    ax.set_ylim(len(instances) - 0.5, -0.5)
    best: dict[str, tuple[float, str]] = {}
    for (inst, p), rs in groups.items():
        vals = [float(r["relative_goodput"]) for r in rs if r["relative_goodput"] is not None]
        if vals and (inst not in best or sum(vals) / len(vals) > best[inst][0]):
            best[inst] = (sum(vals) / len(vals), p)
    gpus = {str(r["instance"]): r.get("gpus") for r in rows if r.get("gpus")}
    ax.set_yticks(
        range(len(instances)),
        [f"{inst} ({gpus[inst]:,} GPUs)" if inst in gpus else inst for inst in instances],
        fontsize=8,
    )
    for i, inst in enumerate(instances):
        if inst in best:
            ax.annotate(
                f"best {best[inst][0]:.4f} ({best[inst][1]})",
                (1.0, i),
                xycoords=("axes fraction", "data"),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
        if i % 2:
            ax.axhspan(i - 0.5, i + 0.5, color="0.95", zorder=0)
    ax.grid(True, axis="x", alpha=0.4)
    ax.set_xlabel(
        "goodput loss against the best planner of the instance "
        "(100 * (1 - mean relative goodput / best); 0.01 % linear, log above)"
    )
    ax.set_title(
        "relative goodput per instance and planner, as loss against the best", fontsize=10, pad=20
    )
    if planners:
        ax.legend(
            loc="lower left", bbox_to_anchor=(0, 1.0), ncol=min(8, n), fontsize=8, frameon=False
        )
    return _finish(fig, path, plt)


def plot_gap(rows: list[dict[str, Any]], path: Path, plt: Any) -> Path:
    """``gap.png``: the proven gap of every run, per instance, and its distribution.

    Left: one row per instance (its name), one marker per planner and run
    that reports a gap (exact planners), on a log axis; gaps below
    :data:`GAP_FLOOR` (proven optimal) sit on the floor line. Right: for
    each planner, the share of its runs (of every status) whose gap is at
    most g, against g; runs without a gap (timeouts, errors, no bound) never
    count.
    """
    planners = list(dict.fromkeys(str(r["planner"]) for r in rows))
    instances = list(dict.fromkeys(str(r["instance"]) for r in rows))
    with_gap = [
        p for p in planners if any(r.get("gap") is not None for r in rows if r["planner"] == p)
    ]
    height = max(4.0, 1.5 + 0.35 * len(instances))
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12, height), gridspec_kw={"width_ratios": [1.4, 1]}
    )
    n = max(1, len(with_gap))
    for j, p in enumerate(with_gap):
        style = _style(planners.index(p))
        pts = [
            (max(GAP_FLOOR, float(r["gap"])), instances.index(str(r["instance"])))
            for r in rows
            if r["planner"] == p and r.get("gap") is not None
        ]
        left.scatter(
            [x for x, _ in pts],
            [y + (j - (n - 1) / 2) * 0.5 / n for _, y in pts],
            label=p,
            s=24,
            zorder=3,
            **style,
        )
        runs = [r for r in rows if r["planner"] == p]
        gaps = sorted(max(GAP_FLOOR, float(r["gap"])) for r in runs if r.get("gap") is not None)
        xs = [GAP_FLOOR, *gaps, 1.0]
        ys = [sum(g <= x for g in gaps) / len(runs) for x in xs]
        right.step(xs, ys, where="post", label=p, color=style["color"])
    left.axvline(GAP_FLOOR, color="grey", lw=0.5, ls=":")
    left.set_xlim(GAP_FLOOR / 3, 1.5)
    left.set_xscale("log")
    left.set_ylim(len(instances) - 0.5, -0.5)
    left.set_yticks(range(len(instances)), instances, fontsize=8)
    left.grid(True, axis="x", alpha=0.4)
    left.set_xlabel(f"gap = (bound - goodput) / bound  (at {GAP_FLOOR:g}: proven optimal)")
    left.set_title("proven gap of every run, per instance", fontsize=10)
    right.set_xlim(GAP_FLOOR / 3, 1.5)
    right.set_xscale("log")
    right.set_xlabel("gap g")
    right.set_ylabel("share of the planner's runs with gap <= g")
    right.set_ylim(0, 1.02)
    right.set_title("runs within a gap (timeouts and errors never count)", fontsize=10)
    right.grid(True, alpha=0.4)
    if not with_gap:
        left.text(0.5, 0.5, "no run has a gap", ha="center", transform=left.transAxes)
    else:
        right.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return _finish(fig, path, plt)
