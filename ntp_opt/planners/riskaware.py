"""Risk-aware planning: maximise expected goodput after recourse (docs/model.md, spec section 4).

The planner starts from the risk-blind optimum (``solve(instance,
"optimal")``) and improves the *expected* goodput after the deterministic
recourse of :func:`ntp_opt.recourse.adapt`, never letting the nominal goodput
(no new failure) fall below ``(1 - nominal_tolerance)`` times the optimum's.

The expectation is taken over a fixed set of *training* scenarios:

* every scenario with its probability when the instance has at most
  ``exact_units`` independent failure units (the objective is then the exact
  expected goodput), else
* ``samples`` scenarios drawn with :func:`ntp_opt.failures.sample_failure_events`
  (sample-average approximation, SAA), seeded.

What placement controls under the recourse rules (``docs/failures.md``):
which domains and GPUs are spares (recourse never brings a spare *domain*
into the job, and a failed spare GPU costs nothing), and which domains share a
replica (a replica is as slow as its slowest stage, and drops out as a
whole, so risky domains packed into one replica hit fewer replicas). The
search therefore uses four kinds of moves, each scored by the training
objective and kept when it strictly improves it (or ties it and lowers the
summed failure probability of the GPUs in use):

1. *regroup*: inside each TP degree, sort the stages by risk and group them
   ``pp`` at a time (risky stages together);
2. *move a stage* to the unused healthy GPUs of another domain (the least
   risky ones), leaving the risky domain spare;
3. *swap a GPU* of a stage with an unused, less risky GPU of the same domain;
4. *swap two stages* of different replicas with the same degree.

Moves keep each stage's power multiplier; a move that breaks a rack or site
budget, or puts a boosted stage on a board that does not accept its power
(``max_power_w``), is rejected. Batches are re-split exactly after every move. The final
plan passes :func:`ntp_opt.validate.check`; its metrics carry the training
objective (``saa_expected_goodput``, ``saa_method``) and an estimate on
*fresh* scenarios the search never saw (``expected_goodput``,
``expected_method``, ``expected_ci_low``, ``expected_ci_high``). See
``docs/risk.md``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

import networkx as nx
import numpy as np

from ntp_opt.model import topology
from ntp_opt.model.control import Control
from ntp_opt.model.failures import enumerate_scenarios, failure_units, sample_failure_events
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.rules import goodput as gp
from ntp_opt.rules.expected import Z95, Scorer
from ntp_opt.rules.power import board_over, over_budget, rack_and_site_draw
from ntp_opt.rules.recourse import replica_degree, stage_after
from ntp_opt.rules.tolerances import FLOAT_NOISE, PROB_CLIP
from ntp_opt.rules.validate import certified, evaluate, infeasibility

logger = logging.getLogger(__name__)

#: Relative improvement a move must bring to be accepted (guards against float noise).
_IMPROVE_TOL = FLOAT_NOISE
#: Share of the time limit given to the risk-blind optimum.
BLIND_SHARE = 0.4
#: Share of the time limit reserved for the fresh-scenario estimate at the end.
EVAL_SHARE = 0.15
#: Names of the built instances of :func:`risk_instance`.
RISK_INSTANCES: tuple[str, ...] = ("spare-domains", "pack", "mixed", "mixed-fixed", "mixed-large")


# ----------------------------------------------------------------------------------------------
# scenarios and their scores
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenarios:
    """Distinct failure scenarios with weights summing to 1.

    Attributes
    ----------
    gpus
        Failed GPU indices (``instance.arrays`` order) of each distinct scenario.
    weights
        Probability (``exact``) or sample frequency (``saa``, ``mc``) of each.
    method
        ``"exact"`` (every scenario), ``"saa"`` or ``"mc"`` (sampled).
    samples
        Scenarios sampled, or distinct scenarios enumerated.
    """

    gpus: tuple[np.ndarray, ...]
    weights: np.ndarray
    method: str
    samples: int


def _sampled(
    instance: Instance, n: int, rng: np.random.Generator, **kw: object
) -> list[np.ndarray]:
    """``n`` sampled scenarios as failed-GPU index arrays (one per scenario)."""
    rows, gpus = sample_failure_events(instance, n, seed=rng, **kw)  # type: ignore[arg-type]
    out = [np.empty(0, dtype=np.int64)] * n
    if len(rows):
        cuts = np.flatnonzero(np.diff(rows)) + 1
        starts = np.concatenate([[0], cuts])
        stops = np.concatenate([cuts, [len(rows)]])
        for s, e in zip(starts, stops, strict=True):
            out[int(rows[s])] = gpus[s:e]
    return out


def _merge(items: list[tuple[np.ndarray, float]], method: str, samples: int) -> Scenarios:
    merged: dict[bytes, float] = {}
    arrays: dict[bytes, np.ndarray] = {}
    for g, w in items:
        key = np.sort(g).astype(np.int64).tobytes()
        merged[key] = merged.get(key, 0.0) + w
        arrays.setdefault(key, np.sort(g).astype(np.int64))
    keys = list(merged)
    weights = np.array([merged[k] for k in keys], dtype=float)
    return Scenarios(tuple(arrays[k] for k in keys), weights / weights.sum(), method, samples)


def training_scenarios(
    instance: Instance,
    *,
    samples: int = 300,
    seed: int = 0,
    exact_units: int = 10,
    blast_radius: str = "gpu",
    scale: float = 1.0,
) -> Scenarios:
    """The scenarios the planner optimises over.

    Parameters
    ----------
    instance
        The instance.
    samples
        SAA sample size when the scenarios are not enumerated.
    seed
        Seed of the SAA sample.
    exact_units
        Enumerate every scenario (exact objective) when the instance has at
        most this many independent failure units (at most 20).
    blast_radius, scale
        As in :func:`ntp_opt.failures.sample_failures`.

    Returns
    -------
    Scenarios
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if not 0 <= exact_units <= 20:
        raise ValueError(f"exact_units must be in [0, 20], got {exact_units}")
    if failure_units(instance, blast_radius, scale) <= exact_units:
        items = [
            (np.flatnonzero(mask), p)
            for mask, p in enumerate_scenarios(instance, blast_radius, scale)
        ]
        return _merge(items, "exact", len(items))
    rng = np.random.default_rng([seed, 0])
    drawn = _sampled(instance, samples, rng, blast_radius=blast_radius, scale=scale)
    return _merge([(g, 1.0 / samples) for g in drawn], "saa", samples)


def fresh_scenarios(
    instance: Instance,
    samples: int,
    *,
    seed: int = 0,
    blast_radius: str = "gpu",
    scale: float = 1.0,
) -> list[np.ndarray]:
    """``samples`` scenarios from a stream disjoint from :func:`training_scenarios`'.

    Returns
    -------
    list of numpy.ndarray
        Failed GPU indices of each scenario, in sample order (not merged, so
        that two plans can be compared scenario by scenario).
    """
    rng = np.random.default_rng([seed, 1])
    return _sampled(instance, samples, rng, blast_radius=blast_radius, scale=scale)


def scenario_goodputs(
    instance: Instance,
    plan: Plan,
    scenarios: list[np.ndarray] | tuple[np.ndarray, ...],
    *,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
) -> np.ndarray:
    """Goodput after recourse of ``plan`` in each scenario.

    Parameters
    ----------
    instance, plan
        The instance and a feasible plan for it.
    scenarios
        Failed GPU indices per scenario.
    deadline
        ``time.perf_counter()`` value after which scoring stops; the result
        is then shorter than ``scenarios`` (at least one scenario is scored).
    cancel
        Once set, scoring stops as at the deadline.

    Returns
    -------
    numpy.ndarray
        Goodput (sequences per second) per scored scenario.
    """
    scorer = Scorer(instance, plan)
    out = np.empty(len(scenarios))
    for i, g in enumerate(scenarios):
        if i > 0 and (
            (deadline is not None and time.perf_counter() > deadline)
            or (cancel is not None and cancel.is_set())
        ):
            return out[:i]
        out[i] = scorer.score_indices(g)
    return out


def objective(instance: Instance, plan: Plan, scenarios: Scenarios) -> float:
    """Weighted mean goodput after recourse over ``scenarios`` (the planner's objective)."""
    return float(np.dot(scenario_goodputs(instance, plan, scenarios.gpus), scenarios.weights))


# ----------------------------------------------------------------------------------------------
# local search state
# ----------------------------------------------------------------------------------------------

# A stage is (domain index, GPU indices, power); a replica is (tp, [stages]).
_Stage = tuple[int, np.ndarray, float]
_State = list[tuple[int, list[_Stage]]]


def gpu_risk(instance: Instance, blast_radius: str = "gpu", scale: float = 1.0) -> np.ndarray:
    """Probability that each GPU fails within the horizon (its own and its tray's units).

    With ``blast_radius="tray"`` a GPU also fails with any GPU of its tray, and with
    ``"domain"`` with any unit of its domain; GPUs already failed have risk 0.
    """
    a = instance.arrays
    p_gpu = np.minimum(a.p_fail * scale, 1.0) * a.healthy
    p_tray = np.minimum(a.tray_p_fail * scale, 1.0)
    log_ok_gpu = np.log1p(-np.minimum(p_gpu, PROB_CLIP))
    log_ok_tray = np.log1p(-np.minimum(p_tray, PROB_CLIP))
    if blast_radius == "gpu":
        log_ok = log_ok_gpu + log_ok_tray[a.gpu_tray]
    elif blast_radius == "tray":
        per_tray = np.bincount(a.gpu_tray, weights=log_ok_gpu, minlength=len(a.tray_ids))
        log_ok = (per_tray + log_ok_tray)[a.gpu_tray]
    else:
        per_dom = np.bincount(a.gpu_domain, weights=log_ok_gpu, minlength=a.n_domains)
        tray_dom = np.zeros(len(a.tray_ids), dtype=np.int64)
        tray_dom[a.gpu_tray] = a.gpu_domain
        per_dom = per_dom + np.bincount(tray_dom, weights=log_ok_tray, minlength=a.n_domains)
        log_ok = per_dom[a.gpu_domain]
    return np.where(a.healthy, -np.expm1(log_ok), 0.0)


def _fastest_first(speed: np.ndarray, gpus: np.ndarray) -> np.ndarray:
    """``gpus`` sorted fastest first, ties by index (the recourse's pool order)."""
    return gpus[np.lexsort((gpus, -speed[gpus]))]


class _FastScorer:
    """The training objective of a state, replica by replica (``docs/risk.md``).

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
        caps = instance.max_multiplier  # one board limit per domain: a refill keeps the power
        self.domain_ok = all(
            len(np.unique(a.gpu_rack[m])) <= 1
            and len(np.unique(a.tdp[m])) <= 1
            and len(np.unique(caps[m])) <= 1
            for m in a.domain_gpus
        )
        self._dead = np.zeros(a.n_gpus, dtype=bool)
        self.replica_memo: dict[tuple[object, ...], tuple[int, float] | None] = {}
        self.value_memo: dict[tuple[tuple[int, float] | None, ...], float] = {}

    def eligible(self, state: _State) -> bool:
        """Whether :meth:`value` is exact for ``state``."""
        if not self.domain_ok:
            return False
        owner: dict[int, int] = {}
        for r, (_, st) in enumerate(state):
            for d, _, _ in st:
                if owner.setdefault(d, r) != r:
                    return False
        return True

    def _replica(
        self, t_r: int, stages: list[_Stage], failed: np.ndarray
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

    def value(self, state: _State) -> float:
        """Weighted goodput after recourse over the scenarios (``eligible(state)`` must hold)."""
        job = self.job
        reps = []
        for t, st in state:
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


class _Search:
    """Plans built from states, checked for power and nominal goodput, scored on scenarios."""

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
        self.fast = _FastScorer(instance, scenarios)
        self.evaluations = 0
        self.timed_out = False
        self.cancel = cancel
        self.interrupted = False

    def expired(self) -> bool:
        if self.cancel is not None and self.cancel.is_set():
            self.interrupted = True
            return True
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.timed_out = True
        return self.timed_out

    def plan(self, state: _State) -> Plan | None:
        """The plan of ``state`` with batches re-split, or ``None`` if it breaks a rule."""
        a, job = self.a, self.job
        if not self._power_ok(state):
            return None
        tps = [t for t, _ in state]
        speeds = [
            gp.replica_speed(
                job, t, [float(a.speed[g].min()) for _, g, _ in st], [p for *_, p in st]
            )
            for t, st in state
        ]
        split = gp.split_batch(job, speeds, tps)
        if split is None or (state and split.goodput < self.min_nominal):
            return None
        reps = tuple(
            Replica(
                t,
                int(b),
                tuple(Stage(a.domain_ids[d], tuple(a.gpu_ids[i] for i in g), p) for d, g, p in st),
            )
            for (t, st), b in zip(state, split.batches, strict=True)
        )
        return Plan(self.instance.name, reps, {"policy": "risk-aware"})

    def _power_ok(self, state: _State) -> bool:
        """The validator's board and budget checks (:mod:`ntp_opt.rules.power`)."""
        power_of = np.zeros(self.a.n_gpus)
        for _, st in state:
            for _, g, p in st:
                power_of[g] = p
        if board_over(self.instance, power_of).any():
            return False  # a board refuses the stage's power limit
        racks, site = over_budget(self.instance, *rack_and_site_draw(self.instance, power_of))
        return not (racks.any() or site)

    def score(self, plan: Plan, state: _State) -> float:
        self.evaluations += 1
        if self.fast.eligible(state):
            return self.fast.value(state)
        return objective(self.instance, plan, self.scenarios)

    def stage_risk(self, stage: _Stage) -> float:
        """Probability that some GPU of the stage fails (independence over GPUs, an estimate)."""
        g = stage[1]
        return float(-np.expm1(np.log1p(-np.minimum(self.risk[g], PROB_CLIP)).sum()))


def _state_of(instance: Instance, plan: Plan) -> _State:
    a = instance.arrays
    return [
        (
            rep.tp,
            [
                (
                    a.domain_index[st.domain],
                    np.array([a.gpu_index[g] for g in st.gpus], dtype=np.int64),
                    float(st.power),
                )
                for st in rep.stages
            ],
        )
        for rep in plan.replicas
    ]


def _copy(state: _State) -> _State:
    return [(t, list(st)) for t, st in state]


def _regroup(s: _Search, state: _State, speed_first: bool) -> _State:
    """Inside each degree, stages sorted and grouped ``pp`` at a time.

    Sorted by risk (riskiest first), or with ``speed_first`` by effective speed
    ``pi^alpha * slowest GPU`` (fastest first) and then risk, which keeps the
    nominal speeds of a plan whose stages differ in speed or power.
    """
    pp = s.job.pp
    alpha = s.job.power_exponent
    by_tp: dict[int, list[_Stage]] = {}
    for t, st in state:
        by_tp.setdefault(t, []).extend(st)

    def key(x: _Stage) -> tuple[float, ...]:
        eff = float(x[2]) ** alpha * float(s.a.speed[x[1]].min())
        risk = s.stage_risk(x)
        head = (-eff, -risk) if speed_first else (-risk, -eff)
        return (*head, x[0], int(x[1][0]))

    out: _State = []
    for t in sorted(by_tp, reverse=True):
        stages = sorted(by_tp[t], key=key)
        out.extend((t, stages[i : i + pp]) for i in range(0, len(stages), pp))
    return out


def _free(s: _Search, state: _State) -> np.ndarray:
    used = np.zeros(s.a.n_gpus, dtype=bool)
    for _, st in state:
        for _, g, _ in st:
            used[g] = True
    return s.a.healthy & ~used


@dataclass(frozen=True)
class _Move:
    """What to change; :func:`_apply` turns it into a new state.

    ``regroup`` (by risk; with ``r=1`` by speed, then risk); ``stage`` (stage
    ``k`` of replica ``r`` moves to ``stage``);
    ``gpu`` (GPU ``old`` of that stage swapped for the free GPU ``new``);
    ``swap`` (stages ``(r, k)`` and ``(r2, k2)`` of different replicas exchanged).
    """

    kind: str
    r: int = 0
    k: int = 0
    r2: int = 0
    k2: int = 0
    old: int = 0
    new: int = 0
    stage: _Stage | None = None


#: Move families in the order the search tries them.
FAMILIES: tuple[str, ...] = ("regroup", "stage", "gpu", "swap")


def _moves(s: _Search, state: _State, family: str) -> list[_Move]:
    """The moves of one family from ``state``, most promising first."""
    if family == "regroup":
        return [_Move("regroup"), _Move("regroup", r=1)]
    if family == "stage":
        return _moves_stage(s, state)
    if family == "gpu":
        return _moves_gpu(s, state)
    return _moves_swap(s, state)


def _moves_stage(s: _Search, state: _State) -> list[_Move]:
    """Move a risky stage to the least risky free GPUs of another domain."""
    a = s.a
    free = _free(s, state)
    moves: list[_Move] = []
    spots = sorted(
        (-s.stage_risk(stage), r, k)
        for r, (_, st) in enumerate(state)
        for k, stage in enumerate(st)
    )
    for neg_risk, r, k in spots:
        if neg_risk == 0 or s.expired():
            break
        t, st = state[r]
        d0, _, p0 = st[k]
        cands = []
        for d in range(a.n_domains):
            members = a.domain_gpus[d]
            pool = members[free[members]]
            if d == d0 or len(pool) < t:
                continue
            order = np.lexsort((pool, -a.speed[pool], s.risk[pool]))
            new: _Stage = (d, np.sort(pool[order[:t]]), p0)
            risk = s.stage_risk(new)
            if risk < -neg_risk:
                cands.append((risk, d, new))
        cands.sort(key=lambda c: (c[0], c[1]))
        moves.extend(_Move("stage", r, k, stage=new) for _, _, new in cands[:3])
    return moves


def _moves_gpu(s: _Search, state: _State) -> list[_Move]:
    """Swap a used GPU for a free, less risky one of the same domain."""
    a = s.a
    free = _free(s, state)
    moves: list[_Move] = []
    for r, (_, st) in enumerate(state):
        if s.expired():
            break
        for k, (d, g, _) in enumerate(st):
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
                moves.append(_Move("gpu", r, k, old=old, new=int(better[order[0]])))
    return moves


def _moves_swap(s: _Search, state: _State) -> list[_Move]:
    """Swap two stages of different replicas with the same degree (one of them risky)."""
    moves: list[_Move] = []
    spots2 = [(r, k) for r, (_, st) in enumerate(state) for k in range(len(st))]
    risky = [s.stage_risk(state[r][1][k]) != 0 for r, k in spots2]  # once per stage
    for i, (r1, k1) in enumerate(spots2):
        if s.expired():  # quadratic in the stages: the deadline may come first
            break
        for j in range(i + 1, len(spots2)):
            r2, k2 = spots2[j]
            if r1 == r2 or state[r1][0] != state[r2][0]:
                continue
            if not risky[i] and not risky[j]:
                continue
            moves.append(_Move("swap", r1, k1, r2, k2))
    return moves


def _apply(s: _Search, state: _State, move: _Move) -> _State | None:
    """``move`` applied to ``state``, or ``None`` when it no longer applies."""
    if move.kind == "regroup":
        return _regroup(s, state, speed_first=move.r == 1)
    nxt = _copy(state)
    r, k = move.r, move.k
    if move.kind == "stage":
        assert move.stage is not None
        d, g, _ = move.stage
        if state[r][1][k][0] == d or not _free(s, state)[g].all():
            return None
        nxt[r][1][k] = move.stage
        return nxt
    if move.kind == "gpu":
        d, g, p = state[r][1][k]
        if move.old not in g or not _free(s, state)[move.new]:
            return None
        nxt[r][1][k] = (d, np.sort(np.where(g == move.old, move.new, g)), p)
        return nxt
    nxt[r][1][k], nxt[move.r2][1][move.k2] = state[move.r2][1][move.k2], state[r][1][k]
    return nxt


def _used_risk(s: _Search, state: _State) -> float:
    """Sum of the failure probabilities of the GPUs in use (the tie-breaker)."""
    return float(sum(s.risk[g].sum() for _, st in state for _, g, _ in st))


def _local_search(s: _Search, state: _State, plan: Plan, value: float) -> tuple[Plan, float]:
    """Passes over one move family at a time, each move applied to the current state.

    A move is kept when it strictly improves the objective, or does not lower
    it at all and lowers the summed failure probability
    of the GPUs in use: on a sample, risk that no sampled scenario exercised
    is still risk. Lexicographic improvement cannot cycle. A pass of a family
    generates its moves from the state it starts in; a pass that keeps a move
    restarts from the first family (the cheap ones); the search ends when no
    family keeps a move, or at the deadline.
    """
    used_risk = _used_risk(s, state)
    family = 0
    while family < len(FAMILIES) and not s.expired():
        improved = False
        for move in _moves(s, state, FAMILIES[family]):
            if s.expired():
                return plan, value
            cand = _apply(s, state, move)
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
                state, plan, value = cand, p, v
                used_risk = _used_risk(s, state)
                improved = True
        # a family that kept a move sends the search back to the first family
        family = 0 if improved and family > 0 else family + 1
    return plan, value


# ----------------------------------------------------------------------------------------------
# planner
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RiskAwareOutcome:
    """What :func:`plan_risk_aware` returns.

    Attributes
    ----------
    plan
        The risk-aware plan (validated; metrics below).
    blind
        The risk-blind plan it started from.
    bound
        The risk-blind optimum's bound on nominal goodput (or ``None``).
    time_limit_hit
        The search or the final estimate stopped at the time limit.
    evaluations
        Candidate plans scored.
    interrupted
        The ``cancel`` event stopped the search (the plan is the best so far).
    """

    plan: Plan
    blind: Plan
    bound: float | None
    time_limit_hit: bool
    evaluations: int
    interrupted: bool = False


def plan_risk_aware(
    instance: Instance,
    *,
    time_limit: float | None = 60.0,
    seed: int = 0,
    threads: int = 1,
    samples: int = 300,
    exact_units: int = 10,
    fresh_samples: int = 1000,
    nominal_tolerance: float = 0.0,
    blast_radius: str = "gpu",
    scale: float = 1.0,
    blind: Plan | None = None,
    cancel: threading.Event | None = None,
) -> RiskAwareOutcome:
    """Maximise expected goodput after recourse, starting from the risk-blind optimum.

    Parameters
    ----------
    instance
        The instance (GPU and tray ``p_fail`` give the risk).
    time_limit
        Seconds for everything (``None``: no limit): at most
        :data:`BLIND_SHARE` of it for the risk-blind optimum, the search up
        to ``1 -`` :data:`EVAL_SHARE`, the fresh estimate in the rest.
    seed
        Seed of the training and fresh scenarios and of the exact solver.
    threads
        Worker threads of the exact solver (1: deterministic).
    samples
        SAA sample size (training scenarios) when not enumerated.
    exact_units
        Optimise the exact expectation when the instance has at most this
        many failure units.
    fresh_samples
        Fresh Monte Carlo scenarios for the reported ``expected_goodput``
        (fewer if the time limit strikes first; ``0`` skips it).
    nominal_tolerance
        Fraction of the risk-blind optimum's nominal goodput the plan may
        give up for expected goodput (default 0: none).
    blast_radius, scale
        As in :func:`ntp_opt.failures.sample_failures`.
    blind
        The risk-blind plan to start from (default: ``solve(instance, "optimal")``).
    cancel
        Once set, every stage stops at its next check and the best plan so far
        is returned with ``interrupted``.

    Returns
    -------
    RiskAwareOutcome
    """
    if not 0.0 <= nominal_tolerance <= 1.0:
        raise ValueError(f"nominal_tolerance must be in [0, 1], got {nominal_tolerance!r}")
    if fresh_samples < 0:
        raise ValueError(f"fresh_samples must be >= 0, got {fresh_samples}")
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be positive, got {time_limit!r}")
    start = time.perf_counter()
    end = None if time_limit is None else start + time_limit
    bound = None
    if blind is None:
        from ntp_opt.planners.exact.search import solve_exact

        if infeasibility(instance) is not None:
            raise ValueError(f"instance {instance.name!r}: {infeasibility(instance)}")
        found = solve_exact(
            instance,
            "cpsat",
            time_limit=None if time_limit is None else BLIND_SHARE * time_limit,
            seed=seed,
            threads=threads,
            control=Control("risk-aware", None, cancel),
        )
        assert found.plan is not None  # the exact search always returns a plan
        blind, bound = found.plan, found.bound
    nominal = evaluate(instance, blind)
    if not nominal.feasible:
        raise ValueError("blind: the starting plan is not feasible for the instance")
    scenarios = training_scenarios(
        instance,
        samples=samples,
        seed=seed,
        exact_units=exact_units,
        blast_radius=blast_radius,
        scale=scale,
    )
    risk = gpu_risk(instance, blast_radius, scale)
    search_end = None if time_limit is None else start + (1 - EVAL_SHARE) * time_limit
    s = _Search(
        instance,
        scenarios,
        risk,
        nominal.goodput * (1 - nominal_tolerance) * (1 - FLOAT_NOISE),
        search_end,
        cancel,
    )
    state = _state_of(instance, blind)
    plan0 = s.plan(state)
    if plan0 is None or evaluate(instance, plan0).goodput < nominal.goodput:
        plan0 = blind  # keep the given batches when the re-split cannot match them
    value0 = s.score(plan0, _state_of(instance, plan0))
    plan, value = _local_search(s, state, plan0, value0)
    metrics: dict[str, object] = {
        "policy": "risk-aware",
        "saa_expected_goodput": value,
        "saa_method": scenarios.method,
        "saa_samples": scenarios.samples,
        "blind_saa_expected_goodput": value0,
        "blind_goodput": nominal.goodput,
    }
    hit = s.timed_out
    if scenarios.method == "exact":
        metrics.update(
            expected_goodput=value, expected_method="exact", expected_samples=scenarios.samples
        )
    elif fresh_samples > 0:
        fresh = fresh_scenarios(
            instance, fresh_samples, seed=seed, blast_radius=blast_radius, scale=scale
        )
        vals = scenario_goodputs(instance, plan, fresh, deadline=end, cancel=cancel)
        hit = hit or len(vals) < fresh_samples
        mean = float(vals.mean())
        metrics.update(expected_goodput=mean, expected_method="mc", expected_samples=len(vals))
        if len(vals) > 1:  # no interval from one scenario (and JSON has no infinity)
            half = Z95 * float(vals.std(ddof=1)) / math.sqrt(len(vals))
            metrics.update(expected_ci_low=mean - half, expected_ci_high=mean + half)
    if bound is not None:
        metrics["bound"] = bound
    out = certified(instance, plan.with_metrics(**metrics))
    stopped = s.interrupted or (cancel is not None and cancel.is_set())
    logger.info(
        "risk-aware: %d plans scored, expected goodput %.9g (blind %.9g)%s",
        s.evaluations,
        value,
        value0,
        " (interrupted)" if stopped else "",
    )
    return RiskAwareOutcome(out, blind, bound, hit and not stopped, s.evaluations, stopped)


# ----------------------------------------------------------------------------------------------
# instances built for risk-aware planning
# ----------------------------------------------------------------------------------------------


def _set_tray_risk(
    g: nx.Graph, domains: list[int], p: float, trays: list[int] | None = None
) -> None:
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
    return Instance(name, g, job, {"builder": "ntp_opt.riskaware.risk_instance", "name": name})
