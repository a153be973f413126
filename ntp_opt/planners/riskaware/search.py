"""The risk-aware local search, in index space (``docs/risk.md``).

The search state is a :class:`~ntp_opt.model.layout.Layout`: every stage's
replica, domain, power and GPU indices. Node ids appear only when a candidate
becomes a :class:`~ntp_opt.model.plan.Plan` (:meth:`Search.plan`, through
:meth:`Layout.to_plan`). Five move families (:data:`FAMILIES`) change the
layout; :func:`local_search` keeps a move when it improves the training
objective, or ties it and lowers the summed failure probability of the GPUs
in use.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.instance import ClusterArrays, Instance
from ntp_opt.model.job import Job
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan
from ntp_opt.planners.riskaware.scenarios import Scenarios, objective
from ntp_opt.planners.riskaware.scorer import FastScorer
from ntp_opt.rules import goodput as gp
from ntp_opt.rules.power import board_over, over_budget, rack_and_site_draw
from ntp_opt.rules.tolerances import FLOAT_NOISE, PROB_CLIP

__all__ = ["FAMILIES", "Search", "local_search", "relocate"]

#: Relative improvement a move must bring to be accepted (guards against float noise).
_IMPROVE_TOL = FLOAT_NOISE

#: Move families in the order the search tries them.
FAMILIES: tuple[str, ...] = ("regroup", "stage", "gpu", "swap", "domains")


class Search:
    """Plans built from layouts, checked for power and nominal goodput, scored on scenarios.

    Parameters
    ----------
    instance
        The instance.
    scenarios
        The training scenarios.
    risk
        Per GPU, its failure probability (:func:`~ntp_opt.planners.riskaware.scenarios.gpu_risk`).
    min_nominal
        Least nominal goodput a candidate may have.
    deadline
        ``time.perf_counter()`` value at which the search stops (``None``: none).
    cancel
        Once set, the search stops at its next check.
    """

    def __init__(
        self,
        instance: Instance,
        scenarios: Scenarios,
        risk: np.ndarray,
        min_nominal: float,
        deadline: float | None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.instance = instance
        self.a = instance.arrays
        self.job: Job = instance.job
        self.scenarios = scenarios
        self.risk = risk
        self.min_nominal = min_nominal
        self.deadline = deadline
        self.fast = FastScorer(instance, scenarios)
        self.evaluations = 0
        self.timed_out = False
        self.cancel = cancel
        self.interrupted = False

    def expired(self) -> bool:
        """Whether the search must stop (cancel set, or deadline passed)."""
        if self.cancel is not None and self.cancel.is_set():
            self.interrupted = True
            return True
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.timed_out = True
        return self.timed_out

    def plan(self, layout: Layout) -> Plan | None:
        """The plan of ``layout`` with batches re-split, or ``None`` if it breaks a rule.

        Parameters
        ----------
        layout
            The candidate (its batches are ignored).

        Returns
        -------
        Plan or None
            The plan (metric ``policy`` only), or ``None`` when a board or
            power budget refuses it, the batch cannot be split, or its nominal
            goodput is below ``min_nominal``.
        """
        a, job = self.a, self.job
        if not self._power_ok(layout):
            return None
        tps = layout.degree.tolist()
        mins: list[list[float]] = [[] for _ in tps]
        powers: list[list[float]] = [[] for _ in tps]
        for r, _, g, p in layout.stages():
            mins[r].append(float(a.speed[g].min()))
            powers[r].append(p)
        speeds = [
            gp.replica_speed(job, t, m, pw) for t, m, pw in zip(tps, mins, powers, strict=True)
        ]
        split = gp.split_batch(job, speeds, tps)
        if split is None or (tps and split.goodput < self.min_nominal):
            return None
        done = dataclasses.replace(
            layout,
            batch=np.asarray([int(b) for b in split.batches], dtype=np.int64),
            metrics={"policy": "risk-aware"},
            instance=self.instance.name,
        )
        return done.to_plan(self.instance)

    def _power_ok(self, layout: Layout) -> bool:
        """The validator's board and budget checks (:mod:`ntp_opt.rules.power`)."""
        power_of = np.zeros(self.a.n_gpus)
        power_of[layout.gpus] = np.repeat(layout.power, np.diff(layout.offsets))
        if board_over(self.instance, power_of).any():
            return False  # a board refuses the stage's power limit
        racks, site = over_budget(self.instance, *rack_and_site_draw(self.instance, power_of))
        return not (racks.any() or site)

    def score(self, plan: Plan, layout: Layout) -> float:
        """The training objective of ``plan`` (whose layout is ``layout``).

        Exact either way: the fast scorer when it applies, else the recourse.
        """
        self.evaluations += 1
        if self.fast.eligible(layout):
            return self.fast.value(layout)
        return objective(self.instance, plan, self.scenarios)

    def gpus_risk(self, gpus: np.ndarray) -> float:
        """Probability that some GPU of ``gpus`` fails (independence over GPUs, an estimate)."""
        return float(-np.expm1(np.log1p(-np.minimum(self.risk[gpus], PROB_CLIP)).sum()))

    def stage_risk(self, layout: Layout, s: int) -> float:
        """:meth:`gpus_risk` of stage ``s`` (flat index) of ``layout``."""
        return self.gpus_risk(layout.stage_gpus(s))


def _with_stages(layout: Layout, changes: list[tuple[int, int, np.ndarray, float]]) -> Layout:
    """``layout`` with stages ``s`` set to ``(domain, gpus, power)`` (same GPU count each)."""
    domain, gpus, power = layout.domain.copy(), layout.gpus.copy(), layout.power.copy()
    off = layout.offsets
    for s, d, g, p in changes:
        assert len(g) == off[s + 1] - off[s]
        domain[s], power[s] = d, p
        gpus[off[s] : off[s + 1]] = g
    return dataclasses.replace(layout, domain=domain, gpus=gpus, power=power)


def _stage_key(s: Search, layout: Layout, speed_first: bool, k: int) -> tuple[float, ...]:
    """Sort key of stage ``k`` in :func:`_regroup` (then domain and first GPU: no ties)."""
    g = layout.stage_gpus(k)
    eff = float(layout.power[k]) ** s.job.power_exponent * float(s.a.speed[g].min())
    risk = s.gpus_risk(g)
    head = (-eff, -risk) if speed_first else (-risk, -eff)
    return (*head, int(layout.domain[k]), int(g[0]))


def _regroup(s: Search, layout: Layout, speed_first: bool) -> Layout:
    """Inside each degree, stages sorted and grouped ``pp`` at a time.

    Sorted by risk (riskiest first), or with ``speed_first`` by effective speed
    ``pi^alpha * slowest GPU`` (fastest first) and then risk, which keeps the
    nominal speeds of a plan whose stages differ in speed or power. Replicas
    come in decreasing degree.
    """
    pp = s.job.pp
    by_tp: dict[int, list[int]] = {}
    degree = layout.degree.tolist()
    for k, r in enumerate(layout.replica.tolist()):
        by_tp.setdefault(degree[r], []).append(k)
    key = functools.partial(_stage_key, s, layout, speed_first)
    order: list[int] = []
    replica: list[int] = []
    stage: list[int] = []
    degrees: list[int] = []
    for t in sorted(by_tp, reverse=True):
        stages = sorted(by_tp[t], key=key)
        for i in range(0, len(stages), pp):
            group = stages[i : i + pp]
            replica.extend([len(degrees)] * len(group))
            stage.extend(range(len(group)))
            degrees.append(t)
            order.extend(group)
    sizes = np.diff(layout.offsets)[order]
    offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    parts = [layout.stage_gpus(k) for k in order]
    return dataclasses.replace(
        layout,
        replica=np.asarray(replica, dtype=np.int64),
        stage=np.asarray(stage, dtype=np.int64),
        domain=layout.domain[order],
        offsets=offsets,
        gpus=np.concatenate(parts) if parts else np.empty(0, dtype=np.int64),
        power=layout.power[order],
        degree=np.asarray(degrees, dtype=np.int64),
        batch=np.zeros(len(degrees), dtype=np.int64),  # re-split by Search.plan
    )


def _free(s: Search, layout: Layout) -> np.ndarray:
    """Per GPU: healthy and used by no stage."""
    used = np.zeros(s.a.n_gpus, dtype=bool)
    used[layout.gpus] = True
    return s.a.healthy & ~used


@dataclass(frozen=True)
class _Move:
    """What to change; :func:`_apply` turns it into a new layout.

    ``regroup`` (by risk; with ``speed_first`` by speed, then risk); ``stage``
    (stage ``s``, a flat index, moves to ``domain`` and ``gpus`` with ``power``);
    ``gpu`` (GPU ``old`` of stage ``s`` swapped for the free GPU ``new``);
    ``swap`` (stages ``s`` and ``s2`` of different replicas exchanged);
    ``domains`` (the stages of domains ``old`` and ``new`` exchanged).
    """

    kind: str
    s: int = 0
    s2: int = 0
    old: int = 0
    new: int = 0
    speed_first: bool = False
    domain: int = 0
    gpus: np.ndarray | None = None
    power: float = 1.0


def _moves(s: Search, layout: Layout, family: str) -> list[_Move]:
    """The moves of one family from ``layout``, most promising first."""
    if family == "regroup":
        return [_Move("regroup"), _Move("regroup", speed_first=True)]
    if family == "stage":
        return _moves_stage(s, layout)
    if family == "gpu":
        return _moves_gpu(s, layout)
    if family == "domains":
        return _moves_domains(s, layout)
    return _moves_swap(s, layout)


def _moves_stage(s: Search, layout: Layout) -> list[_Move]:
    """Move a risky stage to the least risky free GPUs of another domain."""
    a = s.a
    free = _free(s, layout)
    moves: list[_Move] = []
    # flat stage order is (replica, stage) order
    spots = sorted((-s.stage_risk(layout, k), k) for k in range(layout.n_stages))
    for neg_risk, k in spots:
        if neg_risk == 0 or s.expired():
            break
        t = int(layout.degree[layout.replica[k]])
        d0, p0 = int(layout.domain[k]), float(layout.power[k])
        cands = []
        for d in range(a.n_domains):
            members = a.domain_gpus[d]
            pool = members[free[members]]
            if d == d0 or len(pool) < t:
                continue
            order = np.lexsort((pool, -a.speed[pool], s.risk[pool]))
            gpus = np.sort(pool[order[:t]])
            risk = s.gpus_risk(gpus)
            if risk < -neg_risk:
                cands.append((risk, d, gpus))
        cands.sort(key=lambda c: (c[0], c[1]))
        moves.extend(_Move("stage", k, domain=d, gpus=g, power=p0) for _, d, g in cands[:3])
    return moves


def _moves_gpu(s: Search, layout: Layout) -> list[_Move]:
    """Swap a used GPU for a free, less risky one of the same domain."""
    a = s.a
    free = _free(s, layout)
    moves: list[_Move] = []
    first = layout.stage.tolist()
    for k in range(layout.n_stages):
        if first[k] == 0 and s.expired():  # checked once per replica
            break
        d, g = int(layout.domain[k]), layout.stage_gpus(k)
        members = a.domain_gpus[d]
        pool = members[free[members]]
        if len(pool) == 0:
            continue
        for j in np.argsort(-s.risk[g], kind="stable"):
            old = int(g[j])
            better = pool[s.risk[pool] < s.risk[old]]
            if len(better) == 0:
                continue
            order = np.lexsort((better, -a.speed[better], s.risk[better]))
            moves.append(_Move("gpu", k, old=old, new=int(better[order[0]])))
    return moves


def _moves_swap(s: Search, layout: Layout) -> list[_Move]:
    """Swap two stages of different replicas with the same degree (one of them risky)."""
    moves: list[_Move] = []
    n = layout.n_stages
    replica = layout.replica.tolist()
    degree = layout.degree[layout.replica].tolist()
    risky = [s.stage_risk(layout, k) != 0 for k in range(n)]  # once per stage
    for i in range(n):
        if s.expired():  # quadratic in the stages: the deadline may come first
            break
        for j in range(i + 1, n):
            if replica[i] == replica[j] or degree[i] != degree[j]:
                continue
            if not risky[i] and not risky[j]:
                continue
            moves.append(_Move("swap", i, j))
    return moves


def _same_kind(a: ClusterArrays, g: int, h: int) -> bool:
    """GPUs ``g`` and ``h`` have the same speed, TDP and board limit."""
    return bool(
        a.speed[g] == a.speed[h] and a.tdp[g] == a.tdp[h] and a.max_power[g] == a.max_power[h]
    )


def _into(
    s: Search, layout: Layout, old: int, new: int
) -> list[tuple[int, int, np.ndarray, float]] | None:
    """The stages of domain ``old`` moved onto the healthy GPUs of domain ``new``.

    Each GPU maps to a GPU of ``new`` with the same speed, TDP and board
    limit, the least risky first (``new``'s own stages are assumed to leave);
    ``None`` when one has no match.
    """
    a = s.a
    pool = [int(g) for g in a.domain_gpus[new] if a.healthy[g]]
    pool.sort(key=lambda g: (float(s.risk[g]), g))
    changes = []
    for k in np.flatnonzero(layout.domain == old).tolist():
        gpus = []
        for g in layout.stage_gpus(k).tolist():
            pick = next((h for h in pool if _same_kind(a, g, h)), None)
            if pick is None:
                return None
            pool.remove(pick)
            gpus.append(pick)
        moved = np.sort(np.asarray(gpus, dtype=np.int64))
        changes.append((k, new, moved, float(layout.power[k])))
    return changes


def _moves_domains(s: Search, layout: Layout) -> list[_Move]:
    """Exchange the stages of two domains with the same healthy GPUs (one of them risky).

    Riskiest domain first; a pair of two unused domains changes nothing and
    is skipped.
    """
    a = s.a
    used = np.zeros(a.n_domains, dtype=bool)
    used[layout.domain] = True
    risk = np.array([s.gpus_risk(m) for m in a.domain_gpus])
    kind = [
        tuple(
            sorted(zip(a.speed[m].tolist(), a.tdp[m].tolist(), a.healthy[m].tolist(), strict=True))
        )
        for m in a.domain_gpus
    ]
    moves = []
    for d in np.argsort(-risk, kind="stable").tolist():
        if risk[d] <= 0:
            break
        for e in range(a.n_domains):
            if e != d and kind[e] == kind[d] and (used[d] or used[e]):
                moves.append(_Move("domains", old=d, new=e))
    return moves


def _apply(s: Search, layout: Layout, move: _Move) -> Layout | None:
    """``move`` applied to ``layout``, or ``None`` when it no longer applies."""
    if move.kind == "regroup":
        return _regroup(s, layout, speed_first=move.speed_first)
    if move.kind == "domains":
        there = _into(s, layout, move.old, move.new)
        back = _into(s, layout, move.new, move.old)
        if there is None or back is None:
            return None
        return _with_stages(layout, there + back)
    k = move.s
    if move.kind == "stage":
        assert move.gpus is not None
        if int(layout.domain[k]) == move.domain or not _free(s, layout)[move.gpus].all():
            return None
        return _with_stages(layout, [(k, move.domain, move.gpus, move.power)])
    d, g, p = int(layout.domain[k]), layout.stage_gpus(k), float(layout.power[k])
    if move.kind == "gpu":
        if move.old not in g or not _free(s, layout)[move.new]:
            return None
        return _with_stages(layout, [(k, d, np.sort(np.where(g == move.old, move.new, g)), p)])
    k2 = move.s2
    d2, g2, p2 = int(layout.domain[k2]), layout.stage_gpus(k2), float(layout.power[k2])
    return _with_stages(layout, [(k, d2, g2.copy(), p2), (k2, d, g.copy(), p)])


def _used_risk(s: Search, layout: Layout) -> float:
    """Sum of the failure probabilities of the GPUs in use (the tie-breaker)."""
    return float(sum(s.risk[layout.stage_gpus(k)].sum() for k in range(layout.n_stages)))


def local_search(s: Search, layout: Layout, plan: Plan, value: float) -> tuple[Plan, float]:
    """Passes over one move family at a time, each move applied to the current layout.

    A move is kept when it strictly improves the objective, or does not lower
    it at all and lowers the summed failure probability
    of the GPUs in use: on a sample, risk that no sampled scenario exercised
    is still risk. Lexicographic improvement cannot cycle. A pass of a family
    generates its moves from the layout it starts in; a pass that keeps a move
    restarts from the first family (the cheap ones); the search ends when no
    family keeps a move, or at the deadline.

    Parameters
    ----------
    s
        The search (scenarios, risk, limits).
    layout
        The starting layout.
    plan, value
        The starting plan and its training objective.

    Returns
    -------
    tuple of Plan and float
        The best plan found and its training objective.
    """
    used_risk = _used_risk(s, layout)
    family = 0
    while family < len(FAMILIES) and not s.expired():
        improved = False
        for move in _moves(s, layout, FAMILIES[family]):
            if s.expired():
                return plan, value
            cand = _apply(s, layout, move)
            if cand is None:
                continue
            p = s.plan(cand)
            if p is None:
                continue
            v = s.score(p, cand)
            if v > value + _IMPROVE_TOL * max(1.0, abs(value)):
                keep = True
            else:  # a tie never lowers the objective, not even by rounding
                keep = v >= value and _used_risk(s, cand) < used_risk - FLOAT_NOISE
            if keep:
                layout, plan, value = cand, p, v
                used_risk = _used_risk(s, layout)
                improved = True
        # a family that kept a move sends the search back to the first family
        family = 0 if improved and family > 0 else family + 1
    return plan, value


def relocate(s: Search, layout: Layout, domains: tuple[int, ...] | list[int]) -> Layout | None:
    """``layout`` with the stages of its domains outside ``domains`` moved into the others.

    Each domain the layout uses outside ``domains`` sends all its stages to
    one unused domain of ``domains`` (in index order). A stage's GPUs map to
    GPUs of the new domain with the same speed, TDP and board limit, the
    least risky first; power multipliers and degrees are kept. Used to seed
    the search with the domains of the bound's optimum
    (:mod:`~ntp_opt.planners.riskaware.nonanticipative`), whose domains are
    interchangeable.

    Returns
    -------
    Layout or None
        The new layout, or ``None`` when ``domains`` has too few unused
        domains or a new domain lacks a matching GPU.
    """
    used = sorted({int(d) for d in layout.domain})
    leave = [d for d in used if d not in set(domains)]
    if not leave:
        return layout
    target = [d for d in domains if d not in set(used)]
    if len(target) < len(leave):
        return None
    changes = []
    for old, new in zip(leave, target, strict=False):
        moved = _into(s, layout, old, new)
        if moved is None:
            return None
        changes += moved
    return _with_stages(layout, changes)
