"""Small instances built from the topology presets, and settings shared by the tests."""

from __future__ import annotations

import os
import threading
from typing import Any

from ntp_opt.model import topology
from ntp_opt.model.control import SolveProgress
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.plan import Plan
from ntp_opt.planners.base import Planner, RunOptions
from ntp_opt.rules.validate import certified


def planned(planner: Planner, instance: Instance, options: RunOptions = RunOptions()) -> Plan:
    """``planner``'s plan of ``instance``, checked, with the validator's metrics (as ``solve``)."""
    return certified(instance, planner(instance, options).require_plan())


def make_instance(
    *,
    domains: int = 8,
    size: int = 8,
    tray: int = 4,
    trays_per_rack: int | None = None,
    failed: int = 0,
    stragglers: int = 0,
    rack_power_factor: float = 1.0,
    seed: int = 0,
    name: str = "small",
    **job: Any,
) -> Instance:
    """A small homogeneous cluster with random failures and a job."""
    g = topology.build_cluster(
        domains,
        size,
        tray,
        trays_per_rack or size // tray,
        rack_power_factor=rack_power_factor,
    )
    if failed:
        topology.fail_random(g, count=failed, seed=seed)
    if stragglers:
        topology.add_stragglers(g, count=stragglers, speed=(0.5, 0.95), seed=seed + 1)
    spec: dict[str, Any] = {"tp": size, "pp": 2, "dp": domains // 2, "global_batch": 4 * domains}
    spec.update(job)
    return Instance(name, g, Job(**spec))


#: Time limit (seconds) for exact solves in the tests that must finish: it only
#: guards against a hang and is never reached, even on a loaded machine, so no
#: assertion depends on how fast the machine is (docs/testing.md).
HANG_GUARD = 600.0


#: Whether the ``thorough`` hypothesis profile is active (``HYPOTHESIS_PROFILE``,
#: tests/conftest.py): seeded tests then run every seed, not the ``ci`` share.
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "thorough"


def seeds(n: int, ci_step: int) -> range:
    """Seeds ``0..n-1`` under the ``thorough`` profile; every ``ci_step``-th on ``ci``.

    For parametrized tests that repeat one check on many random instances: the
    quick default run keeps a spread of them, the thorough run all (docs/testing.md).
    """
    return range(n) if THOROUGH else range(0, n, ci_step)


def stop_at_first_plan() -> dict[str, Any]:
    """``solve()`` arguments that stop an exact search soon after its first plan.

    The callback sets the cancel token at the first report carrying an
    incumbent; the search stops at its next check (``limit="interrupted"``) and
    returns its best plan so far. For checks that hold for any plan the search
    returns, on instances it cannot prove quickly: event-driven, unlike a time
    limit, whose CPU cost grows with the machine's speed. ``HANG_GUARD`` stays
    as the time limit.
    """
    cancel = threading.Event()

    def callback(progress: SolveProgress) -> None:
        if progress.incumbent is not None:
            cancel.set()

    return {"callback": callback, "cancel": cancel, "time_limit": HANG_GUARD}


class StepClock:
    """A ``time.perf_counter`` that advances ``step`` seconds per reading.

    Installed over ``time.perf_counter`` (``monkeypatch.setattr(time,
    "perf_counter", StepClock())``), it makes a planner's time limit run out
    after a fixed number of its own clock readings, whatever the machine's
    speed or load: a time-limit test then depends on no wall clock.
    """

    def __init__(self, step: float = 0.05) -> None:
        self.now = 0.0
        self.step = step
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        self.now += self.step
        return self.now
