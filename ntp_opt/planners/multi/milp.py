"""The multi-workload planner: an integer program over domain classes.

The training job's pre-overhead step time ``theta'`` is fixed by an outer
enumeration, as in :mod:`ntp_opt.planners.exact.search` (no power boost here, so every
step time where the training capacity can change is one of the finitely many
breakpoints ``b c / (f(t) s)``). At a fixed ``theta'`` every stage of degree
``t`` on a block of GPUs whose slowest has speed ``s`` carries at most
``beta = min(max_local_batch, floor(theta' f(t) s / c))`` sequences, and the
rest is linear:

* every domain class (domains with the same healthy-GPU speed profile) picks,
  for each of its domains, a *configuration*: a multiset of training stage
  degrees, on the domain's fastest GPUs; the GPUs left over form a *bin* for
  serving replicas (``x[c, j]`` counts domains of class ``c`` in config ``j``);
* training replicas ``n[t, b]`` of degree ``t`` and batch ``b`` need ``pp``
  stages of degree ``t`` and capability ``>= b`` each; since capabilities are
  nested this is exactly ``pp * sum_{b >= beta} n[t, b] <= #stages(t, >= beta)``
  for every level ``beta`` (Hall's condition);
* serving replicas ``M[i, t, g]`` of fleet ``i``, degree ``t``, in bins of
  speed group ``g``: when all serving degrees form a divisibility chain
  (1, 2, 4, 8, ...), replicas fit into bins of sizes ``L_k`` exactly when for
  every degree ``s`` of the chain
  ``sum_{t >= s} t M[., t, g] <= sum_k s floor(L_k / s)`` (placing the largest
  first always succeeds), so bins need no individual variables;
* objective: ``w_T (c / R) Y / (theta' (1 + rho [reduced])) + sum_i w_i U_i``
  with ``Y <= sum b n`` the training batch (``Y = B z`` under ``fixed``) and
  ``U_i = min(1, X_i / D_i)``.

Where GPU speeds differ inside a domain (stragglers) these programs restrict
where stages and replicas go, so each step time also gets an *optimistic*
program that admits every plan
(:func:`~ntp_opt.planners.multi.program.build_program`); its bound is the one
reported. ``docs/workloads.md`` states what is exact and what is not.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.workloads import MultiInstance, MultiPlan
from ntp_opt.planners.base import Status
from ntp_opt.planners.exact.backends import available_backends, solve_program
from ntp_opt.planners.exact.program import IntSolution
from ntp_opt.planners.multi.configs import DomainClass, capability, domain_classes
from ntp_opt.planners.multi.program import Built, build_program, expand
from ntp_opt.rules.multi import MultiEvaluation, check_multi, evaluate_multi
from ntp_opt.rules.power import exceeds, gpu_draw
from ntp_opt.rules.tolerances import (
    ABS_NOISE,
    BOUND_ABS_SLACK,
    BUDGET_SLACK,
    FLOAT_NOISE,
    REL_TOL,
)

#: What is known about the returned plan: the single-job :class:`Status`
#: (:mod:`ntp_opt.planners.base`), under its old name.
MultiStatus = Status


@dataclass(frozen=True)
class MultiResult:
    """Outcome of :func:`solve_multi`.

    Attributes
    ----------
    status
        :class:`MultiStatus`.
    time_limit_hit
        The time limit stopped the search.
    plan
        The validated plan, or ``None``.
    objective
        Its weighted goodput, recomputed by the validator.
    bound
        Upper bound on the weighted goodput of any plan of this model (see
        ``docs/workloads.md``), or ``None``.
    runtime_s
        Wall-clock seconds.
    programs
        Integer programs solved.
    evaluation
        The validator's :class:`~ntp_opt.rules.multi.MultiEvaluation`.
    reason
        Why there is no plan, or why the result is not proven optimal.
    log
        One line per program solved.
    """

    status: MultiStatus
    time_limit_hit: bool
    plan: MultiPlan | None
    objective: float | None
    bound: float | None
    runtime_s: float
    programs: int
    evaluation: MultiEvaluation | None = None
    reason: str | None = None
    log: tuple[str, ...] = ()

    @property
    def gap(self) -> float | None:
        """Relative gap ``(bound - objective) / bound``, or ``None``."""
        if self.bound is None or self.objective is None:
            return None
        if self.bound <= 0:
            return 0.0
        return max(0.0, (self.bound - self.objective) / self.bound)


def _check_supported(multi: MultiInstance) -> None:
    """Raise ``ValueError`` on inputs the planner does not model (see the docs)."""
    chain = multi.workloads.serving_degrees
    for lo, hi in itertools.pairwise(chain):
        if hi % lo:
            raise ValueError(
                f"workloads.serving: TP degrees {list(chain)} must form a divisibility chain "
                "(each divides the next, e.g. 1, 2, 4, 8) for the multi-workload planner"
            )
    a = multi.instance.arrays
    full = gpu_draw(multi.instance, a.healthy.astype(float))  # every healthy GPU at TDP
    rack_full = np.bincount(a.gpu_rack, weights=full, minlength=len(a.rack_ids))
    if np.any(exceeds(rack_full, a.rack_budget, tol=BUDGET_SLACK, slack=0.0)) or exceeds(
        full.sum(), a.site_budget, tol=BUDGET_SLACK, slack=0.0
    ):
        raise ValueError(
            "power budgets: the multi-workload planner needs rack and site budgets that "
            "admit every healthy GPU at TDP (the default); it plans without power boost"
        )


def _candidates(multi: MultiInstance, degrees: tuple[int, ...]) -> list[tuple[int, float]]:
    """Step times where the training capacity can change: ``(priority, theta')``.

    Priority 0 for those a stage on the fastest GPUs reaches (searched first:
    they are the likely optimum), 1 for those only slower GPUs reach.
    """
    job = multi.instance.job
    a = multi.instance.arrays
    cap = min(job.local_batch_max, job.global_batch)
    speeds = sorted({float(s) for s in a.speed[a.healthy].tolist()}, reverse=True)
    if not speeds or not degrees:
        return []
    lo = 0.0
    if job.batch_policy == "fixed":
        # some replica carries at least ceil(B / dp_max) sequences
        need = math.ceil(job.global_batch / max(1, job.replicas_max))
        lo = need * job.seq_time_s / (max(job.tp_factor(t) for t in degrees) * speeds[0])
    out: dict[float, int] = {}
    for rank, sp in enumerate(speeds):
        for t in degrees:
            for b in range(1, cap + 1):
                theta = b * job.seq_time_s / (job.tp_factor(t) * sp)
                if theta >= lo * (1 - FLOAT_NOISE) and theta not in out:
                    out[theta] = min(rank, 1)
    return sorted((p, th) for th, p in out.items())


def solve_multi(
    multi: MultiInstance,
    *,
    time_limit: float | None = 60.0,
    seed: int = 0,
    threads: int = 1,
    backend: str = "highs",
    share_domains: bool = True,
) -> MultiResult:
    """Plan every workload together, maximising weighted goodput.

    Parameters
    ----------
    multi
        The instance and its workloads.
    time_limit
        Seconds for the whole search (``None``: none; tests always set one).
    seed, threads
        Passed to the backend (one thread: deterministic).
    backend
        Integer-programming backend: ``"highs"`` (default), ``"cpsat"`` or
        ``"cbc"``. CP-SAT finds good solutions but can stall proving them
        optimal on the serving-throughput rows, whose coefficients are large
        (``docs/workloads.md``); HiGHS's LP bound closes them at once.
    share_domains
        Let serving replicas use the GPUs that training leaves idle inside its
        domains (default). ``False`` splits whole domains only (an ablation).

    Returns
    -------
    MultiResult
        Its plan, if any, has passed :func:`~ntp_opt.rules.multi.check_multi`.

    Raises
    ------
    ValueError
        On inputs the planner does not model: serving degrees that are not a
        divisibility chain, or power budgets below the healthy GPUs' TDP.
    """
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be positive, got {time_limit!r}")
    _check_supported(multi)
    start = time.perf_counter()
    deadline = None if time_limit is None else start + time_limit
    a = multi.instance.arrays
    exact = len({float(s) for s in a.speed[a.healthy].tolist()}) <= 1
    setup = _SearchSetup(
        multi, domain_classes(multi), deadline, seed, threads, backend, share_domains, exact
    )
    log: list[str] = []
    found = _search(setup, log)
    if found.best is None:
        return _no_plan(found, start, log)
    return _result(multi, found, exact, start, log)


def _no_plan(found: _Search, start: float, log: list[str]) -> MultiResult:
    """The result of a search that found no plan, with the reason."""
    if found.infeasible_all and not found.timed_out:
        status, why = MultiStatus.INFEASIBLE, "minimum shares cannot all be met"
    elif found.timed_out:
        status, why = MultiStatus.NO_SOLUTION, "time limit"
    else:
        status = MultiStatus.NO_SOLUTION
        why = "stragglers: no plan found where the programs place stages and replicas"
    return MultiResult(
        status,
        found.timed_out,
        None,
        None,
        None,
        time.perf_counter() - start,
        found.programs,
        reason=why,
        log=tuple(log),
    )


def _result(
    multi: MultiInstance, found: _Search, exact: bool, start: float, log: list[str]
) -> MultiResult:
    """The result of a search that found a plan: checked, with its bound and status."""
    assert found.best is not None
    plan, _ = found.best
    ev = check_multi(multi, plan)  # never trust the planner
    value = ev.weighted_goodput
    bound, timed_out = found.bound, found.timed_out
    # optimal up to the model's rounding (serving throughput in 1e-8 of demand)
    proven = (
        (not timed_out)
        and (not found.unproven)
        and bound <= value * (1 + REL_TOL) + found.resolution + BOUND_ABS_SLACK
    )
    reason: str | None = None
    if not exact and not proven:
        reason = "stragglers: bound from the optimistic programs (docs/workloads.md)"
    if timed_out:
        reason = "time limit"
    final_bound = None if math.isinf(bound) else max(bound, value)
    plan = plan.with_metrics(
        **ev.as_metrics(), **({"bound": final_bound} if final_bound is not None else {})
    )
    return MultiResult(
        MultiStatus.OPTIMAL if proven else MultiStatus.FEASIBLE,
        timed_out,
        plan,
        value,
        final_bound,
        time.perf_counter() - start,
        found.programs,
        evaluation=ev,
        reason=reason,
        log=tuple(log),
    )


def _training_cap(
    multi: MultiInstance, classes: list[DomainClass], degrees: tuple[int, ...], theta: float
) -> int:
    """An upper bound on the training sequences any plan carries at step time ``theta``.

    A replica carrying ``b`` sequences has ``pp`` stages of capability ``>= b``
    each, so ``Y = sum_beta #{replicas carrying >= beta}`` and that count is at most
    ``dp_max`` and ``S(beta) / pp``, ``S(beta)`` the stages of capability ``>= beta``
    the domains can hold: a domain of ``h`` healthy GPUs holds at most ``h // t``
    stages of degree ``t``, none faster than its ``t`` fastest GPUs.
    """
    job = multi.instance.job
    top = min(job.local_batch_max, job.global_batch)
    most = np.zeros(top + 2, dtype=np.int64)
    for klass in classes:
        h = len(klass.speed)
        per = np.zeros(top + 2, dtype=np.int64)
        for t in degrees:
            if t <= h:
                b = capability(multi, t, float(klass.speed[t - 1]), theta)
                if b >= 1:
                    per[1 : b + 1] = np.maximum(per[1 : b + 1], h // t)
        most += per * len(klass.domains)
    levels = np.minimum(job.replicas_max, most[1 : top + 1] // job.pp)
    return int(levels.sum())


@dataclass
class _Search:
    """What one walk over the step times found."""

    best: tuple[MultiPlan, MultiEvaluation] | None = None
    bound: float = 0.0  # on every plan (pruned step times: on the incumbent)
    timed_out: bool = False
    infeasible_all: bool = True  # every bounding program was infeasible
    unproven: bool = False  # some bounding program stopped without a proof
    programs: int = 0
    resolution: float = 0.0  # largest rounding slack of a program solved


@dataclass(frozen=True)
class _SearchSetup:
    """What every program of one search is solved with."""

    multi: MultiInstance
    classes: list[DomainClass]
    deadline: float | None
    seed: int
    threads: int
    backend: str
    share_domains: bool
    exact: bool


class _Walk:
    """One walk over the step times: solves programs, keeps the best plan and the bound."""

    def __init__(self, setup: _SearchSetup, log: list[str]) -> None:
        self.setup = setup
        self.log = log
        self.out = _Search()

    def _solve(self, built: Built, remaining: float | None) -> IntSolution:
        """Solve ``built`` with the backend (on its own failure: with another one)."""
        su = self.setup
        try:
            return solve_program(
                built.program, su.backend, time_limit=remaining, threads=su.threads, seed=su.seed
            )
        except RuntimeError as err:  # the solver's own failure on a sound program
            other = next((b for b in available_backends() if b != su.backend), None)
            if other is None:
                raise
            self.log.append(f"{su.backend} failed ({err}): solved by {other}")
            return solve_program(
                built.program, other, time_limit=remaining, threads=su.threads, seed=su.seed
            )

    def _keep(self, built: Built, x: np.ndarray) -> None:
        """Make the solution a plan; keep it if it is the best so far."""
        su, out = self.setup, self.out
        plan = expand(su.multi, su.classes, built, x)
        ev = evaluate_multi(su.multi, plan)
        if not ev.feasible:
            raise RuntimeError(f"multi-workload plan broke rules (bug): {ev.violations[:3]}")
        if out.best is None or ev.weighted_goodput > out.best[1].weighted_goodput:
            out.best = (plan, ev)

    def run(
        self, degrees: tuple[int, ...], theta: float, factor: float, optimistic: bool
    ) -> float | None:
        """Solve one program; return its bound in weighted-goodput units (None: timed out)."""
        su, out = self.setup, self.out
        bounding = optimistic or su.exact
        built = build_program(
            su.multi, su.classes, degrees, theta, factor, su.share_domains, optimistic
        )
        if built is None:
            return 0.0
        out.resolution = max(out.resolution, built.slack)
        remaining = None
        if su.deadline is not None:
            remaining = su.deadline - time.perf_counter()
            if remaining <= 0.01:
                out.timed_out = True
                return None
        sol = self._solve(built, remaining)
        out.programs += 1
        self.log.append(
            f"{'optimistic ' if optimistic else ''}degrees={list(degrees)} theta'={theta:.9g} "
            f"vars={built.program.n_vars} status={sol.status} obj={sol.objective} "
            f"{sol.runtime_s:.3f}s"
        )
        if sol.status == "infeasible":
            return 0.0
        if bounding:
            out.infeasible_all = False
        if sol.x is not None and not optimistic:
            self._keep(built, sol.x)
        if sol.status != "optimal":
            if bounding:
                out.unproven = True
            if sol.time_limit_hit:
                out.timed_out = True
        if sol.bound is None:
            return math.inf
        return sol.bound / built.value_scale + built.slack

    def incumbent(self) -> float:
        """The best plan's weighted goodput (``-inf``: none yet)."""
        return self.out.best[1].weighted_goodput if self.out.best is not None else -math.inf

    def reached(self, ub: float) -> bool:
        """Whether the best plan is within the tolerance of ``ub``."""
        return ub <= self.incumbent() * (1 + REL_TOL) + ABS_NOISE

    def serving_alone(self) -> float | None:
        """Training off: serving alone; it bounds the serving part of every program, and
        so does serving every fleet's whole demand (``None``: timed out)."""
        serving_max = sum(f.weight for f in self.setup.multi.workloads.serving)
        alone = self.run((), 1.0, 1.0, False)
        if not self.setup.exact and not self.out.timed_out:
            alone = serving_max if self.reached(serving_max) else self.run((), 1.0, 1.0, True)
        if alone is not None:
            alone = min(alone, serving_max)
            self.out.bound = max(self.out.bound, alone)
        return alone

    def step_time(self, degrees: tuple[int, ...], theta: float, factor: float, rest: float) -> None:
        """Solve the programs of one candidate step time unless its bound cannot beat the
        best plan (``rest``: the bound on the serving part)."""
        su, out = self.setup, self.out
        job, wl = su.multi.instance.job, su.multi.workloads
        cap_b = min(job.global_batch, job.replicas_max * job.local_batch_max)
        per_seq = wl.training_weight * job.seq_time_s / job.dp
        if self.reached(per_seq * cap_b / (theta * factor) + rest):
            return  # cannot beat the best plan: the serving part is at most serving_alone
        seqs = min(cap_b, _training_cap(su.multi, su.classes, degrees, theta))
        if job.batch_policy == "fixed" and seqs < job.global_batch:
            return  # training cannot run: every plan here is one of serving alone
        ub_here = per_seq * seqs / (theta * factor) + rest
        if self.reached(ub_here):
            return
        got = None if out.timed_out else self.run(degrees, theta, factor, False)
        if not su.exact and got is not None:
            # that program's bound holds for its placements only; the optimistic
            # program's holds for every plan (not needed once a plan reaches ub_here)
            got = None if out.timed_out else ub_here
            if not self.reached(ub_here) and not out.timed_out:
                got = self.run(degrees, theta, factor, True)
        # a program not solved is bounded by ub_here
        out.bound = max(out.bound, ub_here if got is None else min(got, ub_here))


def _search(setup: _SearchSetup, log: list[str]) -> _Search:
    """Solve the programs at every candidate step time, best first, skipping those
    whose bound cannot beat the best plan.

    ``setup.exact`` (every healthy GPU at one speed): the programs' bounds hold for
    every plan. Otherwise a step time's program finds plans only, and its optimistic
    program (see :func:`~ntp_opt.planners.multi.program.build_program`), whose bound
    holds for every plan, is solved after it unless a plan already reaches the step
    time's upper bound.
    """
    job = setup.multi.instance.job
    walk = _Walk(setup, log)
    alone = walk.serving_alone()
    cases: list[tuple[tuple[int, ...], float]] = [((job.tp,), 1.0)]
    if len(job.allowed) > 1:
        cases.append((job.allowed, 1.0 + job.reshard_overhead))
    todo = sorted(
        (prio, theta, degrees, factor)
        for degrees, factor in cases
        for prio, theta in _candidates(setup.multi, degrees)
    )
    rest = alone if alone is not None else math.inf
    for _, theta, degrees, factor in todo:
        walk.step_time(degrees, theta, factor, rest)
    return walk.out


def gpus_by_owner(plan: MultiPlan) -> dict[str, int]:
    """GPUs used per workload (``"training"`` and every fleet with replicas)."""
    out: dict[str, int] = {"training": sum(1 for _ in plan.training.used_gpus())}
    for rep in plan.serving:
        out[rep.workload] = out.get(rep.workload, 0) + len(rep.gpus)
    return out
