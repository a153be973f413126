"""Instances built to show risk-aware planning (``docs/risk.md``).

:func:`risk_instance` builds each of :data:`RISK_INSTANCES` from the topology
builders and a job; it is data of the model (a cluster with failure
probabilities and a job), so any layer, test or benchmark can build them.
The planner package :mod:`ntp_opt.planners.riskaware` re-exports both names.
"""

from __future__ import annotations

import networkx as nx
import numpy as np

from ntp_opt.model import topology
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job

__all__ = ["RISK_INSTANCES", "risk_instance"]

#: Names of the built instances of :func:`risk_instance`.
RISK_INSTANCES: tuple[str, ...] = ("spare-domains", "pack", "mixed", "mixed-fixed", "mixed-large")


def _set_tray_risk(
    g: nx.Graph, domains: list[int], p: float, trays: list[int] | None = None
) -> None:
    """Set ``p_fail`` of the trays of ``domains`` (only tray numbers ``trays``, if given)."""
    for d in domains:
        for t in topology.trays(g):
            if str(t).startswith(f"d{d}.") and (
                trays is None or int(str(t).split(".t")[1]) in trays
            ):
                g.nodes[t]["p_fail"] = p


def risk_instance(name: str) -> Instance:
    """An instance built to show risk-aware planning (see ``docs/risk.md``).

    Parameters
    ----------
    name
        One of :data:`RISK_INSTANCES`:

        * ``spare-domains``: 6 domains of 8 GPUs, TP8, PP2, DP2 (2 spare
          domains); trays of ``d0`` and ``d2`` fail with probability 0.05.
          Exact expectation (4 failure units).
        * ``pack``: 8 domains of 8, TP8, PP2, DP4 (no spare domain); one tray
          of each of ``d0, d2, d4, d6`` fails with probability 0.1. Exact.
        * ``mixed``: 20 domains of 36 GPUs (one rack each), TP32 (28..32),
          PP4, DP4 (4 spare domains); 5 risky racks (tray ``p_fail`` 0.02),
          12 risky GPUs (``p_fail`` 0.05) and every GPU at 2e-4. Elastic.
        * ``mixed-fixed``: ``mixed`` under the ``fixed`` policy with local
          batches up to twice nominal.
        * ``mixed-large``: 64 domains of 36, TP32, PP8, DP7 (8 spare
          domains), 12 risky racks, 48 risky GPUs, base 2e-4. Elastic.

    Returns
    -------
    Instance
    """
    rng = np.random.default_rng(7)
    if name == "spare-domains":
        g = topology.build_cluster(6, 8, 4, 2, name=name)
        _set_tray_risk(g, [0, 2], 0.05)
        job = Job(tp=8, pp=2, dp=2, global_batch=16, batch_policy="elastic")
    elif name == "pack":
        g = topology.build_cluster(8, 8, 4, 2, name=name)
        _set_tray_risk(g, [0, 2, 4, 6], 0.1, trays=[0])
        job = Job(tp=8, pp=2, dp=4, global_batch=32, batch_policy="elastic")
    elif name in ("mixed", "mixed-fixed", "mixed-large"):
        large = name == "mixed-large"
        n_dom, pp, dp, n_racks, n_gpus_risky = (64, 8, 7, 12, 48) if large else (20, 4, 4, 5, 12)
        g = topology.build_cluster(n_dom, 36, 4, 9, name=name)
        topology.set_p_fail(g, 2e-4)
        risky_doms = sorted(rng.choice(n_dom, size=n_racks, replace=False).tolist())
        _set_tray_risk(g, risky_doms, 0.02)
        ids = topology.gpus(g)
        picks = rng.choice(len(ids), size=n_gpus_risky, replace=False)
        topology.set_p_fail(g, 0.05, [ids[i] for i in sorted(picks.tolist())])
        b = 8 * dp
        if name == "mixed-fixed":
            job = Job(tp=32, pp=pp, dp=dp, global_batch=b, batch_policy="fixed", max_local_batch=16)
        else:
            job = Job(tp=32, pp=pp, dp=dp, global_batch=b, batch_policy="elastic")
    else:
        raise ValueError(f"name must be one of {RISK_INSTANCES}, got {name!r}")
    return Instance(
        name, g, job, {"builder": "ntp_opt.model.risk_instances.risk_instance", "name": name}
    )
