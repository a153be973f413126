"""Batch runner: every planner on every instance with every seed (``ntp-opt bench``).

Each (instance file, planner, seed) is one *run* with a stable key. A run
executes in its own worker process (backend ``process``: a local
``multiprocessing`` pool; backend ``ray``: a Ray task, on a local or remote
Ray cluster) with a hard wall-clock timeout: a run that overruns is killed
(``Process.kill``, or ``ray.cancel(force=True)``) and recorded with status
``"timeout"``. A run that raises (a bad file, a planner error) is recorded
with status ``"error"`` and the message; nothing is raised to the caller.

Rows are appended to ``OUT/results.jsonl``, one JSON object per line, each
followed by ``flush`` and ``fsync``. On start the file is read back: a
truncated last line (a run killed mid-write) is cut off, and every key already
present is skipped, so an interrupted bench resumes without losing or
duplicating rows. With either backend only the driver (the calling process)
writes files. After the run the rows can be merged into a best-known table
(:mod:`ntp_opt.best_known`). See ``docs/bench.md``.

Besides the built-in planner names (:data:`ntp_opt.solve.PLANNERS`), a planner
may be given as ``"package.module:function"``: the worker imports it and calls
``function(instance, time_limit=..., seed=...)``, which must return a
:class:`~ntp_opt.solve.Result`. The tests use this to run a planner that sleeps.
"""

from __future__ import annotations

import csv
import importlib
import json
import logging
import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

logger = logging.getLogger(__name__)

RESULTS = "results.jsonl"
"""Name of the results file inside the output directory."""

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
    from .best_known import FILENAME

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


def _check_planner(name: str) -> None:
    from .solve import PLANNERS

    if name not in PLANNERS and ":" not in name:
        raise ValueError(
            f"unknown planner {name!r}; known: {', '.join(PLANNERS)} (or module:function)"
        )


def _planner(name: str) -> Callable[..., Any]:
    from .solve import solve

    if ":" not in name:
        return lambda inst, time_limit, seed: solve(inst, name, time_limit=time_limit, seed=seed)
    module, func = name.split(":", 1)
    planner: Callable[..., Any] = getattr(importlib.import_module(module), func)
    return planner


def _steps(
    file: str, planner: str, seed: int, time_limit: float
) -> Iterator[tuple[str, dict[str, Any]]]:
    """One run: yields ``("info", {...})`` once the instance loaded, then ``("row", {...})``.

    The row's goodput is the validator's: built-in planners return checked
    plans (:func:`ntp_opt.solve.solve`), a ``module:function`` planner's plan
    is checked here (``validated`` says so; a plan that fails the check is an
    ``error`` row).
    """
    row: dict[str, Any] = {}
    try:
        from .best_known import file_sha256
        from .files import load_instance

        instance = load_instance(file)
        s = instance.summary()
        info = {
            "instance": s["name"],
            "gpus": s["gpus"],
            "failed": s["failed"],
            "sha256": file_sha256(file),
        }
        yield ("info", info)
        res = _planner(planner)(instance, time_limit=time_limit, seed=seed)
        goodput = res.relative_objective
        if res.plan is not None and ":" in planner:  # never trust a custom planner
            from .validate import check

            goodput = check(instance, res.plan).relative_goodput
        job = instance.job
        bound = None if res.bound is None else res.bound * job.seq_time_s / job.dp
        row = {
            "status": str(res.status),
            "limit": str(res.limit),
            "relative_goodput": goodput,
            "bound": bound,
            "gap": res.gap,
            "runtime_s": res.runtime_s,
            "validated": res.plan is not None,
            "message": res.reason,
        }
    except Exception as err:  # recorded, never raised
        row = {"status": "error", "message": f"{type(err).__name__}: {err}"}
    yield ("row", row)


def _worker(conn: Connection, file: str, planner: str, seed: int, time_limit: float) -> None:
    """Body of a worker process: sends what :func:`_steps` yields through ``conn``."""
    for message in _steps(file, planner, seed, time_limit):
        conn.send(message)
    conn.close()


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a results file; a truncated last line is cut off the file itself.

    Lines that do not parse (only possible after a crash mid-write) are
    ignored. Returns the rows in file order.
    """
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):  # killed mid-write: drop the partial line so appends stay clean
        with path.open("r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    rows = []
    for line in data[:end].splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "key" in row:
            rows.append(row)
    return rows


def _append(path: Path, row: dict[str, Any]) -> None:
    line = json.dumps(row, sort_keys=False) + "\n"
    with path.open("a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def _context() -> Any:
    # fork is fast (no re-import per run); spawn where fork does not exist.
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


Backend = Literal["process", "ray"]
"""Where runs execute: a local process pool, or a Ray cluster."""

BACKENDS: tuple[str, ...] = ("process", "ray")


@dataclass
class _Todo:
    key: str
    file: Path
    planner: str
    seed: int


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
        Best-known table to merge the rows into (:mod:`ntp_opt.best_known`):
        a path, ``"auto"`` (each file's :func:`ntp_opt.best_known.default_path`,
        if any), or ``None`` (default: none).

    Returns
    -------
    list of dict
        One row per requested run (already recorded or new), in instance,
        planner, seed order. Also writes ``out/results.csv``,
        ``out/summary.md`` and, with matplotlib, the plots of :func:`plot`.
    """
    from . import __version__

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if workers is None and backend == "process":
        workers = 1
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if not timeout > 0 or not time_limit > 0:
        raise ValueError("time_limit and timeout must be positive")
    for p in planners:
        _check_planner(p)
    files = expand_paths(instances)
    if not files:
        raise ValueError("no instance files given")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / RESULTS
    done: dict[str, dict[str, Any]] = {}
    for row in read_rows(results):
        done.setdefault(row["key"], row)
    wanted = [(run_key(f, p, s), f, p, s) for f in files for p in planners for s in seeds]
    todo = [_Todo(*w) for w in dict((w[0], w) for w in wanted).values() if w[0] not in done]

    def finish(
        item: _Todo, info: dict[str, Any], result: dict[str, Any], wall: float, started: str
    ) -> None:
        row: dict[str, Any] = dict.fromkeys(FIELDS)
        row.update(
            key=item.key,
            instance=Path(item.file).name.removesuffix(".gz").removesuffix(".json"),
            file=str(item.file),
            planner=item.planner,
            seed=item.seed,
            runtime_s=wall,
            started_at=started,
            version=__version__,
            validated=False,
        )
        row.update(info)
        row.update(result)
        row["wall_s"] = wall
        done[item.key] = row
        _append(results, row)
        logger.info(
            "bench: %s %s seed %s: %s in %.1f s",
            row["instance"],
            item.planner,
            item.seed,
            row["status"],
            wall,
        )

    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not progress,
    ) as bar:
        task = bar.add_task("bench", total=len(todo))

        def started(item: _Todo) -> None:
            bar.update(task, description=f"{Path(item.file).name} {item.planner} seed {item.seed}")

        def finished(*args: Any) -> None:
            finish(*args)
            bar.advance(task)

        if backend == "ray":
            from .bench_ray import execute

            execute(todo, time_limit, timeout, workers, ray_address, started, finished)
        else:
            _execute_local(todo, time_limit, timeout, workers or 1, started, finished)
    rows = [done[k] for k in dict.fromkeys(w[0] for w in wanted)]
    write_csv(rows, out / "results.csv")
    (out / "summary.md").write_text(summary(rows) + "\n", encoding="utf-8")
    plot(rows, out)
    if best_known is not None:
        update_best_known(rows, best_known)
    return rows


def update_best_known(
    rows: list[dict[str, Any]], best_known: Path | Literal["auto"]
) -> dict[Path, list[str]]:
    """Merge rows into best-known tables; returns the changes by table.

    ``best_known="auto"`` sends each row to its file's default table
    (:func:`ntp_opt.best_known.default_path`); rows of files without one are
    left out.
    """
    from . import best_known as bk

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


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _timeout_row(timeout: float) -> dict[str, Any]:
    return {"status": "timeout", "message": f"killed after the {timeout:g} s timeout"}


def _execute_local(
    todo: list[_Todo],
    time_limit: float,
    timeout: float,
    workers: int,
    on_start: Callable[[_Todo], None],
    on_finish: Callable[..., None],
) -> None:
    """Run ``todo`` in a local process pool, at most ``workers`` at once."""
    todo = list(todo)
    ctx = _context()
    running: list[_Run] = []
    try:
        while todo or running:
            while todo and len(running) < workers:
                item = todo.pop(0)
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker,
                    args=(send, str(item.file), item.planner, item.seed, time_limit),
                    daemon=True,
                )
                now = time.monotonic()
                proc.start()
                send.close()
                running.append(_Run(item, proc, recv, now, now + timeout, _now()))
                on_start(item)
            wait_s = max(0.0, min(r.deadline for r in running) - time.monotonic())
            wait([r.conn for r in running] + [r.proc.sentinel for r in running], wait_s)
            for run in list(running):
                result = _collect(run)
                if result is None and time.monotonic() >= run.deadline:
                    run.proc.kill()
                    result = _timeout_row(timeout)
                if result is None:
                    continue
                run.proc.join()
                run.conn.close()
                running.remove(run)
                on_finish(run.item, run.info, result, time.monotonic() - run.start, run.started_at)
    finally:
        for run in running:  # interrupted: leave no worker behind
            run.proc.kill()
            run.proc.join()


@dataclass
class _Run:
    item: _Todo
    proc: BaseProcess
    conn: Connection
    start: float
    deadline: float
    started_at: str
    info: dict[str, Any] = field(default_factory=dict)


def _collect(run: _Run) -> dict[str, Any] | None:
    """The worker's final row if it has sent one, an error if it died, else None."""
    try:
        while run.conn.poll():
            kind, payload = run.conn.recv()
            if kind == "info":
                run.info = payload
            else:
                return dict(payload)
    except (EOFError, OSError):
        pass
    if not run.proc.is_alive():
        run.proc.join()
        return {"status": "error", "message": f"worker exited with code {run.proc.exitcode}"}
    return None


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """All rows as CSV, written to a temporary file and renamed (atomic)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(FIELDS), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


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
        status = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in statuses.items())
        lines.append(
            f"| {inst} | {_num(rs[0].get('gpus'), 'd')} | {_num(rs[0].get('failed'), 'd')} "
            f"| {planner} | {len(rs)} | {_num(goodput, '.4f')} "
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
    groups = _groups(rows)
    instances = list(dict.fromkeys(k[0] for k in groups))
    planners = list(dict.fromkeys(k[1] for k in groups))
    written = []

    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(instances) * len(planners) ** 0.5), 4))
    width = 0.8 / max(1, len(planners))
    for j, p in enumerate(planners):
        ys = []
        for inst in instances:
            vals = [
                r["relative_goodput"]
                for r in groups.get((inst, p), [])
                if r["relative_goodput"] is not None
            ]
            ys.append(_mean(vals) or 0.0)
        ax.bar([i + j * width for i in range(len(instances))], ys, width, label=p)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(instances))], instances, rotation=30)
    ax.set_ylabel("relative goodput")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize="small")
    fig.tight_layout()
    written.append(out / "goodput.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 4))
    for p in planners:
        pts = [
            (r["gpus"], r["runtime_s"])
            for r in rows
            if r["planner"] == p and r.get("gpus") and r.get("runtime_s") is not None
        ]
        if pts:
            ax.scatter([x for x, _ in pts], [y for _, y in pts], label=p, s=16)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("time s")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    written.append(out / "time_vs_size.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    written.append(plot_gap(rows, out / "gap.png", plt))
    return written


GAP_FLOOR = 1e-6
"""Gaps below this are drawn at this value in ``gap.png`` (log scale; 0 = proven optimal)."""


def plot_gap(rows: list[dict[str, Any]], path: Path, plt: Any) -> Path:
    """``gap.png``: gap against run time per planner, and the share of runs within each gap.

    Left: one point per run that has a gap (exact planners), time on the x
    axis; gaps below :data:`GAP_FLOOR` (proven optimal) sit on the floor line.
    Right: for each planner, the share of its runs (of every status) whose gap
    is at most g, against g; runs without a gap (timeouts, errors, no bound)
    never count.
    """
    planners = list(dict.fromkeys(str(r["planner"]) for r in rows))
    with_gap = [
        p for p in planners if any(r.get("gap") is not None for r in rows if r["planner"] == p)
    ]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for p in with_gap:
        pts = [
            (float(r["runtime_s"]), max(GAP_FLOOR, float(r["gap"])))
            for r in rows
            if r["planner"] == p and r.get("gap") is not None and r.get("runtime_s") is not None
        ]
        left.scatter([x for x, _ in pts], [y for _, y in pts], label=p, s=16)
        runs = [r for r in rows if r["planner"] == p]
        gaps = sorted(max(GAP_FLOOR, float(r["gap"])) for r in runs if r.get("gap") is not None)
        xs = [GAP_FLOOR, *gaps, 1.0]
        ys = [sum(g <= x for g in gaps) / len(runs) for x in xs]
        right.step(xs, ys, where="post", label=p)
    left.axhline(GAP_FLOOR, color="grey", lw=0.5, ls=":")
    left.set_ylim(GAP_FLOOR / 3, 1.5)
    left.set_yscale("log")
    left.set_xscale("log")
    right.set_xscale("log")
    right.set_xlim(GAP_FLOOR / 3, 1.5)
    left.set_xlabel("time s")
    left.set_ylabel(f"gap (floor {GAP_FLOOR:g} = proven)")
    right.set_xlabel("gap g")
    right.set_ylabel("share of runs with gap <= g")
    right.set_ylim(0, 1.02)
    if not with_gap:
        left.text(0.5, 0.5, "no run has a gap", ha="center", transform=left.transAxes)
    else:
        left.legend(fontsize="small")
        right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
