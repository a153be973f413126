"""The risk-aware search's exact scorer: expected goodput replica by replica.

:class:`FastScorer` scores a candidate plan, given as a
:class:`~ntp_opt.model.layout.Layout` (index space), on the training
scenarios with the recourse steps of :mod:`ntp_opt.rules.recourse`, caching
per replica; ``docs/risk.md`` gives the two conditions under which it equals
:func:`ntp_opt.rules.recourse.adapt` (it checks them, see
:meth:`FastScorer.eligible`).
"""

from __future__ import annotations

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import Layout
from ntp_opt.planners.riskaware.scenarios import Scenarios
from ntp_opt.rules import goodput as gp
from ntp_opt.rules.recourse import replica_degree, stage_after

__all__ = ["FastScorer", "StageIx", "refills_keep_power", "replica_stages"]

#: A stage in index space: domain index, GPU indices (plan order), power multiplier.
StageIx = tuple[int, np.ndarray, float]


def replica_stages(layout: Layout) -> list[list[StageIx]]:
    """Per replica of ``layout``, its stages as :data:`StageIx` (views of its arrays).

    Parameters
    ----------
    layout
        A layout whose stages are in replica order (as :meth:`Layout.from_plan` gives).

    Returns
    -------
    list of list of StageIx
    """
    out: list[list[StageIx]] = [[] for _ in range(layout.n_replicas)]
    domain, power = layout.domain.tolist(), layout.power.tolist()
    for s, r in enumerate(layout.replica.tolist()):
        out[r].append((domain[s], layout.stage_gpus(s), power[s]))
    return out


def _fastest_first(speed: np.ndarray, gpus: np.ndarray) -> np.ndarray:
    """``gpus`` sorted fastest first, ties by index (the recourse's pool order)."""
    return gpus[np.lexsort((gpus, -speed[gpus]))]


def refills_keep_power(instance: Instance) -> bool:
    """Whether every domain lies in one rack with one TDP and one board limit.

    Then a GPU that recourse takes from a domain's pool replaces a failed GPU
    of the same stage, rack and TDP, at a power multiplier no higher than
    before: no rack's or the site's draw rises when failed GPUs are counted
    at their idle draw (``docs/risk.md``).
    """
    a = instance.arrays
    caps = instance.max_multiplier
    return all(
        len(np.unique(a.gpu_rack[m])) <= 1
        and len(np.unique(a.tdp[m])) <= 1
        and len(np.unique(caps[m])) <= 1
        for m in a.domain_gpus
    )


class FastScorer:
    """The training objective of a layout, replica by replica (``docs/risk.md``).

    Parameters
    ----------
    instance
        The instance.
    scenarios
        The training scenarios (failed GPU indices and weights).

    Exact, not an approximation, under two conditions it checks: every domain
    lies in one rack with one TDP (then a refill never raises a rack's draw,
    so the power rule of the recourse cannot fire on a feasible plan) and no
    domain hosts stages of two replicas (then a replica's recourse depends
    only on the failures inside its own domains). Replica outcomes (degree and
    speed, or dropped) are cached across candidate plans by the replica and
    its failures, and scenario goodputs by the tuple of replica outcomes, so
    a move that changes two replicas re-adapts only those two.
    """

    def __init__(self, instance: Instance, scenarios: Scenarios) -> None:
        a = instance.arrays
        self.instance = instance
        self.job = instance.job
        self.weights = scenarios.weights
        self.by_domain: list[dict[int, np.ndarray]] = []
        for g in scenarios.gpus:
            doms = a.gpu_domain[g]
            self.by_domain.append({int(d): g[doms == d] for d in np.unique(doms)})
        self.domain_ok = refills_keep_power(instance)
        self._dead = np.zeros(a.n_gpus, dtype=bool)
        self.replica_memo: dict[tuple[object, ...], tuple[int, float] | None] = {}
        self.value_memo: dict[tuple[tuple[int, float] | None, ...], float] = {}

    def eligible(self, layout: Layout) -> bool:
        """Whether :meth:`value` is exact for ``layout``.

        Parameters
        ----------
        layout
            The candidate plan in index space.

        Returns
        -------
        bool
            Every domain lies in one rack with one TDP and one board limit,
            and no domain hosts stages of two replicas.
        """
        if not self.domain_ok:
            return False
        owner: dict[int, int] = {}
        for d, r in zip(layout.domain.tolist(), layout.replica.tolist(), strict=True):
            if owner.setdefault(d, r) != r:
                return False
        return True

    def _replica(
        self, t_r: int, stages: list[StageIx], failed: np.ndarray
    ) -> tuple[int, float] | None:
        """Recourse of one replica whose domains no other replica uses (recourse steps 2-3).

        :func:`ntp_opt.rules.recourse.replica_degree` and
        :func:`ntp_opt.rules.recourse.stage_after` on this replica's pools.
        """
        a, job = self.instance.arrays, self.job
        speed = a.speed
        powers = [p for _, _, p in stages]
        dead = self._dead
        dead[failed] = True
        try:
            survivors = [g[~dead[g]] for _, g, _ in stages]
            if all(len(sv) == t_r for sv in survivors):
                mins = [float(speed[sv].min()) for sv in survivors]
                return t_r, gp.replica_speed(job, t_r, mins, powers)
            for _, g, _ in stages:
                dead[g] = True  # in use: not in a pool
            pools: dict[int, np.ndarray] = {}
            for d, _, _ in stages:
                if d not in pools:
                    m = a.domain_gpus[d]
                    pools[d] = _fastest_first(speed, m[a.healthy[m] & ~dead[m]])
        finally:
            dead[failed] = False
            for _, g, _ in stages:
                dead[g] = False
        doms = [d for d, _, _ in stages]
        t_new = replica_degree(job.allowed, t_r, doms, survivors, lambda d: len(pools[d]))
        if t_new is None:
            return None
        mins = []
        for d, s in zip(doms, survivors, strict=True):
            stage, back, take = stage_after(speed, s, t_new, pools[d])
            mins.append(float(speed[stage].min()))
            if len(back):
                pools[d] = _fastest_first(speed, np.concatenate([pools[d], back]))
            pools[d] = pools[d][take:]
        return t_new, gp.replica_speed(job, t_new, mins, powers)

    def value(self, layout: Layout) -> float:
        """Weighted goodput after recourse over the scenarios.

        Parameters
        ----------
        layout
            The candidate plan in index space; ``eligible(layout)`` must hold.

        Returns
        -------
        float
            The training objective (sequences per second).
        """
        job = self.job
        reps = []
        for t, st in zip(layout.degree.tolist(), replica_stages(layout), strict=True):
            sig = (t, tuple((d, g.tobytes(), p) for d, g, p in st))
            doms = sorted({d for d, _, _ in st})
            reps.append((sig, doms, t, st))
        total = 0.0
        for hits, w in zip(self.by_domain, self.weights, strict=True):
            outs: list[tuple[int, float] | None] = []
            for sig, doms, t, st in reps:
                parts = [hits[d] for d in doms if d in hits]
                failed = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
                key = (sig, failed.tobytes())
                if key not in self.replica_memo:
                    self.replica_memo[key] = self._replica(t, st, failed)
                outs.append(self.replica_memo[key])
            okey = tuple(outs)
            value = self.value_memo.get(okey)
            if value is None:
                live = [o for o in outs if o is not None]
                tps, speeds = [o[0] for o in live], [o[1] for o in live]
                split = gp.split_batch(job, speeds, tps) if live else None
                value = gp.goodput(job, tps, list(split.batches), speeds) if split else 0.0
                self.value_memo[okey] = value
            total += w * value
        return total
