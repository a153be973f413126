"""Batch runner: every planner on every instance with every seed (``ntp-opt bench``).

Each (instance file, planner, seed) is one *run* with a stable key. A run
executes in its own worker process with a hard wall-clock timeout: a process
that overruns is killed and the run is recorded with status ``"timeout"``. A
run that raises (a bad file, a planner error) is recorded with status
``"error"`` and the message; nothing is raised to the caller.

Rows are appended to ``OUT/results.jsonl``, one JSON object per line, each
followed by ``flush`` and ``fsync``. On start the file is read back: a
truncated last line (a run killed mid-write) is cut off, and every key already
present is skipped, so an interrupted bench resumes without losing or
duplicating rows. See ``docs/bench.md``.

Besides the built-in planner names (:data:`ntp_opt.solve.PLANNERS`), a planner
may be given as ``"package.module:function"``: the worker imports it and calls
``function(instance, time_limit=..., seed=...)``, which must return a
:class:`~ntp_opt.solve.Result`. The tests use this to run a planner that sleeps.
"""

from __future__ import annotations

import csv
import importlib
import json
import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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
    "message",
)
"""Every field of a result row, in CSV column order."""


def run_key(file: Path, planner: str, seed: int) -> str:
    """The stable key of one run: resolved file path, planner and seed."""
    return f"{Path(file).resolve()}|{planner}|{seed}"


def expand_paths(paths: list[Path]) -> list[Path]:
    """Files as given; a directory becomes its ``*.json`` and ``*.json.gz`` files, sorted."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(q for q in p.iterdir() if q.name.endswith((".json", ".json.gz"))))
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


def _worker(conn: Connection, file: str, planner: str, seed: int, time_limit: float) -> None:
    """Body of a worker process: sends ``("info", {...})`` then ``("row", {...})``."""
    row: dict[str, Any] = {}
    try:
        from .files import load_instance

        instance = load_instance(file)
        s = instance.summary()
        info = {"instance": s["name"], "gpus": s["gpus"], "failed": s["failed"]}
        conn.send(("info", info))
        res = _planner(planner)(instance, time_limit=time_limit, seed=seed)
        job = instance.job
        bound = None if res.bound is None else res.bound * job.seq_time_s / job.dp
        row = {
            "status": str(res.status),
            "limit": str(res.limit),
            "relative_goodput": res.relative_objective,
            "bound": bound,
            "gap": res.gap,
            "runtime_s": res.runtime_s,
            "message": res.reason,
        }
    except Exception as err:  # recorded, never raised
        row = {"status": "error", "message": f"{type(err).__name__}: {err}"}
    conn.send(("row", row))
    conn.close()


@dataclass
class _Run:
    key: str
    file: Path
    planner: str
    seed: int
    proc: BaseProcess
    conn: Connection
    start: float
    deadline: float
    started_at: str
    info: dict[str, Any] = field(default_factory=dict)


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


def run_bench(
    instances: list[Path],
    planners: list[str],
    seeds: list[int],
    out: Path,
    *,
    time_limit: float,
    timeout: float,
    workers: int = 1,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run every planner on every instance with every seed; resume from ``out``.

    Returns one row per requested run (already recorded or new), in
    instance, planner, seed order. Also writes ``out/results.csv``,
    ``out/summary.md`` and, with matplotlib, the plots of :func:`plot`.
    """
    from . import __version__

    if workers < 1:
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
    todo = [w for w in dict((w[0], w) for w in wanted).values() if w[0] not in done]
    ctx = _context()
    running: list[_Run] = []

    def finish(run: _Run, result: dict[str, Any]) -> None:
        wall = time.monotonic() - run.start
        row: dict[str, Any] = dict.fromkeys(FIELDS)
        row.update(
            key=run.key,
            instance=Path(run.file).name.split(".")[0],
            file=str(run.file),
            planner=run.planner,
            seed=run.seed,
            runtime_s=wall,
            started_at=run.started_at,
            version=__version__,
        )
        row.update(run.info)
        row.update(result)
        row["wall_s"] = wall
        done[run.key] = row
        _append(results, row)

    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=not progress,
    ) as bar:
        task = bar.add_task("bench", total=len(todo))
        try:
            while todo or running:
                while todo and len(running) < workers:
                    key, f, p, s = todo.pop(0)
                    recv, send = ctx.Pipe(duplex=False)
                    proc = ctx.Process(
                        target=_worker, args=(send, str(f), p, s, time_limit), daemon=True
                    )
                    now = time.monotonic()
                    started = datetime.now(UTC).isoformat(timespec="seconds")
                    proc.start()
                    send.close()
                    running.append(_Run(key, f, p, s, proc, recv, now, now + timeout, started))
                    bar.update(task, description=f"{Path(f).name} {p} seed {s}")
                wait_s = max(0.0, min(r.deadline for r in running) - time.monotonic())
                wait([r.conn for r in running] + [r.proc.sentinel for r in running], wait_s)
                for run in list(running):
                    result = _collect(run)
                    if result is None and time.monotonic() >= run.deadline:
                        run.proc.kill()
                        result = {
                            "status": "timeout",
                            "message": f"killed after the {timeout:g} s timeout",
                        }
                    if result is None:
                        continue
                    run.proc.join()
                    run.conn.close()
                    running.remove(run)
                    finish(run, result)
                    bar.advance(task)
        finally:
            for run in running:  # interrupted: leave no worker behind
                run.proc.kill()
                run.proc.join()
    rows = [done[k] for k in dict.fromkeys(w[0] for w in wanted)]
    write_csv(rows, out / "results.csv")
    (out / "summary.md").write_text(summary(rows) + "\n", encoding="utf-8")
    plot(rows, out)
    return rows


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
    """Write ``goodput.png`` and ``time_vs_size.png`` into ``out``; returns the files.

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
    return written
