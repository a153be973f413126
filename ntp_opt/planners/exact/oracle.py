"""The capacity oracle of the exact search: bounds on ``C(theta')`` at one step time.

:class:`CapacitySearch` holds the state of one exact search (incumbent, log,
deadline, control) and answers "how large is ``C(theta')``?" (or "does it reach
a target?") with the cheapest program that decides it: the LP or mixed
relaxation, the full capacity program
(:func:`~ntp_opt.planners.exact.capacity.build_capacity`), column generation
(:mod:`ntp_opt.planners.exact.colgen`), the merged program
(:func:`~ntp_opt.planners.exact.merged.merged_capacity`). Every solution it finds
becomes a plan (:func:`build_layout`) offered to the incumbent. The step-time
searches that ask it are in :mod:`ntp_opt.planners.exact.steptime`; the planner
is :func:`ntp_opt.planners.exact.search.solve_exact`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ntp_opt.model.control import Control
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan
from ntp_opt.planners.exact.backends import solve_or_highs, solve_program
from ntp_opt.planners.exact.backends.base import RelaxingBackend, registered
from ntp_opt.planners.exact.capacity import Capacity, build_capacity, iter_stages, level_floor
from ntp_opt.planners.exact.colgen import ColumnGeneration, MasterResult
from ntp_opt.planners.exact.merged import merged_capacity
from ntp_opt.planners.exact.model import DeadlineReached, ModelTooLarge, Prepared, StagePick
from ntp_opt.planners.exact.program import IntProgram, IntSolution
from ntp_opt.planners.exact.tighten import tighten
from ntp_opt.rules.goodput import replica_speed, split_batch
from ntp_opt.rules.power import largest_cap
from ntp_opt.rules.tolerances import EDGE_SLACK, FLOAT_NOISE, INT_ROUND_TOL
from ntp_opt.rules.validate import evaluate

logger = logging.getLogger(__name__)


class SearchDeadline(Exception):
    """The deadline passed during the search."""


class SearchInterrupted(Exception):
    """The cancel token was set (or the backend was interrupted)."""


class Unresolved(Exception):
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
#: Branch-and-bound nodes HiGHS gets for the merged program (``CapacitySearch._merged_bound``):
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
class CapacitySearch:
    """One exact search's state and its capacity oracle (:meth:`capacity`).

    Attributes
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.
    backend
        Backend of the integer programs.
    deadline
        :func:`time.perf_counter` value, or ``None``.
    threads, seed
        Passed to the backends.
    keep_log
        Keep one log line per program in :attr:`log`.
    best_plan, best_value
        The incumbent (validated) and its goodput.
    """

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
    theta_search: str = "descent"  # elastic: "descent" (steptime.descend) or "bnb" (interval B&B)
    case_bounds: dict[tuple[int, ...], float] = field(default_factory=dict)  # per degree set
    # degree sets whose programs are built in full and solved by HiGHS: small ones
    # from the start (small_full_program), else once the full program closed a gap
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
        question of :func:`~ntp_opt.planners.exact.steptime.descend`: how far below
        ``target`` is ``C``): every level is listed, and the LP answers whenever its
        value rounded down (to :data:`LP_FLOOR_TOL`) is below ``target``.

        Parameters
        ----------
        theta
            Step time before the resharding factor.
        degrees
            TP degrees replicas may use.
        target
            The level asked about, or ``None`` for ``C`` itself.
        descent
            The descent's question (see above).

        Returns
        -------
        (int, int, float)
            ``lower``, ``upper`` and the tight step time.
        """
        remaining = self._time_left()
        # configurations generated on demand, unless the full program settled C
        # for these degrees before (then it is solved by HiGHS at every step time)
        full = degrees in self.full_highs
        generated = None if full else self.colgen.get(degrees)
        floor = self._floor(target, generated is None and not descent)
        try:
            cap, master = self._program(theta, degrees, target, generated, floor)
        except ModelTooLarge:
            if not full:
                raise
            self.full_highs.discard(degrees)  # too large at this step time: generate again
            return self.capacity(theta, degrees, target, descent=descent)
        self.evaluations += 1
        settled: int | None = None  # the upper bound after _settle
        settled_sol: IntSolution | None = None
        if master is not None:
            cap, settled_sol, settled = self._settle_open(
                theta, degrees, target, descent, cap, master
            )
        # a program without the levels below `floor` bounds C only against the target
        below = target - 1 if floor > 1 and target is not None else None
        if not cap.classes:
            if below is not None:
                return 0, below, theta
            if master is None:
                return 0, 0, theta
            return 0, master.upper if settled is None else settled, theta
        if master is None and target is not None:
            answer = self._relaxed_answer(cap, theta, degrees, target, descent, remaining)
            if answer is not None:
                return 0, answer if below is None else below, theta
        sol = self._solution(cap, full, master, settled_sol)
        lower, upper = self._bounds(sol, master, settled, below)
        tight = self._use_solution(cap, sol, lower, theta)
        self._log_program(theta, degrees, cap, sol, tight)
        if sol.interrupted or (self.control is not None and self.control.cancelled):
            raise SearchInterrupted
        if sol.time_limit_hit and sol.status != "optimal":
            raise SearchDeadline
        return lower, upper, tight

    def _floor(self, target: int | None, full_program: bool) -> int:
        """The lowest batch level the program lists (1: every level)."""
        fixed = self.prep.instance.job.batch_policy == "fixed"
        if target is not None and full_program and fixed:
            # fixed batch only: elsewhere (the elastic search for the top step time on
            # racks shared by domains) the program without the low levels can be far
            # harder to prove below the target than the full one
            return level_floor(self.prep, target)
        return 1

    def _time_left(self) -> float | None:
        """Seconds to the deadline (``None``: none); stops a cancelled or late search."""
        remaining = None
        if self.control is not None and self.control.cancelled:
            raise SearchInterrupted
        if self.deadline is not None:
            remaining = self.deadline - time.perf_counter()
            if remaining <= 0.01:
                raise SearchDeadline
        return remaining

    def _cancel(self) -> threading.Event | None:
        """The control's cancel token, if any."""
        return None if self.control is None else self.control.cancel

    def _program(
        self,
        theta: float,
        degrees: tuple[int, ...],
        target: int | None,
        generated: ColumnGeneration | None,
        floor: int,
    ) -> tuple[Capacity, MasterResult | None]:
        """The full program from ``floor``, or the generated master (and its result)."""
        job = self.prep.instance.job
        try:
            if generated is None:
                return build_capacity(self.prep, theta, degrees, self.deadline, floor), None
            master = generated.solve(
                theta, self.backend, deadline=self.deadline, threads=self.threads,
                seed=self.seed, cancel=self._cancel(), target=target,
                bound=lambda: self._merged_bound(theta, degrees, job.global_batch),
            )  # fmt: skip
        except DeadlineReached:
            raise SearchDeadline from None
        return master.capacity, master

    def _settle_open(
        self,
        theta: float,
        degrees: tuple[int, ...],
        target: int | None,
        descent: bool,
        cap: Capacity,
        master: MasterResult,
    ) -> tuple[Capacity, IntSolution | None, int | None]:
        """The program, the full program's solution and the upper bound after
        :meth:`_settle`, where the generated master left ``C`` open as the search
        needs it (``(cap, None, None)`` elsewhere)."""
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
            return (cap if full_cap is None else full_cap), settled_sol, settled
        return cap, None, None

    def _solution(
        self,
        cap: Capacity,
        full: bool,
        master: MasterResult | None,
        settled_sol: IntSolution | None,
    ) -> IntSolution:
        """The integer program solved (the full one), or the generated master's answer."""
        if master is not None:
            return master.solution if settled_sol is None else settled_sol
        return solve_or_highs(
            cap.program,
            "highs" if full else self.backend,
            deadline=self.deadline,
            threads=self.threads,
            seed=self.seed,
            cancel=self._cancel(),
            work=FULL_WORK,
        )

    def _bounds(
        self,
        sol: IntSolution,
        master: MasterResult | None,
        settled: int | None,
        below: int | None,
    ) -> tuple[int, int]:
        """``(lower, upper)`` on ``C`` from the solution (and the generated bounds)."""
        job = self.prep.instance.job
        lower = int(sol.objective) if sol.objective is not None else 0
        if master is not None:
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
        return lower, upper

    def _use_solution(self, cap: Capacity, sol: IntSolution, lower: int, theta: float) -> float:
        """The solution's tight step time; its plan offered to the incumbent."""
        job = self.prep.instance.job
        tight = theta
        if sol.x is not None and lower > 0:
            stages = list(iter_stages(self.prep, cap, sol.x))
            tight, powers = tighten(self.prep, stages, theta)
            if self.deadline is not None and time.perf_counter() >= self.deadline:
                raise SearchDeadline
            if job.batch_policy == "elastic" or lower >= job.global_batch:
                self._offer(stages, powers)
        return tight

    def _log_program(
        self,
        theta: float,
        degrees: tuple[int, ...],
        cap: Capacity,
        sol: IntSolution,
        tight: float,
    ) -> None:
        """The log line of one program solved."""
        if self.keep_log or logger.isEnabledFor(logging.DEBUG):
            line = (
                f"theta'={theta:.9g} degrees={list(degrees)} vars={cap.program.n_vars} "
                f"status={sol.status} C={sol.objective} bound={sol.bound} "
                f"tight={tight:.9g} {sol.runtime_s:.3f}s"
            )
            logger.debug("%s", line)
            if self.keep_log:
                self.log.append(line)

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
            raise SearchDeadline
        upper = min(upper, self._merged_bound(theta, degrees, upper))
        if upper <= lower:
            return None, None, lower
        remaining = None if self.deadline is None else self.deadline - time.perf_counter()
        if remaining is not None and remaining <= 0.01:
            raise SearchDeadline
        try:
            full = build_capacity(self.prep, theta, degrees, self.deadline)
        except ModelTooLarge as err:
            self.note(f"theta'={theta:.9g} degrees={list(degrees)}: C in [{lower}, {upper}], "
                      f"full program not built ({err})")  # fmt: skip
            return None, None, upper
        except DeadlineReached:
            raise SearchDeadline from None
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
            raise SearchInterrupted
        found = int(sol.objective) if sol.objective is not None else -1
        if sol.status == "optimal":
            if full.program.n_vars <= FULL_HIGHS_VARS:
                self.full_highs.add(degrees)  # and so at the next step times
            return full, sol, found
        if sol.time_limit_hit:
            raise SearchDeadline
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
            raise SearchDeadline from None
        if merged is None:
            return upper
        remaining = None if self.deadline is None else self.deadline - time.perf_counter()
        if remaining is not None and remaining <= 0.01:
            raise SearchDeadline
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
            raise SearchInterrupted
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
    """:func:`build_layout` in node ids.

    Parameters
    ----------
    prep, stages, powers
        As :func:`build_layout`.

    Returns
    -------
    Plan
    """
    return build_layout(prep, stages, powers).to_plan(prep.instance)


def theta_range(prep: Prepared, degrees: tuple[int, ...]) -> tuple[float, float]:
    """``theta'`` below which no replica carries one sequence; above which all carry the cap.

    The first is ``1 / v_max`` with ``v_max`` the fastest any replica can be.

    Parameters
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.
    degrees
        TP degrees replicas may use.

    Returns
    -------
    (float, float)
        The ends of the step-time range searched.
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


def crowded_class(cap: Capacity) -> int:
    """The most configurations of one domain class in ``cap`` if above
    :data:`COLGEN_CLASS_CONFIGS`, else 0.

    Parameters
    ----------
    cap
        A full capacity program.

    Returns
    -------
    int
    """
    per_class: dict[tuple[tuple[int, ...], int], int] = {}
    for members, pos, _ in cap.columns:
        per_class[(members, pos)] = per_class.get((members, pos), 0) + 1
    most = max(per_class.values(), default=0)
    return most if most > COLGEN_CLASS_CONFIGS else 0


def small_full_program(prep: Prepared, degrees: tuple[int, ...], deadline: float | None) -> bool:
    """Whether the full program at the top of the step-time range (where it is
    largest) has at most :data:`FULL_HIGHS_VARS` variables (0: never) and no
    crowded class.

    Parameters
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.
    degrees
        TP degrees replicas may use.
    deadline
        :func:`time.perf_counter` value, or ``None`` (past it: ``False``).

    Returns
    -------
    bool
    """
    try:
        top = build_capacity(prep, theta_range(prep, degrees)[1], degrees, deadline)
    except (ModelTooLarge, DeadlineReached):  # the search meets the deadline itself
        return False
    return 0 < FULL_HIGHS_VARS and top.program.n_vars <= FULL_HIGHS_VARS and not crowded_class(top)


def many_rack_domains(prep: Prepared) -> bool:
    """Whether the full program would hold too many domains that share racks
    (more than :data:`MULTI_DOMAINS_COLGEN`).

    Parameters
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.

    Returns
    -------
    bool
    """
    return sum(len(prep.units[u].domains) for u in prep.multi) > MULTI_DOMAINS_COLGEN
