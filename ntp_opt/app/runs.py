"""One run of the batch runner, shared by its backends (``bench``, ``bench_ray``).

A *run* is one (instance file, planner, seed). :func:`run_steps` is what a
worker (a local process or a Ray task) executes: it yields the instance's size
once it has loaded, then the run's result row. The driver side keeps a
:class:`Todo` per run still to do, stamps the start with :func:`utc_now`, and
records a run it killed at its hard timeout with :func:`timeout_row`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

Message = tuple[str, dict[str, Any]]
"""What a run yields: ``("info", {...})`` or ``("row", {...})``."""


@dataclass
class Todo:
    """One run still to do: its key (:func:`ntp_opt.app.bench.run_key`), file, planner, seed."""

    key: str
    file: Path
    planner: str
    seed: int


OnStart = Callable[[Todo], None]
"""Called by a backend when it starts a run."""

OnFinish = Callable[[Todo, dict[str, Any], dict[str, Any], float, str], None]
"""Called by a backend when a run ends: ``(item, info, result, wall_s, started_at)``."""


def check_planner(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a known planner or a ``module:function``."""
    from ntp_opt.solve import PLANNERS

    if name not in PLANNERS and ":" not in name:
        raise ValueError(
            f"unknown planner {name!r}; known: {', '.join(PLANNERS)} (or module:function)"
        )


def planner_function(name: str) -> Callable[..., Any]:
    """The callable ``(instance, time_limit=..., seed=...) -> Result`` of a planner name."""
    from ntp_opt.solve import solve

    if ":" not in name:
        return lambda inst, time_limit, seed: solve(inst, name, time_limit=time_limit, seed=seed)
    module, func = name.split(":", 1)
    planner: Callable[..., Any] = getattr(importlib.import_module(module), func)
    return planner


def run_steps(file: str, planner: str, seed: int, time_limit: float) -> Iterator[Message]:
    """One run: yields ``("info", {...})`` once the instance loaded, then ``("row", {...})``.

    The row's goodput is the validator's: built-in planners return checked
    plans (:func:`ntp_opt.solve.solve`), a ``module:function`` planner's plan
    is checked here (``validated`` says so; a plan that fails the check is an
    ``error`` row).
    """
    row: dict[str, Any] = {}
    try:
        from ntp_opt.app.best_known import file_sha256
        from ntp_opt.model.files import load_instance

        instance = load_instance(file)
        s = instance.summary()
        info = {
            "instance": s["name"],
            "gpus": s["gpus"],
            "failed": s["failed"],
            "sha256": file_sha256(file),
        }
        yield ("info", info)
        res = planner_function(planner)(instance, time_limit=time_limit, seed=seed)
        goodput = res.relative_objective
        if res.plan is not None and ":" in planner:  # never trust a custom planner
            from ntp_opt.rules.validate import check

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


def utc_now() -> str:
    """The current UTC time as ISO 8601 to the second (a row's ``started``)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def timeout_row(timeout: float) -> dict[str, Any]:
    """The result fields of a run killed at its hard ``timeout`` (seconds)."""
    return {"status": "timeout", "message": f"killed after the {timeout:g} s timeout"}
