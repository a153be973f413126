"""The exact search over the step time, asking the capacity oracle at each.

``C(theta')`` (:meth:`~ntp_opt.planners.exact.oracle.CapacitySearch.capacity`) is
a non-decreasing step function of the pre-overhead step time ``theta'``.

* ``fixed`` (:func:`case_fixed`): the goodput is ``B / theta``, so the search
  wants the smallest ``theta'`` with ``C(theta') >= B``: bisection
  (:func:`min_theta`), over the finite set of jumps without power boost, on the
  continuous axis (to the tolerance) with it.
* ``elastic`` (:func:`elastic`): the goodput is ``min(B, C(theta')) / theta'``,
  maximal at a jump of ``C``: a descent over the levels of ``C``
  (:func:`descend`, the default), or a best-first branch and bound over
  step-time intervals.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

import numpy as np

from ntp_opt.planners.bounds import stage_bound
from ntp_opt.planners.exact.model import MAX_CONFIGS, Prepared
from ntp_opt.planners.exact.oracle import (
    CapacitySearch,
    SearchDeadline,
    Unresolved,
    theta_range,
)
from ntp_opt.rules.power import can_boost
from ntp_opt.rules.tolerances import EDGE_SLACK, FLOAT_NOISE, PROBE_STEP, REL_TOL
from ntp_opt.rules.validate import evaluate

Case = tuple[tuple[int, ...], float]


def jump_times(prep: Prepared, degrees: tuple[int, ...]) -> np.ndarray | None:
    """Sorted step times where ``C`` can jump, or ``None`` when power makes them continuous.

    Parameters
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.
    degrees
        TP degrees replicas may use.

    Returns
    -------
    numpy.ndarray or None
        ``b seq_time / (f(t) s)`` over the levels, degrees and speeds; ``None``
        with power boost or when there are too many.
    """
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


def min_theta(
    s: CapacitySearch,
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

    Parameters
    ----------
    s
        The search.
    degrees
        TP degrees replicas may use.
    target
        The level ``C`` must reach.
    lo, hi
        The bracket.
    alternate
        Alternate probes and midpoints strictly (continuous axis).

    Returns
    -------
    (float, float)
        A step time where ``C >= target`` and one below which ``C < target``.
    """
    cands = jump_times(s.prep, degrees)
    if cands is not None:
        return _min_listed(s, degrees, target, lo, hi, cands)
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


def _min_listed(
    s: CapacitySearch,
    degrees: tuple[int, ...],
    target: int,
    lo: float,
    hi: float,
    cands: np.ndarray,
) -> tuple[float, float]:
    """:func:`min_theta` over the finite set of step times where ``C`` can jump."""
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


def _case_bound(s: CapacitySearch, degrees: tuple[int, ...]) -> float:
    """The best goodput bound known for the plans of one case (``inf``: none)."""
    return min(s.global_bound, s.case_bounds.get(degrees, math.inf))


def drop_bounded_cases(
    s: CapacitySearch, cases: list[tuple[tuple[int, ...], float]]
) -> tuple[list[tuple[tuple[int, ...], float]], float]:
    """Per case, its capacity bound (:func:`~ntp_opt.planners.bounds.stage.stage_bound`
    restricted to the case's plans); a case whose bound is within the tolerance of
    the incumbent is not searched.

    Parameters
    ----------
    s
        The search.
    cases
        ``(degrees, factor)`` per case.

    Returns
    -------
    (list, float)
        The cases to search and the largest bound of those left out (``0.0``: none).
    """
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


def _bound_floor(s: CapacitySearch, degrees: tuple[int, ...], target: int, factor: float) -> float:
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


def case_fixed(s: CapacitySearch, degrees: tuple[int, ...], factor: float) -> float:
    """Search one degree set under ``fixed``; returns the case's goodput bound.

    Parameters
    ----------
    s
        The search.
    degrees
        TP degrees replicas may use.
    factor
        The case's step-time factor (``1 + reshard_overhead`` with reduced degrees).

    Returns
    -------
    float
        An upper bound on the goodput of the case's plans.
    """
    job = s.prep.instance.job
    lo, hi = theta_range(s.prep, degrees)
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
            raise Unresolved
        # warm start: the incumbent's step time is feasible if its plan fits this case
        inc = s.best_plan
        if inc.replicas and all(r.tp in degrees for r in inc.replicas):
            ev = evaluate(s.prep.instance, inc)
            theta_inc = ev.step_time / (factor if any(r.tp < job.tp for r in inc.replicas) else 1.0)
            if lo < theta_inc < hi:
                low, up, tight = s.capacity(theta_inc * (1 + FLOAT_NOISE), degrees, big_b)
                if low >= big_b:
                    hi = min(hi, tight)
    hi, lo = min_theta(s, degrees, big_b, lo, hi, alternate=True)
    return big_b / (lo * factor)


#: Share of the time left that the probe against the incumbent may take (fixed batch).
PRUNE_SHARE = 0.2


def _fixed_prune(
    s: CapacitySearch, degrees: tuple[int, ...], factor: float, lo: float, hi: float
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
    except SearchDeadline:
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


@dataclass
class _Intervals:
    """The step-time intervals of :func:`elastic` and the best goodput found."""

    s: CapacitySearch
    cases: list[Case]
    best: float = 0.0
    # intervals (-upper bound, a, C(a), b, C(b), b is a tight point, case)
    heap: list[tuple[float, float, int, float, int, bool, int]] = field(default_factory=list)
    above: float = 0.0  # bound on the goodput above the range of a case whose top was not solved

    def push(self, i: int, a: float, ca: int, b: float, cb: int, tight_end: bool) -> None:
        """The interval ``[a, b]`` of case ``i`` (its left end raises ``best``)."""
        big_b = self.s.prep.instance.job.global_batch
        factor = self.cases[i][1]
        self.best = max(self.best, min(big_b, ca) / (a * factor))
        if ca >= cb:
            return  # C constant on [a, b]: its best point is a
        heapq.heappush(self.heap, (-min(big_b, cb) / (a * factor), a, ca, b, cb, tight_end, i))


def elastic(s: CapacitySearch, cases: list[Case]) -> float:
    """Search every degree set under ``elastic``; returns the goodput bound.

    First, per case, the step time where ``C`` first reaches its largest useful
    value (a fixed-batch search: good plans come early); then one best-first
    branch and bound over the step-time intervals of all cases.

    Parameters
    ----------
    s
        The search.
    cases
        ``(degrees, factor)`` per case.

    Returns
    -------
    float
        An upper bound on the goodput of the cases' plans.
    """
    iv = _Intervals(s, cases)
    for i, (degrees, factor) in enumerate(cases):
        _elastic_start(iv, i, degrees, factor)
    cands = [jump_times(s.prep, degrees) for degrees, _ in cases]
    if s.theta_search == "descent":
        # largest bound first: its descent raises the incumbent for the others
        bound = 0.0
        best = iv.best
        for _, a, ca, b, cb, _, i in sorted(iv.heap):
            best, case_bound = descend(s, cases[i], cands[i], (a, ca), (b, cb), best)
            bound = max(bound, case_bound)
        return max(best, bound, iv.above)
    return _branch_intervals(iv, cands)


def _elastic_start(iv: _Intervals, i: int, degrees: tuple[int, ...], factor: float) -> None:
    """The first interval of case ``i`` (its top solved unless the incumbent settles it)."""
    s = iv.s
    job = s.prep.instance.job
    big_b = job.global_batch
    lo, hi = theta_range(s.prep, degrees)
    most = min(big_b, job.replicas_max * min(job.local_batch_max, big_b))
    if s.theta_search == "descent" and most / (hi * factor) < s.best_value * (1 + REL_TOL):
        # no program at the top of the range: above it G <= min(B, dp_max M) /
        # (hi factor), which the incumbent reaches, and the descent's first
        # program asks at once whether the largest level beats the incumbent
        c_max = 0
        up = most
        iv.above = max(iv.above, most / (hi * factor))
        if s.keep_log:
            s.log.append(
                f"theta'={hi:.9g} degrees={list(degrees)}: top of the range not solved "
                f"(G <= {most / (hi * factor):.9g} there)"
            )
    else:
        c_max, up, _ = s.capacity(hi, degrees)
        if c_max < up:
            raise Unresolved
    if up == 0:
        return
    c_hi, up_hi = c_max, up
    if s.theta_search == "bnb":
        top = min(big_b, c_max)
        hi, _ = min_theta(s, degrees, top, max(lo, _bound_floor(s, degrees, top, factor)), hi)
        # C at the top of the search range: the solution's value for the incumbent,
        # the proven upper bound for the intervals below (they differ where the
        # generated configurations leave a gap, e.g. right at a tight point, where
        # the mW rounding may refuse the solution that was tightened there)
        c_hi, up_hi, _ = s.capacity(hi, degrees)
    # (the descent starts at the top of the range: its first program asks whether
    # the largest level beats the incumbent, where the search for the step time at
    # which C reaches it would follow tight points down one solution at a time)
    iv.best = max(iv.best, c_hi / (hi * factor))
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
            raise Unresolved  # the descent needs no more than the step time
    iv.push(i, lo, c_lo, hi, up_hi, True)


def _branch_intervals(iv: _Intervals, candidates: list[np.ndarray | None]) -> float:
    """The best-first branch and bound over the intervals (``theta_search="bnb"``)."""
    s = iv.s
    big_b = s.prep.instance.job.global_batch
    heap = iv.heap
    while heap:
        neg_ub, a, ca, b, cb, tight_end, i = heap[0]
        if min(-neg_ub, s.global_bound) <= max(iv.best, s.best_value) * (1 + REL_TOL):
            break
        heapq.heappop(heap)
        degrees, factor = iv.cases[i]
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
            raise Unresolved
        # the solution at mid still fits at `tight`: C is constant on [tight, mid]
        tight = min(max(a, tight), mid)
        iv.best = max(iv.best, min(big_b, c_mid) / (tight * factor))
        if tight > a:
            iv.push(i, a, ca, tight, c_mid, tight < mid)
        iv.push(i, mid, c_mid, b, cb, tight_end)
    remaining = max((-item[0] for item in heap), default=0.0)
    return max(iv.best, remaining)


#: Levels below a level at which a better plan was found that the descent looks at
#: first (doubled after every look-ahead that finds a better plan still).
LOOK_AHEAD = 2


def descend(
    s: CapacitySearch,
    case: Case,
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

    Parameters
    ----------
    s
        The search.
    case
        ``(degrees, factor)``.
    cands
        The step times where ``C`` can jump (:func:`jump_times`), or ``None``.
    low_end, high_end
        ``(a, C(a))`` and ``(b, C(b))``.
    best
        The best goodput found so far.

    Returns
    -------
    (float, float)
        ``best`` (raised by the solutions found) and the largest goodput bound
        of the step times passed over (``0`` when nothing was passed over).
    """
    d = _Descent(s, case, cands, low_end[0], high_end[0], high_end[1], best)
    while d.theta > d.lo:
        done = d.step()
        if done is not None:
            return d.best, done
    return d.best, d.bound


@dataclass
class _Descent:
    """The state of :func:`descend`: the level ``C`` is known to stay under below ``theta``."""

    s: CapacitySearch
    case: Case
    cands: np.ndarray | None
    lo: float
    theta: float
    level: int
    best: float
    bound: float = 0.0
    # (step time, upper bound on C there) of look-aheads
    caps: list[tuple[float, int]] = field(default_factory=list)
    stride: int = LOOK_AHEAD

    def step(self) -> float | None:
        """One step of the descent (at most one program); the case's bound when it ends."""
        s = self.s
        degrees, factor = self.case
        big_b = s.prep.instance.job.global_batch
        lam = max(self.best, s.best_value)
        case_bound = _case_bound(s, degrees)
        if case_bound <= lam * (1 + REL_TOL):
            # the case's capacity bound closes what is left: [lo, theta) is bounded by it
            return max(self.bound, case_bound)
        nxt = min(big_b, self.level) / (lam * factor * (1 + REL_TOL))
        if nxt <= self.lo:
            # [lo, theta) below lam (1 + tol); G(lo) itself is in `best` already
            return max(self.bound, min(big_b, self.level) / (self.lo * factor))
        probe = nxt
        if self.cands is not None:
            k = int(np.searchsorted(self.cands, nxt, side="right")) - 1  # last candidate <= nxt
            if k < 0 or self.cands[k] <= self.lo:
                # C is constant on [lo, nxt]: the goodput there is at most G(lo)
                return max(self.bound, min(big_b, self.level) / (nxt * factor))
            probe = float(self.cands[k])
            if probe >= self.theta:
                self._exact_at(probe)
                return None
        if probe >= self.theta:
            # the last program left lower < upper and its upper bound did not
            # lower the level: the step times right below it stay open
            raise Unresolved
        self.bound = max(self.bound, min(big_b, self.level) / (nxt * factor))
        known = min((u for at, u in self.caps if at >= probe), default=self.level)
        if known < self.level:  # a look-ahead below showed C(probe) <= C(at) <= known
            self.theta, self.level = probe, known
            return None
        self._probe(probe)
        return None

    def _exact_at(self, probe: float) -> None:
        """``C`` itself at a candidate a relaxation bounded, where ``G`` may beat the incumbent
        (``C`` is constant up to the next candidate)."""
        degrees, factor = self.case
        big_b = self.s.prep.instance.job.global_batch
        c_e, up_e, _ = self.s.capacity(probe, degrees)
        if c_e < up_e:
            raise Unresolved
        self.best = max(self.best, min(big_b, c_e) / (probe * factor))
        self.level = min(self.level, c_e)

    def _probe(self, probe: float) -> None:
        """Whether ``C(probe)`` stays at the level; only ``C(probe) < level`` moves on."""
        s = self.s
        degrees, factor = self.case
        big_b = s.prep.instance.job.global_batch
        # the LP relaxation often shows it
        c_p, up_p, tight = s.capacity(probe, degrees, self.level, descent=True)
        if c_p < up_p and up_p < self.level:  # the LP's bound on C(probe): a lower level
            self.theta, self.level = probe, up_p
            return
        tight = min(max(self.lo, tight), probe)
        self.best = max(self.best, min(big_b, c_p) / (tight * factor))
        if c_p < up_p:
            # not proven: the upper bound is the level below the probe (only upper
            # bounds of C enter the proof; a solution only raises the incumbent)
            s.note(f"theta'={probe:.9g} degrees={list(degrees)}: C in [{c_p}, {up_p}]")
        if c_p >= self.level and self.cands is None:
            self.best, self.stride = look_ahead(
                s, self.case, (self.lo, probe), self.level - self.stride, self.best,
                self.caps, self.stride,
            )  # fmt: skip
        self.theta, self.level = probe, min(self.level, up_p)


def look_ahead(
    s: CapacitySearch,
    case: tuple[tuple[int, ...], float],
    window: tuple[float, float],
    level: int,
    best: float,
    caps: list[tuple[float, int]],
    stride: int,
) -> tuple[float, int]:
    """One program of :func:`descend` ahead of its order: ``C >= level`` at the step
    time where that level would beat the incumbent, inside ``window``.

    Where the power budget lets each level below run a little faster, the
    incumbent improves by a little at every level, and the descent would solve
    one integer program per level; a look-ahead that finds a plan skips the
    integer programs of the levels between (their turn comes with the higher
    incumbent, where a relaxation usually rules them out). A look-ahead that
    does not find one leaves its upper bound on ``C`` in ``caps`` for the
    descent to use when it gets there.

    Parameters
    ----------
    s
        The search.
    case
        ``(degrees, factor)``.
    window
        The open interval of step times the program may be at.
    level
        The level asked for.
    best
        The best goodput found so far.
    caps
        ``(step time, upper bound on C)`` of earlier look-aheads (appended to).
    stride
        The current stride.

    Returns
    -------
    (float, int)
        ``best`` and the next stride.
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
