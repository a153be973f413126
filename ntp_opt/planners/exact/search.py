"""The exact planner: a search over the step time with the capacity program.

``C(theta')`` (:mod:`ntp_opt.planners.exact.model`) is the largest total batch any plan
carries at pre-overhead step time ``theta'``; it is a non-decreasing step
function. Two cases are searched: only the nominal degree ``T`` (no resharding
overhead), and every allowed degree (step time ``theta' (1 + rho)``).

* ``fixed``: the goodput is ``B / theta``, so the search wants the smallest
  ``theta'`` with ``C(theta') >= B``: bisection. Without power boost
  (``max_boost == 0``, ``alpha == 0``, or no board accepting more than its
  ``tdp_w``) every jump of ``C`` lies in the finite
  set ``{b c / (f(t) s)}`` and the bisection over that set is exact; with
  boost it runs on the continuous axis until the bracket is within the
  tolerance, and the lower end is a proven bound.
* ``elastic``: the goodput is ``min(B, C(theta')) / theta'``, maximal at a
  jump of ``C`` no later than where ``C`` first reaches ``min(B, C_max)``.
  Branch and bound over ``theta'`` intervals ``[a, b]``: ``C(b) / a`` bounds
  every point inside; an interval whose ends have equal ``C`` is settled.

Every plan found is checked by the validator; the best one (or the warm
start, if better) is returned with the best proven bound.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ntp_opt.model.control import Control
from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan
from ntp_opt.planners import heuristics as baselines
from ntp_opt.planners.base import Limit, Outcome, stop_limit
from ntp_opt.planners.bounds import capacity_bound, stage_bound
from ntp_opt.planners.exact.backends import solve_or_highs, solve_program
from ntp_opt.planners.exact.backends.base import RelaxingBackend, registered
from ntp_opt.planners.exact.capacity import Capacity, build_capacity, iter_stages, level_floor
from ntp_opt.planners.exact.colgen import ColumnGeneration, column_generation_for
from ntp_opt.planners.exact.merged import merged_capacity
from ntp_opt.planners.exact.model import (
    MAX_CONFIGS,
    DeadlineReached,
    ModelTooLarge,
    NoClusterGraph,
    Prepared,
    StagePick,
    prepare,
    rack_relaxed,
)
from ntp_opt.planners.exact.program import IntProgram, IntSolution
from ntp_opt.planners.exact.tighten import tighten
from ntp_opt.rules.goodput import replica_speed, split_batch
from ntp_opt.rules.power import can_boost, largest_cap
from ntp_opt.rules.tolerances import (
    EDGE_SLACK,
    FLOAT_NOISE,
    INT_ROUND_TOL,
    PROBE_STEP,
    REL_TOL,
)
from ntp_opt.rules.validate import certified, evaluate

logger = logging.getLogger(__name__)


class _Deadline(Exception):
    pass


class _Interrupted(Exception):
    pass


class _Unresolved(Exception):
    """The capacity oracle left ``lower < upper`` where the search needs the exact
    value: the search stops (not proven), but not at a time limit."""


#: Largest full program (variables) that, once it has settled a program column
#: generation left open, replaces the generated ones of its degrees at the next step
#: times (solved by HiGHS): ``dgx-h100-k8s-256``'s 2,432 take HiGHS 0.3 s where the
#: generated program stays open after 1.5-13 s; at 4,096 DGX GPUs (16,000 variables,
#: 2.5-25 s each) only the programs left open go to it.
FULL_HIGHS_VARS = 5_000
#: CP-SAT's deterministic work limit (about two CPU seconds a unit) on a full capacity
#: program; past it HiGHS goes on from CP-SAT's solution (``backends.solve_or_highs``):
#: on an NVL72 cluster of 2,016 GPUs with TP36 (degrees 32-36, 18,000 variables) CP-SAT
#: takes 11-14 s on each program of the descent, HiGHS 3.4 s.
FULL_WORK = 2.0
#: Absolute margin by which the LP relaxation must be below a target (``C`` and the
#: target are integers; the LP value is a float with solver tolerances).
LP_MARGIN = 0.5
#: Relative slack on an LP value before it is rounded down to a bound on ``C`` (the
#: LP's tolerances are far below it; ``C`` takes integer values only).
LP_FLOOR_TOL = 1e-6
#: Variables from which a capacity program's question "``C >= target``?" is first put
#: to the mixed relaxation (integer replica counts, continuous configurations) when the
#: LP does not decide it: about 0.1-0.6 s where CP-SAT takes 1.5-7 s at 131k GPUs
#: (6,100 variables); below, the integer program is about as fast.
MIXED_MIN_VARS = 1_000
#: Branch-and-bound nodes the mixed relaxation may take (a deterministic limit; its
#: dual bound counts when it stops there). Those measured (131k NVL32 elastic, NVL36x2
#: 1k, NVL72 576 TP36, 49 programs of 1,000-6,100 variables) were decided at the root.
MIXED_NODES = 200
#: Branch-and-bound nodes HiGHS gets for the merged program (``_Search._merged_bound``):
#: on 4,096 DGX GPUs every one measured was decided within 50.
MERGED_NODES = 1_000


def lp_relaxation(
    program: IntProgram,
    threads: int = 1,
    *,
    integer_from: int | None = None,
    node_limit: int | None = None,
    time_limit: float | None = None,
) -> float | None:
    """The optimum of a relaxation of a capacity program (HiGHS), or ``None`` when
    ``highspy`` is missing or the relaxation is not solved.

    Without ``integer_from`` every variable is continuous (the LP relaxation).
    With it, the variables from that index on stay integer (the replica counts
    ``n[t, b]`` of :class:`~ntp_opt.planners.exact.capacity.Capacity`, from its
    ``n_offset``) and the configuration counts before it are continuous: a small
    mixed program whose bound is often the integer optimum itself, where the LP
    is a fraction of a replica above it.

    Parameters
    ----------
    program
        A maximisation with integer variables.
    threads
        HiGHS threads.
    integer_from
        First variable kept integer (``None``: none).
    node_limit
        Branch-and-bound nodes for the mixed program; at the limit its proven
        (dual) bound is returned.
    time_limit
        Seconds for the mixed program (the caller's deadline); likewise.

    Returns
    -------
    float or None
        An upper bound on the program's integer optimum, up to solver tolerances.
    """
    for backend in registered():
        if isinstance(backend, RelaxingBackend) and backend.available():
            return backend.relax(
                program,
                threads,
                integer_from=integer_from,
                node_limit=node_limit,
                time_limit=time_limit,
            )
    return None


def _floor_bound(relaxed: float) -> int:
    """A relaxation's value rounded down to a bound on the integer ``C``, with the
    slack :data:`LP_FLOOR_TOL` for the solver's tolerances."""
    return math.floor(relaxed + LP_FLOOR_TOL * max(1.0, relaxed))


@dataclass
class _Search:
    prep: Prepared
    backend: str
    deadline: float | None
    threads: int
    seed: int
    keep_log: bool
    best_plan: Plan
    best_value: float
    evaluations: int = 0
    unproven: bool = False
    global_bound: float = math.inf
    log: list[str] = field(default_factory=list)
    control: Control | None = None
    report_bounds: bool = True
    best_layout: Layout | None = None  # best_plan in index space, when the search found it
    colgen: dict[tuple[int, ...], ColumnGeneration] = field(default_factory=dict)
    theta_search: str = "descent"  # elastic: "descent" (_descend) or "bnb" (interval B&B)
    case_bounds: dict[tuple[int, ...], float] = field(default_factory=dict)  # per degree set
    # degree sets whose programs are built in full and solved by HiGHS: small ones
    # from the start (_small_full_program), else once the full program closed a gap
    # column generation left (_settle); column generation stays their fallback
    full_highs: set[tuple[int, ...]] = field(default_factory=set)
    # upper bounds on C from the merged program (_merged_bound), per (theta', degrees)
    merged: dict[tuple[float, tuple[int, ...]], int] = field(default_factory=dict)

    def note(self, line: str, *, keep: bool = True) -> None:
        """A line of the search log (also logged at INFO level)."""
        logger.info("%s", line)
        if keep:
            self.log.append(line)

    def report(self) -> None:
        """Pass the incumbent (and the capacity bound, if valid here) to the control."""
        if self.control is not None:
            bound = self.global_bound if self.report_bounds else None
            self.control.report(self.best_value if self.best_value >= 0 else None, bound)

    # -- capacity oracle ---------------------------------------------------

    def capacity(
        self,
        theta: float,
        degrees: tuple[int, ...],
        target: int | None = None,
        *,
        descent: bool = False,
    ) -> tuple[int, int, float]:
        """Bounds ``(lower, upper)`` on ``C(theta)`` (equal when proven), and a step
        time ``<= theta`` at which the solution found still carries ``lower``.

        With ``target``, only ``C(theta) >= target`` is asked: where its LP
        relaxation is below ``target``, the answer is ``(0, that bound)``
        without an integer program; where a replica carrying less than
        :func:`~ntp_opt.planners.exact.capacity.level_floor` cannot reach the
        target (``fixed`` batch), the program lists no such level, and the upper
        bound is ``target - 1`` (not reached) or ``B`` (reached). ``descent=True`` (the
        question of :func:`_descend`: how far below ``target`` is ``C``): every
        level is listed, and the LP answers whenever its value rounded down (to
        :data:`LP_FLOOR_TOL`) is below ``target``."""
        remaining = None
        if self.control is not None and self.control.cancelled:
            raise _Interrupted
        if self.deadline is not None:
            remaining = self.deadline - time.perf_counter()
            if remaining <= 0.01:
                raise _Deadline
        cancel = None if self.control is None else self.control.cancel
        # configurations generated on demand, unless the full program settled C
        # for these degrees before (then it is solved by HiGHS at every step time)
        full = degrees in self.full_highs
        generated = None if full else self.colgen.get(degrees)
        fixed = self.prep.instance.job.batch_policy == "fixed"
        floor = 1
        if target is not None and generated is None and not descent and fixed:
            # fixed batch only: elsewhere (the elastic search for the top step time on
            # racks shared by domains) the program without the low levels can be far
            # harder to prove below the target than the full one
            floor = level_floor(self.prep, target)
        job = self.prep.instance.job
        try:
            if generated is None:
                cap = build_capacity(self.prep, theta, degrees, self.deadline, floor)
            else:
                master = generated.solve(
                    theta, self.backend, deadline=self.deadline, threads=self.threads,
                    seed=self.seed, cancel=cancel, target=target,
                    bound=lambda: self._merged_bound(theta, degrees, job.global_batch),
                )  # fmt: skip
                cap = master.capacity
        except DeadlineReached:
            raise _Deadline from None
        except ModelTooLarge:
            if not full:
                raise
            self.full_highs.discard(degrees)  # too large at this step time: generate again
            return self.capacity(theta, degrees, target, descent=descent)
        self.evaluations += 1
        settled: int | None = None  # the upper bound after _settle
        settled_sol: IntSolution | None = None
        if generated is not None:
            got = master.lower
            up = max(got, master.upper)
            # the generated columns leave C open where the search needs it, or (the
            # descent) its upper bound lowers the level by less than the gap, where the
            # descent would creep down one level per program: the full program settles
            # it (or at least tightens the bounds)
            creeping = descent and target is not None and 0 < got < up < target
            if got < up and (
                target is None or got < target <= up or (creeping and target - up < up - got)
            ):
                full_cap, settled_sol, settled = self._settle(theta, degrees, got, up)
                if full_cap is not None:
                    cap = full_cap
        # a program without the levels below `floor` bounds C only against the target
        below = target - 1 if floor > 1 and target is not None else None
        if not cap.classes:
            if below is not None:
                return 0, below, theta
            if generated is None:
                return 0, 0, theta
            return 0, master.upper if settled is None else settled, theta
        if generated is None and target is not None:
            answer = self._relaxed_answer(cap, theta, degrees, target, descent, remaining)
            if answer is not None:
                if below is not None:
                    return 0, below, theta
                return 0, answer, theta
        if generated is None:
            sol = solve_or_highs(
                cap.program,
                "highs" if full else self.backend,
                deadline=self.deadline,
                threads=self.threads,
                seed=self.seed,
                cancel=cancel,
                work=FULL_WORK,
            )
        else:
            sol = master.solution if settled_sol is None else settled_sol
        lower = int(sol.objective) if sol.objective is not None else 0
        if generated is not None:
            # the Lagrangian bound of the column generation holds whatever the
            # integer master's status (its own bound covers the generated columns only)
            upper = max(lower, master.upper) if settled is None else settled
        elif sol.status == "optimal":
            upper = lower
        elif sol.status == "infeasible":  # x = 0 is always feasible; be safe anyway
            upper = 0
        else:
            self.unproven = True
            upper = (
                math.floor(sol.bound + INT_ROUND_TOL) if sol.bound is not None else job.global_batch
            )
        if below is not None:  # the restricted program decides the target only
            upper = job.global_batch if upper > below else below
        tight = theta
        if sol.x is not None and lower > 0:
            stages = list(iter_stages(self.prep, cap, sol.x))
            tight, powers = tighten(self.prep, stages, theta)
            if self.deadline is not None and time.perf_counter() >= self.deadline:
                raise _Deadline
            if job.batch_policy == "elastic" or lower >= job.global_batch:
                self._offer(stages, powers)
        if self.keep_log or logger.isEnabledFor(logging.DEBUG):
            line = (
                f"theta'={theta:.9g} degrees={list(degrees)} vars={cap.program.n_vars} "
                f"status={sol.status} C={sol.objective} bound={sol.bound} "
                f"tight={tight:.9g} {sol.runtime_s:.3f}s"
            )
            logger.debug("%s", line)
            if self.keep_log:
                self.log.append(line)
        if sol.interrupted or (self.control is not None and self.control.cancelled):
            raise _Interrupted
        if sol.time_limit_hit and sol.status != "optimal":
            raise _Deadline
        return lower, upper, tight

    def _settle(
        self, theta: float, degrees: tuple[int, ...], lower: int, upper: int
    ) -> tuple[Capacity | None, IntSolution | None, int]:
        """The full capacity program (every configuration listed) where column
        generation left ``lower < upper``: its program and HiGHS' solution (both
        ``None`` where they carry no more than ``lower``) and the upper bound on
        ``C(theta)`` then known.

        The generated master's gap comes from fractional configuration counts,
        which the branching over replica counts does not reach; the full program
        has no such gap (on ``dgx-h100-k8s-256``, 2,432 variables: CP-SAT does not
        prove ``C = 384`` in 50 s, HiGHS does in 0.5 s, where the generated bound
        was 430). HiGHS is there wherever column generation is. ``(None, None,
        upper)`` when the full program is too large (:data:`MAX_CONFIGS`).

        First the program with interchangeable multi-domain units merged
        (:meth:`_merged_bound`): where its bound is ``lower``, ``C`` is settled
        without the full program (``(None, None, lower)``).
        """
        remaining = None if self.deadline is None else self.deadline - time.perf_counter()
        if remaining is not None and remaining <= 0.01:
            raise _Deadline
        upper = min(upper, self._merged_bound(theta, degrees, upper))
        if upper <= lower:
            return None, None, lower
        remaining = None if self.deadline is None else self.deadline - time.perf_counter()
        if remaining is not None and remaining <= 0.01:
            raise _Deadline
        try:
            full = build_capacity(self.prep, theta, degrees, self.deadline)
        except ModelTooLarge as err:
            self.note(f"theta'={theta:.9g} degrees={list(degrees)}: C in [{lower}, {upper}], "
                      f"full program not built ({err})")  # fmt: skip
            return None, None, upper
        except DeadlineReached:
            raise _Deadline from None
        if not full.classes:  # no configuration fits anywhere: C = 0
            return None, None, 0
        cancel = None if self.control is None else self.control.cancel
        sol = solve_program(
            full.program, "highs", time_limit=remaining, threads=self.threads,
            seed=self.seed, cancel=cancel,
        )  # fmt: skip
        if self.keep_log:
            self.log.append(
                f"theta'={theta:.9g} degrees={list(degrees)} full program vars="
                f"{full.program.n_vars} status={sol.status} C={sol.objective} "
                f"bound={sol.bound} (generated: C in [{lower}, {upper}]) {sol.runtime_s:.3f}s"
            )
        if sol.interrupted:
            raise _Interrupted
        found = int(sol.objective) if sol.objective is not None else -1
        if sol.status == "optimal":
            if full.program.n_vars <= FULL_HIGHS_VARS:
                self.full_highs.add(degrees)  # and so at the next step times
            return full, sol, found
        if sol.time_limit_hit:
            raise _Deadline
        if sol.bound is not None:
            upper = min(upper, math.floor(sol.bound + INT_ROUND_TOL))
        if found > lower:
            return full, sol, max(found, upper)
        return None, None, upper

    def _merged_bound(self, theta: float, degrees: tuple[int, ...], upper: int) -> int:
        """An upper bound on ``C(theta)`` from the program with interchangeable
        multi-domain units merged (:func:`~ntp_opt.planners.exact.merged.merged_capacity`):
        HiGHS' proven bound after at most :data:`MERGED_NODES` nodes (a deterministic
        limit), rounded down; ``upper`` where there is none.

        On 4,096 DGX GPUs it has 655 variables where the full program has
        15,568, and proves ``C(15.084) = 1902`` in 0.3 s, where the full
        program is open after 40 s. Kept per step time and degrees (the column
        generation asks first, :meth:`_settle` again)."""
        key = (theta, degrees)
        if key in self.merged:
            return min(upper, self.merged[key])
        try:
            merged = merged_capacity(self.prep, theta, degrees, self.deadline)
        except ModelTooLarge:
            return upper
        except DeadlineReached:
            raise _Deadline from None
        if merged is None:
            return upper
        remaining = None if self.deadline is None else self.deadline - time.perf_counter()
        if remaining is not None and remaining <= 0.01:
            raise _Deadline
        started = time.perf_counter()
        relaxed = lp_relaxation(
            merged, self.threads, integer_from=0, node_limit=MERGED_NODES, time_limit=remaining
        )
        bound = upper if relaxed is None else min(upper, _floor_bound(relaxed))
        if self.keep_log:
            self.log.append(
                f"theta'={theta:.9g} degrees={list(degrees)} merged program vars="
                f"{merged.n_vars} bound={relaxed} {time.perf_counter() - started:.3f}s"
            )
        if self.control is not None and self.control.cancelled:
            raise _Interrupted
        self.merged[key] = bound  # a proven bound, even where a limit stopped HiGHS
        return min(upper, bound)

    def _relaxed_answer(
        self,
        cap: Capacity,
        theta: float,
        degrees: tuple[int, ...],
        target: int,
        descent: bool,
        remaining: float | None,
    ) -> int | None:
        """An upper bound below ``target`` on ``C(theta)`` from relaxations, or ``None``.

        First the LP relaxation; then, on programs of at least
        :data:`MIXED_MIN_VARS` variables, the mixed program with integer replica
        counts (:func:`lp_relaxation` with ``integer_from``), a fraction of the
        integer program's time where it decides the question. Without ``descent``
        the LP must be :data:`LP_MARGIN` below the target; with it, its value is
        rounded down (to :data:`LP_FLOOR_TOL`), as is the mixed program's bound."""
        relaxed = lp_relaxation(cap.program, self.threads)
        if relaxed is None:
            return None
        if descent:
            floored = _floor_bound(relaxed)
        else:
            floored = math.floor(relaxed + LP_MARGIN) if relaxed < target - LP_MARGIN else target
        kind = "LP"
        if floored >= target and cap.program.n_vars >= MIXED_MIN_VARS:
            relaxed = lp_relaxation(
                cap.program,
                self.threads,
                integer_from=cap.n_offset,
                node_limit=MIXED_NODES,
                time_limit=remaining,
            )
            if relaxed is None:
                return None
            floored, kind = _floor_bound(relaxed), "mixed"
        if floored >= target:
            return None
        self.evaluations += 1
        if self.keep_log:
            self.log.append(
                f"theta'={theta:.9g} degrees={list(degrees)} {kind}={relaxed:.6f} < {target}"
            )
        return max(0, floored)

    def _offer(self, stages: list[StagePick], powers: list[float]) -> None:
        groups, speeds = _replicas(self.prep, stages, powers)
        if sum(speeds) < self.best_value * (1 - FLOAT_NOISE):
            # any split of any batch takes at least sum(b) / sum(v): the plan's
            # goodput is at most sum(v), below the incumbent (not built, not checked)
            return
        layout = _layout(self.prep, groups, speeds)
        plan = layout.to_plan(self.prep.instance)
        ev = evaluate(self.prep.instance, plan)
        if ev.feasible and ev.goodput > self.best_value:
            self.best_plan = plan.with_metrics(**ev.as_metrics())
            self.best_layout = dataclasses.replace(layout, metrics=dict(self.best_plan.metrics))
            self.best_value = ev.goodput
            self.report()


def build_layout(prep: Prepared, stages: Sequence[StagePick], powers: Sequence[float]) -> Layout:
    """The stages of a capacity solution grouped into replicas; batches re-split exactly.

    Stages of one class ``(t, b)`` form replicas of ``pp`` stages each, in the
    order given (classes by decreasing degree, then batch level); a class's
    last ``len % pp`` stages are left out.

    Parameters
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.
    stages
        From :func:`~ntp_opt.planners.exact.capacity.iter_stages`.
    powers
        Each stage's power multiplier (from
        :func:`~ntp_opt.planners.exact.tighten.tighten`).

    Returns
    -------
    Layout
        With metrics ``{"policy": "optimal"}``.
    """
    return _layout(prep, *_replicas(prep, stages, powers))


_Group = tuple[int, int, list[tuple[int, tuple[int, ...], float]]]


def _replicas(
    prep: Prepared, stages: Sequence[StagePick], powers: Sequence[float]
) -> tuple[list[_Group], list[float]]:
    """The replicas of :func:`build_layout` (degree, batch level, stages) and their speeds."""
    inst = prep.instance
    speed = inst.arrays.speed
    by_class: dict[tuple[int, int], list[tuple[int, tuple[int, ...], float]]] = {}
    for st, power in zip(stages, powers, strict=True):
        by_class.setdefault((st.degree, st.batch), []).append((st.domain, st.gpus, float(power)))
    pp = inst.job.pp
    groups: list[tuple[int, int, list[tuple[int, tuple[int, ...], float]]]] = []
    for (t, b), members in sorted(by_class.items(), key=lambda kv: (-kv[0][0], -kv[0][1])):
        for i in range(0, len(members) - len(members) % pp, pp):
            groups.append((t, b, members[i : i + pp]))
    speeds = [
        replica_speed(
            inst.job,
            t,
            [float(speed[list(g)].min()) for _, g, _ in members],
            [pw for _, _, pw in members],
        )
        for t, _, members in groups
    ]
    return groups, speeds


def _layout(prep: Prepared, groups: list[_Group], speeds: list[float]) -> Layout:
    """:func:`build_layout` from :func:`_replicas`: batches re-split exactly."""
    inst = prep.instance
    split = split_batch(inst.job, speeds, [t for t, _, _ in groups])
    batches = split.batches if split is not None else tuple(b for _, b, _ in groups)
    return Layout.from_indices(
        inst.name,
        [(t, int(bb), members) for (t, _, members), bb in zip(groups, batches, strict=True)],
        {"policy": "optimal"},
    )


def build_plan(prep: Prepared, stages: Sequence[StagePick], powers: Sequence[float]) -> Plan:
    """:func:`build_layout` in node ids."""
    return build_layout(prep, stages, powers).to_plan(prep.instance)


def _candidates(prep: Prepared, degrees: tuple[int, ...]) -> np.ndarray | None:
    """Sorted step times where ``C`` can jump, or ``None`` when power makes them continuous."""
    job = prep.instance.job
    if can_boost(prep.instance):
        return None
    cap = min(job.local_batch_max, job.global_batch)
    if cap * len(degrees) * len(prep.speeds) > 50 * MAX_CONFIGS:
        # too many to list: search the continuous axis (exact to REL_TOL)
        return None
    values = {
        b * job.seq_time_s / (job.tp_factor(t) * s)
        for t in degrees
        for s in prep.speeds
        for b in range(1, cap + 1)
    }
    return np.array(sorted(values))


def _theta_range(prep: Prepared, degrees: tuple[int, ...]) -> tuple[float, float]:
    """``theta'`` below which no replica carries one sequence; above which all carry the cap.

    The first is ``1 / v_max`` with ``v_max`` the fastest any replica can be.
    """
    job = prep.instance.job
    if not prep.speeds:
        return 1.0, 1.0
    boost = largest_cap(prep.instance) ** job.power_exponent
    v_max = max(job.tp_factor(t) for t in degrees) * prep.speeds[0] * boost / job.seq_time_s
    v_min = min(job.tp_factor(t) for t in degrees) * prep.speeds[-1] / job.seq_time_s
    cap = min(job.local_batch_max, job.global_batch)
    # strictly below the first point where any replica carries one sequence
    return 1.0 / v_max / (1 + EDGE_SLACK), cap / v_min * (1 + EDGE_SLACK)


def _min_theta(
    s: _Search,
    degrees: tuple[int, ...],
    target: int,
    lo: float,
    hi: float,
    *,
    alternate: bool = False,
) -> tuple[float, float]:
    """Smallest ``theta'`` with ``C >= target`` in ``(lo, hi]``: ``(feasible hi, proven lo)``.

    ``C(hi) >= target`` must hold; every ``theta' <= lo`` has ``C < target``.
    On the continuous axis, a probe right below the feasible end follows every
    solution found; with ``alternate`` probes and geometric midpoints alternate
    strictly (a solution that tightens only a little then still halves the bracket).

    A step time where the oracle leaves ``lower < target <= upper`` is passed
    over like an infeasible one (the search for a plan goes on above it), but
    the proven lower end stays at the last step time where ``C < target`` is
    proven; the bracket returned is then wider than the search's.
    """
    cands = _candidates(s.prep, degrees)
    if cands is not None:
        i_lo = int(np.searchsorted(cands, lo, side="right"))  # first candidate > lo
        i_hi = int(np.searchsorted(cands, hi, side="right")) - 1  # last candidate <= hi
        if i_hi < i_lo:
            return hi, lo
        # C is constant between candidates: search the smallest feasible candidate
        best = i_hi
        i_proven = i_lo  # every step time below cands[i_proven] has C < target
        while i_lo < best:
            m = (i_lo + best) // 2
            low, up, tight = s.capacity(float(cands[m]), degrees, target)
            if low >= target:
                # the solution still fits at `tight`: C is constant on [tight, cands[m]]
                first = int(np.searchsorted(cands, tight * (1 - FLOAT_NOISE), side="left"))
                best = max(i_lo, min(m, first))
            else:
                i_lo = m + 1
                if up < target:  # proven up to here (C is non-decreasing)
                    i_proven = i_lo
                else:
                    s.note(f"theta'={cands[m]:.9g}: C in [{low}, {up}], target {target}")
        # every candidate below `best` is infeasible and C only jumps at
        # candidates: no step time below cands[best] reaches the target (proven
        # below cands[i_proven])
        return float(cands[best]), float(cands[min(i_proven, best)])
    proven = lo
    probe = True  # hi is where a known solution stops fitting: C often drops right below
    while hi / lo - 1 > REL_TOL:
        mid = max(hi * (1 - REL_TOL / 2), lo * (1 + PROBE_STEP)) if probe else math.sqrt(lo * hi)
        low, up, tight_at = s.capacity(mid, degrees, target)
        probe = not probe
        if low >= target:
            hi = max(tight_at, lo)
            probe = probe or not alternate
        else:
            lo = mid
            if up < target:
                proven = mid  # C is non-decreasing: proven below mid too
            else:
                s.note(f"theta'={mid:.9g}: C in [{low}, {up}], target {target}")
    return hi, proven


def _case_bound(s: _Search, degrees: tuple[int, ...]) -> float:
    """The best goodput bound known for the plans of one case (``inf``: none)."""
    return min(s.global_bound, s.case_bounds.get(degrees, math.inf))


def _drop_bounded_cases(
    s: _Search, cases: list[tuple[tuple[int, ...], float]]
) -> tuple[list[tuple[tuple[int, ...], float]], float]:
    """Per case, its capacity bound (:func:`~ntp_opt.planners.bounds.stage.stage_bound`
    restricted to the case's plans); a case whose bound is within the tolerance of
    the incumbent is not searched. Returns the cases to search and the largest bound
    of those left out (``0.0``: none)."""
    kept: list[tuple[tuple[int, ...], float]] = []
    dropped = 0.0
    for degrees, factor in cases:
        bound = stage_bound(s.prep.instance, only=degrees)
        s.case_bounds[degrees] = bound
        bound = _case_bound(s, degrees)
        if bound <= s.best_value * (1 + REL_TOL):
            dropped = max(dropped, bound)
            s.note(f"degrees {list(degrees)}: bound {bound:.9g} reached, not searched")
        else:
            kept.append((degrees, factor))
    return kept, dropped


def _bound_floor(s: _Search, degrees: tuple[int, ...], target: int, factor: float) -> float:
    """A step time below which ``C < target``: there the goodput would beat the case's bound.

    Any ``theta' < target / (bound * factor)`` carrying ``target`` would have
    goodput ``target / (theta' factor)`` above the capacity bound of the case's
    plans (:func:`_case_bound`), so the bisections may start there instead of at
    the physical limit.
    """
    bound = _case_bound(s, degrees)
    if not math.isfinite(bound) or bound <= 0 or target <= 0:
        return 0.0
    return target / (bound * factor) / (1 + EDGE_SLACK)


#: GPUs from which ``fast``'s plan is always a warm start (below: only where a case
#: needs generated configurations or none can be searched).
FAST_WARM_GPUS = 4096


def _fast_plan(instance: Instance) -> Plan:
    """``fast``'s plan (not validated: the caller evaluates it)."""
    from ntp_opt.planners.fast import plan_fast

    return plan_fast(instance, bound=False).require_plan()


#: Domains in multi-domain units (racks shared by several domains, NVL8) above which
#: the search generates configurations per whole unit (``colgen``: identical racks
#: form one class) instead of one binary per domain and configuration.
MULTI_DOMAINS_COLGEN = 16


#: Configurations of one domain class (at the largest step time searched) above which
#: a case is solved by column generation although the full program fits
#: :data:`~ntp_opt.planners.exact.model.MAX_CONFIGS`: four TP16 stages on a 72-GPU
#: domain list about 4,800 per class, and CP-SAT takes 2-25 s per program where the
#: generated master needs a few dozen columns (0.04 s). The library's largest is about
#: 3,300 per class (TP32-36 with reduced degrees), left as it was.
COLGEN_CLASS_CONFIGS = 4_000


def _crowded_class(cap: Capacity) -> int:
    """The most configurations of one domain class in ``cap`` if above
    :data:`COLGEN_CLASS_CONFIGS`, else 0."""
    per_class: dict[tuple[tuple[int, ...], int], int] = {}
    for members, pos, _ in cap.columns:
        per_class[(members, pos)] = per_class.get((members, pos), 0) + 1
    most = max(per_class.values(), default=0)
    return most if most > COLGEN_CLASS_CONFIGS else 0


def _small_full_program(prep: Prepared, degrees: tuple[int, ...], deadline: float | None) -> bool:
    """Whether the full program at the top of the step-time range (where it is
    largest) has at most :data:`FULL_HIGHS_VARS` variables (0: never) and no
    crowded class."""
    try:
        top = build_capacity(prep, _theta_range(prep, degrees)[1], degrees, deadline)
    except (ModelTooLarge, DeadlineReached):  # the search meets the deadline itself
        return False
    return 0 < FULL_HIGHS_VARS and top.program.n_vars <= FULL_HIGHS_VARS and not _crowded_class(top)


def _many_rack_domains(prep: Prepared) -> bool:
    """Whether the full program would hold too many domains that share racks."""
    return sum(len(prep.units[u].domains) for u in prep.multi) > MULTI_DOMAINS_COLGEN


def _case_fixed(s: _Search, degrees: tuple[int, ...], factor: float) -> float:
    """Search one degree set under ``fixed``; returns the case's goodput bound."""
    job = s.prep.instance.job
    lo, hi = _theta_range(s.prep, degrees)
    big_b = job.global_batch
    # any plan has a replica with b >= B / dp_max
    lo = max(lo, math.ceil(big_b / max(1, job.replicas_max)) * lo) / (1 + EDGE_SLACK)
    # no plan beats the capacity bound: below B / (bound * factor) C stays under B
    if math.isfinite(s.global_bound) and s.global_bound > 0:
        lo = max(lo, big_b / (s.global_bound * factor) * (1 - EDGE_SLACK))
    lo = max(lo, _bound_floor(s, degrees, big_b, factor))  # per-case bound
    # first the one program that may settle the case against the incumbent
    prune = _fixed_prune(s, degrees, factor, lo, hi)
    if prune is not None and prune[0]:
        return prune[1]
    if prune is not None:
        hi = prune[1]  # a solution carries B there: C(hi) >= B
    else:
        low, up, _ = s.capacity(hi, degrees, big_b)
        if up < big_b:
            return 0.0  # the job cannot run at all in this case
        if low < big_b:
            raise _Unresolved
        # warm start: the incumbent's step time is feasible if its plan fits this case
        inc = s.best_plan
        if inc.replicas and all(r.tp in degrees for r in inc.replicas):
            ev = evaluate(s.prep.instance, inc)
            theta_inc = ev.step_time / (factor if any(r.tp < job.tp for r in inc.replicas) else 1.0)
            if lo < theta_inc < hi:
                low, up, tight = s.capacity(theta_inc * (1 + FLOAT_NOISE), degrees, big_b)
                if low >= big_b:
                    hi = min(hi, tight)
    hi, lo = _min_theta(s, degrees, big_b, lo, hi, alternate=True)
    return big_b / (lo * factor)


#: Share of the time left that the probe against the incumbent may take (fixed batch).
PRUNE_SHARE = 0.2


def _fixed_prune(
    s: _Search, degrees: tuple[int, ...], factor: float, lo: float, hi: float
) -> tuple[bool, float] | None:
    """One program at the step time a plan of this case would need to beat the
    incumbent by more than :data:`REL_TOL`: where ``C`` stays below ``B`` there,
    no step time at or below it carries ``B`` (``C`` is non-decreasing) and the
    case is settled, ``(True, its bound)``; where it reaches ``B`` the search goes
    on below the solution's tight point, ``(False, new hi)``. ``None``: no probe."""
    big_b = s.prep.instance.job.global_batch
    if s.best_value <= 0:
        return None
    theta_p = big_b / (s.best_value * factor * (1 + REL_TOL))
    if not lo < theta_p < hi:
        return None
    # the program right at the threshold can be hard to prove: with a time limit it
    # gets a share of the time left, and the search goes on without it if that ends
    deadline, unproven = s.deadline, s.unproven
    if deadline is not None:
        now = time.perf_counter()
        s.deadline = now + PRUNE_SHARE * max(0.0, deadline - now)
    try:
        low, up, tight = s.capacity(theta_p, degrees, big_b)
    except _Deadline:
        if deadline is not None and time.perf_counter() >= deadline:
            raise
        s.unproven = unproven
        s.note(f"degrees {list(degrees)}: the program at {theta_p:.9g} took too long")
        return None
    finally:
        s.deadline = deadline
    if up < big_b:
        s.note(f"degrees {list(degrees)}: cannot beat the incumbent (C < B at {theta_p:.9g})")
        return True, big_b / (theta_p * factor)
    if low >= big_b:
        return False, max(lo, min(hi, tight))
    return None


def _elastic(s: _Search, cases: list[tuple[tuple[int, ...], float]]) -> float:
    """Search every degree set under ``elastic``; returns the goodput bound.

    First, per case, the step time where ``C`` first reaches its largest useful
    value (a fixed-batch search: good plans come early); then one best-first
    branch and bound over the step-time intervals of all cases.
    """
    job = s.prep.instance.job
    big_b = job.global_batch
    best = 0.0
    # intervals (-upper bound, a, C(a), b, C(b), b is a tight point, case)
    heap: list[tuple[float, float, int, float, int, bool, int]] = []
    above = 0.0  # bound on the goodput above the range of a case whose top was not solved

    def push(i: int, a: float, ca: int, b: float, cb: int, tight_end: bool) -> None:
        nonlocal best
        factor = cases[i][1]
        best = max(best, min(big_b, ca) / (a * factor))
        if ca >= cb:
            return  # C constant on [a, b]: its best point is a
        heapq.heappush(heap, (-min(big_b, cb) / (a * factor), a, ca, b, cb, tight_end, i))

    for i, (degrees, factor) in enumerate(cases):
        lo, hi = _theta_range(s.prep, degrees)
        most = min(big_b, job.replicas_max * min(job.local_batch_max, big_b))
        if s.theta_search == "descent" and most / (hi * factor) < s.best_value * (1 + REL_TOL):
            # no program at the top of the range: above it G <= min(B, dp_max M) /
            # (hi factor), which the incumbent reaches, and the descent's first
            # program asks at once whether the largest level beats the incumbent
            c_max = 0
            up = most
            above = max(above, most / (hi * factor))
            if s.keep_log:
                s.log.append(
                    f"theta'={hi:.9g} degrees={list(degrees)}: top of the range not solved "
                    f"(G <= {most / (hi * factor):.9g} there)"
                )
        else:
            c_max, up, _ = s.capacity(hi, degrees)
            if c_max < up:
                raise _Unresolved
        if up == 0:
            continue
        c_hi, up_hi = c_max, up
        if s.theta_search == "bnb":
            top = min(big_b, c_max)
            hi, _ = _min_theta(s, degrees, top, max(lo, _bound_floor(s, degrees, top, factor)), hi)
            # C at the top of the search range: the solution's value for the incumbent,
            # the proven upper bound for the intervals below (they differ where the
            # generated configurations leave a gap, e.g. right at a tight point, where
            # the mW rounding may refuse the solution that was tightened there)
            c_hi, up_hi, _ = s.capacity(hi, degrees)
        # (the descent starts at the top of the range: its first program asks whether
        # the largest level beats the incumbent, where the search for the step time at
        # which C reaches it would follow tight points down one solution at a time)
        best = max(best, c_hi / (hi * factor))
        # Doubling: below theta_cut every solution at theta, with its batches
        # doubled, stays feasible at 2 theta (same speed needs, no batch cap
        # reached since b <= theta v_max <= M / 2 and 2 C(theta) <= B): so
        # G(theta) <= G(2 theta) and the search may start at theta_cut.
        v_max = 1.0 / (lo * (1 + EDGE_SLACK))
        cap = min(job.local_batch_max, big_b)
        theta_cut = min(cap, big_b / max(1, job.replicas_max)) / (2 * v_max)
        c_lo = 0
        if lo < theta_cut < hi:
            lo = theta_cut
            c_lo, up_lo, _ = s.capacity(lo, degrees)
            if c_lo < up_lo and s.theta_search == "bnb":
                raise _Unresolved  # the descent needs no more than the step time
        push(i, lo, c_lo, hi, up_hi, True)

    candidates = [_candidates(s.prep, degrees) for degrees, _ in cases]
    if s.theta_search == "descent":
        # largest bound first: its descent raises the incumbent for the others
        bound = 0.0
        for _, a, ca, b, cb, _, i in sorted(heap):
            best, case_bound = _descend(s, cases[i], candidates[i], (a, ca), (b, cb), best)
            bound = max(bound, case_bound)
        return max(best, bound, above)
    while heap:
        neg_ub, a, ca, b, cb, tight_end, i = heap[0]
        if min(-neg_ub, s.global_bound) <= max(best, s.best_value) * (1 + REL_TOL):
            break
        heapq.heappop(heap)
        degrees, factor = cases[i]
        cands = candidates[i]
        if cands is not None:
            inside = cands[(cands > a) & (cands < b)]
            if len(inside) == 0:
                continue  # C jumps only at b: settled
            # right below a tight point C usually drops: probe there first
            target = math.log(b) if tight_end else 0.5 * math.log(a * b)
            mid = float(inside[int(np.argmin(np.abs(np.log(inside) - target)))])
        else:
            if b / a - 1 <= REL_TOL:
                heapq.heappush(heap, (neg_ub, a, ca, b, cb, tight_end, i))
                break
            mid = (
                max(b * (1 - REL_TOL / 2), a * (1 + PROBE_STEP)) if tight_end else math.sqrt(a * b)
            )
        c_mid, up_mid, tight = s.capacity(mid, degrees)
        if c_mid < up_mid:
            raise _Unresolved
        # the solution at mid still fits at `tight`: C is constant on [tight, mid]
        tight = min(max(a, tight), mid)
        best = max(best, min(big_b, c_mid) / (tight * factor))
        if tight > a:
            push(i, a, ca, tight, c_mid, tight < mid)
        push(i, mid, c_mid, b, cb, tight_end)
    remaining = max((-item[0] for item in heap), default=0.0)
    return max(best, remaining)


def _descend(
    s: _Search,
    case: tuple[tuple[int, ...], float],
    cands: np.ndarray | None,
    low_end: tuple[float, int],
    high_end: tuple[float, int],
    best: float,
) -> tuple[float, float]:
    """Prove one case of ``elastic`` on ``[a, b]`` by a descent over the levels of ``C``.

    ``low_end = (a, C(a))`` and ``high_end = (b, C(b))`` are known; ``best`` is
    the best goodput found so far (``min(B, C) / (theta' factor)`` at a tight
    point). With the incumbent ``lam`` (the larger of ``best`` and the
    validated plan's goodput) and ``C(theta) <= c`` known for ``theta < b``,
    every step time in ``[c / (lam factor (1 + tol)), b)`` has goodput at most
    ``lam (1 + tol)``; the next program is solved at the left end of that
    interval (a Dinkelbach step on the step-time axis). Its solution either
    keeps the level ``c`` there, which improves ``lam`` by at least the
    tolerance, or proves a lower level, from which the next step starts. So
    one program per level of ``C`` visited, none per jump located, and no
    interval is ever split. Without boost, each probe is moved down to the
    largest step time of the finite candidate set at or below it (``C`` is
    constant between candidates).

    Returns
    -------
    (float, float)
        ``best`` (raised by the solutions found) and the largest goodput bound
        of the step times passed over (``0`` when nothing was passed over).
    """
    degrees, factor = case
    big_b = s.prep.instance.job.global_batch
    lo, _ = low_end
    theta, level = high_end
    bound = 0.0
    caps: list[tuple[float, int]] = []  # (step time, upper bound on C there) of look-aheads
    stride = LOOK_AHEAD
    while theta > lo:
        lam = max(best, s.best_value)
        case_bound = _case_bound(s, degrees)
        if case_bound <= lam * (1 + REL_TOL):
            # the case's capacity bound closes what is left: [lo, theta) is bounded by it
            return best, max(bound, case_bound)
        nxt = min(big_b, level) / (lam * factor * (1 + REL_TOL))
        if nxt <= lo:
            # [lo, theta) below lam (1 + tol); G(lo) itself is in `best` already
            return best, max(bound, min(big_b, level) / (lo * factor))
        probe = nxt
        if cands is not None:
            k = int(np.searchsorted(cands, nxt, side="right")) - 1  # last candidate <= nxt
            if k < 0 or cands[k] <= lo:
                # C is constant on [lo, nxt]: the goodput there is at most G(lo)
                return best, max(bound, min(big_b, level) / (nxt * factor))
            probe = float(cands[k])
            if probe >= theta:
                # a relaxation bounded C at this candidate, but G there may beat the
                # incumbent: C itself is needed (C is constant up to the next one)
                c_e, up_e, _ = s.capacity(probe, degrees)
                if c_e < up_e:
                    raise _Unresolved
                best = max(best, min(big_b, c_e) / (probe * factor))
                level = min(level, c_e)
                continue
        if probe >= theta:
            # the last program left lower < upper and its upper bound did not
            # lower the level: the step times right below it stay open
            raise _Unresolved
        bound = max(bound, min(big_b, level) / (nxt * factor))
        known = min((u for at, u in caps if at >= probe), default=level)
        if known < level:  # a look-ahead below showed C(probe) <= C(at) <= known
            theta, level = probe, known
            continue
        # only C(probe) < level moves on: the LP relaxation often shows it
        c_p, up_p, tight = s.capacity(probe, degrees, level, descent=True)
        if c_p < up_p and up_p < level:  # the LP's bound on C(probe): a lower level, no plan
            theta, level = probe, up_p
            continue
        tight = min(max(lo, tight), probe)
        best = max(best, min(big_b, c_p) / (tight * factor))
        if c_p < up_p:
            # not proven: the upper bound is the level below the probe (only upper
            # bounds of C enter the proof; a solution only raises the incumbent)
            s.note(f"theta'={probe:.9g} degrees={list(degrees)}: C in [{c_p}, {up_p}]")
        if c_p >= level and cands is None:
            best, stride = _look_ahead(s, case, (lo, probe), level - stride, best, caps, stride)
        theta, level = probe, min(level, up_p)
    return best, bound


#: Levels below a level at which a better plan was found that the descent looks at
#: first (doubled after every look-ahead that finds a better plan still).
LOOK_AHEAD = 2


def _look_ahead(
    s: _Search,
    case: tuple[tuple[int, ...], float],
    window: tuple[float, float],
    level: int,
    best: float,
    caps: list[tuple[float, int]],
    stride: int,
) -> tuple[float, int]:
    """One program of :func:`_descend` ahead of its order: ``C >= level`` at the step
    time where that level would beat the incumbent, inside ``window``.

    Where the power budget lets each level below run a little faster, the
    incumbent improves by a little at every level, and the descent would solve
    one integer program per level; a look-ahead that finds a plan skips the
    integer programs of the levels between (their turn comes with the higher
    incumbent, where a relaxation usually rules them out). A look-ahead that
    does not find one leaves its upper bound on ``C`` in ``caps`` for the
    descent to use when it gets there. Returns ``best`` and the next stride.
    """
    degrees, factor = case
    big_b = s.prep.instance.job.global_batch
    lam = max(best, s.best_value)
    if level <= 0 or lam <= 0:
        return best, LOOK_AHEAD
    at = min(big_b, level) / (lam * factor * (1 + REL_TOL))
    if not window[0] < at < window[1]:
        return best, LOOK_AHEAD
    c_g, up_g, tight = s.capacity(at, degrees, level, descent=True)
    if c_g >= level:
        tight = min(max(window[0], tight), at)
        return max(best, min(big_b, c_g) / (tight * factor)), 2 * stride
    caps.append((at, up_g))
    return best, LOOK_AHEAD


def solve_exact(
    instance: Instance,
    backend: str = "cpsat",
    *,
    time_limit: float | None = None,
    threads: int = 1,
    seed: int = 0,
    initial_plan: Plan | None = None,
    log: bool = False,
    control: Control | None = None,
    report_bounds: bool = True,
    theta_search: str = "descent",
    relax_racks: bool = True,
) -> Outcome:
    """Maximise goodput exactly (to :data:`REL_TOL`) with the given backend.

    Parameters
    ----------
    instance
        The instance.
    backend
        ``"cpsat"``, ``"highs"`` or ``"cbc"``.
    time_limit
        Seconds for the whole search (``None``: no limit).
    threads, seed
        Passed to the backend.
    initial_plan
        Warm start; the result is never worse. Default: the best baseline.
    log
        Keep one line per capacity program solved (they also go to this
        module's logger at DEBUG level).
    control
        Progress reports and the cancel token (:class:`ntp_opt.model.control.Control`):
        once it is set, the search stops at the next program (CP-SAT and
        HiGHS stop the running one) and returns its best plan, ``interrupted``.
    report_bounds
        Pass the search's bounds to ``control`` (False when they bound
        another problem than the caller's).
    theta_search
        How ``elastic`` searches the step time: ``"descent"`` (one program per
        level of the capacity, :func:`_descend`) or ``"bnb"`` (the earlier
        best-first branch and bound over step-time intervals). Both prove the
        same optimum; ``fixed`` ignores it.
    relax_racks
        Where the model is not exact (:attr:`~ntp_opt.planners.exact.model.Prepared.inexact`,
        e.g. a domain spanning racks with too many rack splits to list) but the
        search proved its plan optimal within the model, prove it against every
        plan by the same search on the rack-merged relaxation
        (:func:`~ntp_opt.planners.exact.model.rack_relaxed`) in the time left.

    Returns
    -------
    Outcome
        Its ``stats`` hold the plan's ``goodput`` and the number of
        capacity-program ``evaluations``.
    """
    start = time.perf_counter()
    deadline = None if time_limit is None else start + time_limit
    prep = prepare(instance)
    starts = [  # checked: the baselines' plans are not
        certified(instance, baselines.ntp_pw(instance).require_plan()),
        certified(instance, baselines.ntp(instance).require_plan()),
        certified(instance, baselines.dp_drop(instance).require_plan()),
    ]
    if initial_plan is not None:
        starts.insert(0, initial_plan)
    if len(instance.arrays.speed) >= FAST_WARM_GPUS:
        # the sort-and-pack planner is scale-free (under a second at 131k GPUs)
        # and usually far better than the baselines on large clusters, where the
        # search may not finish: a warm start too
        starts.append(_fast_plan(instance))
    job = instance.job
    sub_evaluations = 0
    sub_interrupted = False
    if can_boost(instance):
        # warm start: the same search without boost has finitely many step
        # times to try and finds a good plan fast; it is valid here too
        plain = instance.with_job(job.model_copy(update={"max_boost": 0.0}))  # same arrays
        sub = solve_exact(
            plain,
            backend,
            time_limit=None if time_limit is None else time_limit / 3,
            threads=threads,
            seed=seed,
            log=log,
            control=control,
            report_bounds=False,  # a bound without boost is no bound with it
            theta_search=theta_search,
            relax_racks=False,  # only its plan is used
        )
        if sub.plan is not None:  # always: the search returns a plan
            starts.insert(0, sub.plan)
        sub_evaluations = int(sub.stats["evaluations"])
        sub_interrupted = sub.interrupted
    best_plan, best_value = starts[1], -1.0
    for p in starts:
        ev = evaluate(instance, p)
        if ev.feasible and ev.goodput > best_value:
            best_plan, best_value = p.with_metrics(**ev.as_metrics()), ev.goodput
    s = _Search(prep, backend, deadline, threads, seed, log, best_plan, best_value)
    s.control, s.report_bounds = control, report_bounds
    if theta_search not in ("descent", "bnb"):
        raise ValueError(f"theta_search must be 'descent' or 'bnb', not {theta_search!r}")
    s.theta_search = theta_search
    s.global_bound = capacity_bound(instance)
    s.report()
    s.evaluations = sub_evaluations
    # The job cannot run at all: too few stages of degree >= tp_min, or (fixed)
    # too little batch capacity. Proven without any program.
    stages = int((instance.arrays.healthy_in_domain() // job.min_tp).sum())
    no_batch = job.batch_policy == "fixed" and job.replicas_max * job.local_batch_max < (
        job.global_batch
    )
    if stages < job.pp or no_batch or job.replicas_max == 0:
        s.note("the job cannot run: paused, proven without a program")
        return Outcome(
            plan=s.best_plan,
            bound=s.best_value,
            proven=True,
            log=tuple(s.log),
            stats={"goodput": s.best_value, "evaluations": s.evaluations},
        )
    cases: list[tuple[tuple[int, ...], float]] = [((job.tp,), 1.0)]
    if len(job.allowed) > 1:
        cases.append((job.allowed, 1.0 + job.reshard_overhead))
    # A case whose program is too large at its largest step time (where every
    # configuration fits) is left out: the result is then not proven.
    kept = []
    left_out = False
    deadline_hit = False
    for degrees, factor in cases:
        try:
            if _many_rack_domains(prep):
                raise ModelTooLarge(
                    f"{sum(len(prep.units[u].domains) for u in prep.multi)} domains share racks"
                )
            top = build_capacity(prep, _theta_range(prep, degrees)[1], degrees, deadline)
            crowded = _crowded_class(top)
            if crowded:
                raise ModelTooLarge(f"{crowded} configurations of one domain class")
            kept.append((degrees, factor))
        except ModelTooLarge as err:
            generated = column_generation_for(prep, degrees, _theta_range(prep, degrees)[1])
            if generated is not None:  # configurations generated on demand
                s.colgen[degrees] = generated
                kept.append((degrees, factor))
                if _small_full_program(prep, degrees, deadline):
                    # racks shared by many domains, but few configurations: the full
                    # program by HiGHS (column generation stays the fallback)
                    s.full_highs.add(degrees)
                    s.note(f"degrees {list(degrees)}: full program by HiGHS ({err})")
                    continue
                s.note(f"degrees {list(degrees)}: column generation ({err})")
                continue
            s.unproven = left_out = True
            s.note(f"left out degrees {list(degrees)}: {err}")
        except DeadlineReached:
            s.unproven = left_out = deadline_hit = True
            s.note(f"left out degrees {list(degrees)}: time limit reached")
    cases = kept
    too_large = (left_out and not cases) or bool(s.colgen)
    if too_large and len(instance.arrays.speed) < FAST_WARM_GPUS:
        if deadline is None or time.perf_counter() < deadline:
            # no case can be searched (huge batch levels, many stages per domain),
            # or some only with generated configurations (slower): fast's plan
            # is a better warm start there than the baselines
            fast_plan = _fast_plan(instance)
            ev = evaluate(instance, fast_plan)
            if ev.feasible and ev.goodput > s.best_value:
                s.best_plan = fast_plan.with_metrics(**ev.as_metrics())
                s.best_layout = None
                s.best_value = ev.goodput
    cases, dropped = _drop_bounded_cases(s, cases)
    bound = 0.0
    timed_out, interrupted = deadline_hit, False
    try:
        if sub_interrupted:
            raise _Interrupted  # Ctrl-C or cancel during the warm start: stop here too
        if job.batch_policy == "fixed":
            for degrees, factor in cases:
                bound = max(bound, _case_fixed(s, degrees, factor))
        else:
            bound = _elastic(s, cases)
    except _Deadline:
        timed_out = True
        bound = math.inf
    except _Unresolved:  # not a time limit: the search cannot go on without C there
        s.unproven = True
        bound = math.inf
        s.note(
            "stopped: a capacity program was left with lower < upper where the search "
            "needs C (limit unsettled)"
        )
    except (KeyboardInterrupt, _Interrupted):  # Ctrl-C or cancel: the best plan so far
        interrupted = True
        bound = math.inf
    except ModelTooLarge as err:  # should not happen after the check above
        s.unproven = True
        bound = math.inf
        s.note(f"exact model too large: {err}")
    bound = max(bound, dropped)  # the cases left out by their bounds
    if left_out:
        bound = math.inf  # the search bounds cover the cases searched only
    exact_model = not prep.inexact
    if prep.inexact:
        settled = not (timed_out or interrupted or s.unproven or left_out)
        model_bound = max(min(bound, s.global_bound), s.best_value)
        bound = math.inf  # the search bounds hold for fastest-first placements only
        if settled and relax_racks and model_bound <= s.best_value * (1 + 2 * REL_TOL):
            relaxed = _relaxed_bound(s, deadline, theta_search)
            if relaxed is not None:
                bound, exact_model, limit = relaxed
                timed_out = limit is Limit.TIME
                interrupted = limit is Limit.INTERRUPTED
        if not exact_model:
            s.note(f"not proven optimal: {prep.inexact}", keep=log)
    bound = max(min(bound, s.global_bound), s.best_value)
    proven = (
        exact_model
        and not timed_out
        and not s.unproven
        and bound <= s.best_value * (1 + 2 * REL_TOL)
    )
    if s.best_value <= 0 and not timed_out and not s.unproven and bound <= 0:
        proven = True
    return Outcome(
        plan=s.best_plan,
        bound=None if math.isinf(bound) else bound,
        proven=proven,
        # stopped without a proof before any limit: say so (never `none` with no proof)
        limit=stop_limit(interrupted=interrupted, timed_out=timed_out, proven=proven),
        log=tuple(s.log),
        stats={"goodput": s.best_value, "evaluations": s.evaluations},
        layout=_plan_layout(instance, s.best_plan, s.best_layout),
    )


def _relaxed_bound(
    s: _Search, deadline: float | None, theta_search: str
) -> tuple[float, bool, Limit] | None:
    """A bound on every plan from the rack-merged relaxation
    (:func:`~ntp_opt.planners.exact.model.rack_relaxed`), searched with the time left
    and the incumbent as its warm start: ``(bound, proven, limit)``, where ``proven``
    says the relaxation's own model was exact and its search finished (then ``bound``
    is its proven optimum), or ``None`` (no relaxation, or it is not exact either)."""
    relaxed = rack_relaxed(s.prep)
    if relaxed is None:
        return None
    if prepare(relaxed).inexact:
        return None
    remaining = None if deadline is None else deadline - time.perf_counter()
    if remaining is not None and remaining <= 0.01:
        return math.inf, False, Limit.TIME
    # the relaxation's incumbents are not plans of the instance: no reports, the
    # caller's cancel token only
    control = None if s.control is None else Control("relaxed", cancel=s.control.cancel)
    try:
        out = solve_exact(
            relaxed,
            s.backend,
            time_limit=remaining,
            threads=s.threads,
            seed=s.seed,
            initial_plan=s.best_plan,
            log=s.keep_log,
            control=control,
            report_bounds=False,
            theta_search=theta_search,
            relax_racks=False,
        )
    except NoClusterGraph:  # a warm start that reads the graph: no proof, no failure
        s.note("racks merged per power unit: a warm start needs the cluster graph")
        return None
    s.evaluations += int(out.stats["evaluations"])
    value = float(out.stats["goodput"])
    bound = math.inf if out.bound is None else float(out.bound)
    s.note(
        f"racks merged per power unit (a relaxation): optimum {value:.9g}"
        f"{'' if out.proven else ' not proven'}, bound {bound:.9g}, limit {out.limit.value}"
    )
    return bound, out.proven, out.limit


def _plan_layout(instance: Instance, plan: Plan, layout: Layout | None) -> Layout | None:
    """``layout`` when the search built the plan, else the warm start's, read from it."""
    if layout is not None or not plan.replicas:
        return layout
    try:
        return Layout.from_plan(instance, plan)
    except KeyError:  # a warm start naming unknown nodes (it was not feasible, then)
        return None
