"""Local backend of the batch runner (``ntp-opt bench``, the default ``--backend process``).

Each run is one ``multiprocessing`` process (``fork`` where available, else
``spawn``) that sends what :func:`ntp_opt.app.runs.run_steps` yields through a
pipe; at most ``workers`` run at once, and one still going ``timeout`` seconds
after it started is killed and recorded as a ``timeout``. Only the driver
writes files (:mod:`ntp_opt.app.bench`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from ntp_opt.app.runs import OnFinish, OnStart, Todo, run_steps, timeout_row, utc_now

__all__ = ["execute"]


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent (the driver) dies.

    Elsewhere a no-op: the driver's ``finally`` still kills its workers on any
    exit it survives (exceptions, SIGINT, SIGTERM).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # pragma: no cover - no prctl
        return
    if os.getppid() != parent:  # the driver died before prctl took effect
        os._exit(1)


def _worker(
    conn: Connection,
    file: str,
    planner: str,
    seed: int,
    time_limit: float,
    parent: int | None = None,
) -> None:
    """Body of a worker process: sends what :func:`run_steps` yields through ``conn``."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the CLI's handler (forked): just die
    if parent is not None:
        _die_with_parent(parent)
    for message in run_steps(file, planner, seed, time_limit):
        conn.send(message)
    conn.close()


def _context() -> Any:
    # fork is fast (no re-import per run); spawn where fork does not exist.
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


def execute(
    todo: list[Todo],
    time_limit: float,
    timeout: float,
    workers: int,
    on_start: OnStart,
    on_finish: OnFinish,
) -> None:
    """Run ``todo`` in a local process pool, at most ``workers`` at once.

    Parameters
    ----------
    todo
        The runs, started in order.
    time_limit
        The planner's own time limit in seconds.
    timeout
        Hard wall-clock seconds per run, after which its process is killed.
    workers
        Processes at once.
    on_start, on_finish
        Called in this process when a run starts and when it has its row.
    """
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
                    args=(send, str(item.file), item.planner, item.seed, time_limit, os.getpid()),
                    daemon=True,
                )
                now = time.monotonic()
                proc.start()
                send.close()
                running.append(_Run(item, proc, recv, now, now + timeout, utc_now()))
                on_start(item)
            wait_s = max(0.0, min(r.deadline for r in running) - time.monotonic())
            wait([r.conn for r in running] + [r.proc.sentinel for r in running], wait_s)
            for run in list(running):
                result = _collect(run)
                if result is None and time.monotonic() >= run.deadline:
                    run.proc.kill()
                    result = timeout_row(timeout)
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
    item: Todo
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
