"""Ray backend of the batch runner (``ntp-opt bench --backend ray``).

Each run is one Ray task, a streaming generator that yields what
:func:`ntp_opt.app.runs.run_steps` yields: the instance's size once it has loaded,
then the result row. The driver keeps at most ``workers`` tasks in flight
(default: the cluster's CPU count, one CPU per task) and starts a run's clock
when it submits the task, so a run that is still going ``timeout`` seconds
later is force-cancelled (``ray.cancel(force=True)`` kills its worker process)
and recorded as a ``timeout``. Tasks are never retried (``max_retries=0``): a
worker that dies is an ``error`` row. Only the driver writes files, so the
append-and-resume rules of :mod:`ntp_opt.app.bench` hold unchanged.

Needs the optional extra ``ray`` (``pip install 'ntp-opt[ray]'``). On a real
cluster every node must have ``ntp_opt`` (and any ``module:function``
planner) installed and see the instance files at the same path; see
``docs/bench.md``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ntp_opt.app.runs import Message, OnFinish, OnStart, Todo, run_steps, timeout_row, utc_now


def _task(file: str, planner: str, seed: int, time_limit: float) -> Iterator[Message]:
    """Body of the Ray task: the steps of one run."""
    yield from run_steps(file, planner, seed, time_limit)


@dataclass
class _Flight:
    item: Todo
    gen: Any
    start: float
    deadline: float
    started_at: str
    info: dict[str, Any] = field(default_factory=dict)


def _connect(ray: Any, address: str | None) -> bool:
    """Initialise Ray unless it already is; True if this call started it."""
    if ray.is_initialized():
        return False
    if address is None:
        ray.init(include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    return True


def execute(
    todo: list[Todo],
    time_limit: float,
    timeout: float,
    workers: int | None,
    address: str | None,
    on_start: OnStart,
    on_finish: OnFinish,
) -> None:
    """Run ``todo`` as Ray tasks; calls ``on_finish(item, info, row, wall_s, started_at)``.

    Raises
    ------
    ImportError
        If ``ray`` is not installed (with the command that installs it).
    """
    try:
        import ray
    except ImportError as err:
        raise ImportError("the ray backend needs ray: pip install 'ntp-opt[ray]'") from err
    started_ray = _connect(ray, address)
    remote = ray.remote(num_cpus=1, max_retries=0)(_task)
    if workers is None:
        workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
    todo = list(todo)
    flights: list[_Flight] = []
    try:
        while todo or flights:
            while todo and len(flights) < workers:
                item = todo.pop(0)
                gen = remote.remote(str(item.file), item.planner, item.seed, time_limit)
                now = time.monotonic()
                flights.append(_Flight(item, gen, now, now + timeout, utc_now()))
                on_start(item)
            wait_s = max(0.0, min(f.deadline for f in flights) - time.monotonic())
            ray.wait([f.gen for f in flights], num_returns=1, timeout=wait_s)
            for f in list(flights):
                result = _poll(ray, f)
                if result is None and time.monotonic() >= f.deadline:
                    ray.cancel(f.gen, force=True)
                    result = timeout_row(timeout)
                if result is None:
                    continue
                flights.remove(f)
                on_finish(f.item, f.info, result, time.monotonic() - f.start, f.started_at)
    finally:
        for f in flights:  # interrupted: cancel what is still running
            ray.cancel(f.gen, force=True)
        if started_ray:
            ray.shutdown()


def _poll(ray: Any, f: _Flight) -> dict[str, Any] | None:
    """The run's row if it has one by now, an error row if its task died, else None."""
    while True:
        ready, _ = ray.wait([f.gen], num_returns=1, timeout=0)
        if not ready:
            return None
        try:
            ref = next(f.gen)
            kind, payload = ray.get(ref)
        except StopIteration:
            return {"status": "error", "message": "task ended without a result"}
        except Exception as err:  # the worker died or was killed
            return {"status": "error", "message": f"{type(err).__name__}: {err}"[:500]}
        if kind == "info":
            f.info = payload
        else:
            return dict(payload)
