"""Small instances built from the topology presets, shared by the tests."""

from __future__ import annotations

from typing import Any

from ntp_opt.model import topology
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job


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
