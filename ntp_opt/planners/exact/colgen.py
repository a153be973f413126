"""The capacity program ``C(theta')`` with configurations generated on demand.

:func:`ntp_opt.planners.exact.capacity.build_capacity` lists every configuration
of every domain class, which is impossible when a domain hosts many stages
(TP8 on a 72-GPU domain: nine stages, each with its own degree and batch
level). This module solves the same program by column generation:

* the *restricted master LP* holds the configurations generated so far (at
  the start: the configurations that repeat one stage kind as often as it
  fits, and the configurations that were useful at earlier step times). Its
  rows are the ones of :func:`~ntp_opt.planners.exact.capacity.build_capacity`:
  one convexity row per domain class (or domain of a multi-domain unit), a
  row per replica class ``(t, b)`` (stages = ``pp * n[t, b]``), ``dp_max``,
  ``global_batch``, the site budget and the racks of multi-domain units;
* *pricing*: for every owner (domain class, or domain of a multi-domain
  unit) an exact search over the configurations the full program would list
  (stages on consecutive blocks of the domain's GPUs in stage order, kinds
  in non-increasing speed requirement, fitting the unit's rack budgets), for
  the largest ``sum dual(t, b) - dual_site * site_mW - sum dual_rack * rack_mW``:
  a depth-first search bounded by an unbounded knapsack over the positive
  duals. Configurations with a positive reduced cost join the master;
* the *bound*: for any duals (signs as the rows require), the Lagrangian
  value ``sum rhs * dual + sum_owner size * max(0, best price) +
  sum_(t, b) dp_max * max(0, reduced cost of n[t, b])`` bounds ``C(theta')``
  from above, because the pricing is exact over *all* configurations. It is
  evaluated at every round's duals, and the smallest is kept (rounded down:
  ``C`` is an integer). At the LP optimum it equals the LP value;
* the *integer master*: the same integer program as the full model, over the
  generated columns only, solved by one of the exact backends
  (:func:`~ntp_opt.planners.exact.backends.solve_program`): a feasible lower
  bound, with its stages readable by
  :func:`~ntp_opt.planners.exact.capacity.iter_stages`. When it meets the bound,
  ``C(theta')`` is proven (price-and-branch).

The LP is solved with HiGHS (``highspy``, extra ``ntp-opt[highs]``) through
:class:`~ntp_opt.planners.exact.backends.highs.HighsLP`, imported lazily.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ntp_opt.planners.exact.backends import get_backend, load_backend, solve_or_highs
from ntp_opt.planners.exact.backends.highs import HighsLP
from ntp_opt.planners.exact.capacity import Capacity, CapacityBuilder
from ntp_opt.planners.exact.choice_pricing import ListedPricing
from ntp_opt.planners.exact.configs import max_level, stage_power
from ntp_opt.planners.exact.model import (
    MAX_CONFIGS,
    WHOLE_UNIT,
    Config,
    DeadlineReached,
    Domain,
    ModelTooLarge,
    Prepared,
    StageChoice,
    Unit,
    unit_domain,
    unit_key,
)
from ntp_opt.planners.exact.program import IntProgram, IntSolution, Row
from ntp_opt.rules.power import MW, ceil_mw, extra_draw, fits_mw

__all__ = [
    "ColumnGeneration",
    "MasterResult",
    "Owner",
    "Pricing",
    "ceil_mw",
    "column_generation_available",
    "column_generation_for",
    "owner_domain",
    "owners",
    "stage_options",
]

#: Largest number of stage kinds ``(t, b)`` of one domain at one step time.
MAX_KINDS = 2_000
#: Columns added per owner and pricing round (the best ones).
COLUMNS_PER_ROUND = 4
#: Reduced cost a column needs to join the master.
PRICE_EPS = 1e-7
#: Most configurations listed to close a gap between the LP bound and the integer master.
ENUM_LIMIT = 5_000
#: Configurations per owner offered to the integer master when it misses the LP bound.
NEAR_COLUMNS = 40
#: Gap (``C`` units) below which listing configurations is tried before branching.
ENUM_GAP = 2
#: Nodes of the branch and bound over replica counts, per step time.
MAX_NODES = 40
#: Nodes of the branch and bound that only asks whether ``C`` reaches a target, run
#: when the program stays open at or above the target (nodes below it are pruned).
TARGET_NODES = 400
#: Patterns kept per owner between step times.
POOL_SIZE = 400
#: CP-SAT's deterministic time (about CPU seconds) on one integer master; past it the
#: master goes to HiGHS (always there: it solves the master LP), which solves the
#: masters CP-SAT finds hard (e.g. 211 columns at 131k DGX GPUs: HiGHS 1 s, CP-SAT
#: more than 19 s) in about a second.
MASTER_WORK = 1.0


def _check(deadline: float | None) -> None:
    if deadline is not None and time.perf_counter() >= deadline:
        raise DeadlineReached("time limit reached during column generation")


@dataclass(frozen=True)
class Owner:
    """Who a configuration column belongs to: a domain class or one domain of a multi-domain unit.

    Attributes
    ----------
    units
        Unit indices sharing the column (the class members; one unit for a
        multi-domain unit).
    pos
        Position of the domain in its unit, or
        :data:`~ntp_opt.planners.exact.model.WHOLE_UNIT` when a column holds a whole
        multi-domain unit (:func:`~ntp_opt.planners.exact.model.unit_domain`).
    size
        Upper bound of a column (units of the class; 1 for a multi-domain unit).
    multi
        Index of the unit in :attr:`Prepared.units` when its racks are rows
        of the master (a multi-domain unit), else ``None``.
    """

    units: tuple[int, ...]
    pos: int
    size: int
    multi: int | None


def owners(prep: Prepared, *, group_units: bool = False) -> list[Owner]:
    """The column owners of the capacity program, in the order of ``build_capacity``.

    Parameters
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.
    group_units
        Multi-domain units (NVL8 racks) as whole units: a column then holds the
        configurations of all the unit's domains, fits its racks by itself, and
        interchangeable units (:func:`~ntp_opt.planners.exact.model.unit_key`) share
        one owner of their number. Without it, one owner per domain of such a unit,
        with its racks as rows (as ``build_capacity``).

    Returns
    -------
    list of Owner
    """
    out = [Owner(tuple(members), 0, len(members), None) for members in prep.classes]
    if group_units:
        grouped: dict[tuple[object, ...], list[int]] = {}
        for u in prep.multi:
            grouped.setdefault(unit_key(prep, u), []).append(u)
        out.extend(Owner(tuple(us), WHOLE_UNIT, len(us), None) for us in grouped.values())
        return out
    for u in prep.multi:
        for pos in range(len(prep.units[u].domains)):
            out.append(Owner((u,), pos, 1, u))
    return out


def owner_domain(prep: Prepared, owner: Owner) -> Domain:
    """The domain an owner's columns configure (a segmented one for a whole unit)."""
    if owner.pos == WHOLE_UNIT:
        return unit_domain(prep, owner.units[0])
    return prep.domains[prep.units[owner.units[0]].domains[owner.pos]]


def _segments(dom: Domain) -> list[tuple[int, int]]:
    """``(start, end)`` of each segment of a domain (one for a real domain)."""
    h = len(dom.gpus)
    if dom.seg_end is None:
        return [(0, h)]
    out = []
    start = 0
    while start < h:
        end = int(dom.seg_end[start])
        out.append((start, end))
        start = end
    return out


def stage_options(
    prep: Prepared, dom: Domain, theta: float, degrees: tuple[int, ...]
) -> list[tuple[int, int]]:
    """Stage kinds ``(t, b)`` a configuration of ``dom`` may hold at ``theta``, in the
    order of :func:`~ntp_opt.planners.exact.configs.domain_configs`: non-increasing speed
    requirement ``b / f(t)`` (ties: larger ``t``, then larger ``b`` first).

    Raises
    ------
    ModelTooLarge
        More than :data:`MAX_KINDS` kinds.
    """
    job = prep.instance.job
    segments = _segments(dom)
    options: list[tuple[float, int, int]] = []
    for t in degrees:
        firsts = [float(dom.speed[a + t - 1]) for a, e in segments if a + t <= e]
        if not firsts:
            continue
        top = max_level(prep, t, max(firsts), theta)
        if len(options) + top > MAX_KINDS:
            raise ModelTooLarge(
                f"domain {prep.instance.arrays.domain_ids[dom.index]!r} has more than "
                f"{MAX_KINDS} stage kinds at this step time"
            )
        for b in range(1, top + 1):
            options.append((b / job.tp_factor(t), t, b))
    options.sort(key=lambda o: (-o[0], -o[1], -o[2]))
    return [(t, b) for _, t, b in options]


def _skips_useless(dom: Domain) -> bool:
    """Whether leaving out a stage never hurts the stages after it (one TDP and one
    rack in the domain, caps non-increasing in stage order): then stage kinds with a
    non-positive dual can be left out of pricing without changing its maximum."""
    return len(dom.gpus) <= 1 or (
        len(set(dom.tdp.tolist())) == 1
        and len(set(dom.rack_pos.tolist())) == 1
        and not bool(np.any(np.diff(dom.cap) > 0))
    )


class Pricing:
    """Configurations of one owner at one step time: placement table and exact pricing.

    Parameters
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.
    owner
        The owner.
    theta
        Step time before the resharding factor.
    degrees
        TP degrees replicas may use.
    """

    def __init__(
        self, prep: Prepared, owner: Owner, theta: float, degrees: tuple[int, ...]
    ) -> None:
        self.prep = prep
        self.owner = owner
        self.theta = theta
        self.unit: Unit = prep.units[owner.units[0]]
        self.dom: Domain = owner_domain(prep, owner)
        self.n_racks = len(self.unit.racks)
        self.h = len(self.dom.gpus)
        self.segmented = self.dom.seg_end is not None
        # per GPU position: where its segment ends (the domain's end for a real one)
        self.seg_end: list[int] = (
            [self.h] * self.h if self.dom.seg_end is None else self.dom.seg_end.tolist()
        )
        self.options = stage_options(prep, self.dom, theta, degrees)
        self.index = {kind: j for j, kind in enumerate(self.options)}
        self.skip_useless = _skips_useless(self.dom)
        self._idle_frac = prep.instance.job.idle_power_fraction
        self._place: dict[tuple[int, int], tuple[float, tuple[float, ...]] | None] = {}
        self._table: list[list[tuple[float, tuple[float, ...]] | None]] | None = None
        self._draws: list[list[float]] | None = None
        self._blocks: dict[tuple[int, int], tuple[float, float, int]] = {}
        self._block_ids: dict[tuple[bytes, bytes], int] = {}
        self._power: dict[tuple[int, int, float, float], float | None] = {}
        self._adds: dict[tuple[int, float], tuple[float, ...]] = {}
        self._room = [
            budget - ceil_mw(idle)
            for idle, budget in zip(self.unit.idle_w, self.unit.budget_mw, strict=True)
        ]

    def place(self, j: int, start: int) -> tuple[float, tuple[float, ...]] | None:
        """Power multiplier and extra draw per rack of option ``j`` at GPU ``start``
        (``None``: the block does not exist or cannot carry it)."""
        key = (j, start)
        if key in self._place:
            return self._place[key]
        t, b = self.options[j]
        out: tuple[float, tuple[float, ...]] | None = None
        if start < self.h and start + t <= self.seg_end[start]:
            slowest, hi, block = self._block(start, t)
            # blocks alike (same slowest speed, cap, TDPs and racks: most of a domain
            # without stragglers) share the power and the draw, computed once
            pkey = (t, b, slowest, hi)
            if pkey in self._power:
                pi = self._power[pkey]
            else:
                pi = stage_power(self.prep, t, b, slowest, self.theta, hi)
                self._power[pkey] = pi
            if pi is not None:
                akey = (block, pi)
                add = self._adds.get(akey)
                if add is None:
                    dom = self.dom
                    span = slice(start, start + t)
                    drawn = np.zeros(self.n_racks)
                    np.add.at(
                        drawn, dom.rack_pos[span], extra_draw(dom.tdp[span], pi, self._idle_frac)
                    )
                    add = tuple(drawn.tolist())
                    self._adds[akey] = add
                out = (pi, add)
        self._place[key] = out
        return out

    def _block(self, start: int, t: int) -> tuple[float, float, int]:
        """Slowest speed and cap of the ``t`` GPUs from ``start``, and an id shared by
        the blocks with the same TDPs and racks in the same order."""
        key = (start, t)
        got = self._blocks.get(key)
        if got is None:
            dom = self.dom
            span = slice(start, start + t)
            sig = (dom.tdp[span].tobytes(), dom.rack_pos[span].tobytes())
            ident = self._block_ids.setdefault(sig, len(self._block_ids))
            got = (float(dom.speed[start + t - 1]), float(dom.cap[span].min()), ident)
            self._blocks[key] = got
        return got

    def after(self, end: int, j: int) -> tuple[int, int]:
        """Where the next stage starts and its first kind, after a stage of kind ``j``
        that ends at GPU ``end``: a full segment starts the next with every kind."""
        if self.segmented and end < self.h and end == self.seg_end[end - 1]:
            return end, 0
        return end, j

    def skip(self, start: int) -> int | None:
        """Start of the segment after the one holding GPU ``start`` (``None``: none, or a
        real domain): its GPUs from ``start`` on stay unused."""
        if not self.segmented or start >= self.h or self.seg_end[start] >= self.h:
            return None
        return self.seg_end[start]

    def fits(self, extra: tuple[float, ...]) -> bool:
        """Whether a configuration with this extra draw per rack fits the unit's racks."""
        unit = self.unit
        return all(
            fits_mw(idle + x, budget)
            for idle, x, budget in zip(unit.idle_w, extra, unit.budget_mw, strict=True)
        )

    def build(self, kinds: tuple[tuple[int, int], ...]) -> Config | None:
        """The configuration holding these stage kinds (in option order) from GPU 0,
        with the draws :func:`~ntp_opt.planners.exact.configs.domain_configs` computes;
        ``None`` when a kind is unknown here, a block cannot carry it, or it does not fit.

        In a segmented domain (a whole unit) a kind that does not follow the order or
        does not fit in the rest of its segment starts the next segment."""
        stages: list[StageChoice] = []
        extra = np.zeros(self.n_racks)
        start = 0
        last = -1
        for kind in kinds:
            j = self.index.get(kind)
            if j is None:
                return None
            if self.segmented:
                while start < self.h and (j < last or start + kind[0] > self.seg_end[start]):
                    start, last = self.seg_end[start], -1
                if start >= self.h:
                    return None
            elif j < last:
                return None
            placed = self.place(j, start)
            if placed is None:
                return None
            pi, add = placed
            stages.append(StageChoice(kind[0], kind[1], start, pi))
            extra = extra + np.array(add)
            start, last = self.after(start + kind[0], j)
        cfg = Config(tuple(stages), tuple(extra.tolist()))
        return cfg if stages and self.fits(cfg.extra_w) else None

    def enumerate(self, limit: int = MAX_CONFIGS) -> list[Config]:
        """Every non-empty fitting configuration (for tests and tiny domains)."""
        out: list[Config] = []
        self._extend_all(out, limit, 0, 0, [], (0.0,) * self.n_racks)
        return out

    def _extend_all(
        self,
        out: list[Config],
        limit: int,
        start: int,
        j0: int,
        stages: list[StageChoice],
        extra: tuple[float, ...],
    ) -> None:
        """Append to ``out`` every fitting extension of ``stages`` (next stage at GPU
        ``start``, kinds ``>= j0``); :class:`ModelTooLarge` past ``limit``."""
        for j in range(j0, len(self.options)):
            placed = self.place(j, start)
            if placed is None:
                continue
            pi, add = placed
            new_extra = tuple((np.array(extra) + np.array(add)).tolist())
            if not self.fits(new_extra):
                continue
            t, b = self.options[j]
            new_stages = [*stages, StageChoice(t, b, start, pi)]
            out.append(Config(tuple(new_stages), new_extra))
            if len(out) > limit:
                raise ModelTooLarge("too many configurations to enumerate")
            self._extend_all(out, limit, *self.after(start + t, j), new_stages, new_extra)
        nxt = self.skip(start)
        if nxt is not None:  # the rest of this segment unused
            self._extend_all(out, limit, nxt, 0, stages, extra)

    def cost(self, extra: tuple[float, ...], sigma_mw: float, rho_mw: tuple[float, ...]) -> float:
        """Dual cost of a configuration's draw: site and (multi-domain units) racks."""
        c = sigma_mw * ceil_mw(sum(extra)) if sigma_mw > 0 else 0.0
        for r, x in enumerate(extra):
            if rho_mw[r] > 0 and x:
                c += rho_mw[r] * ceil_mw(x)
        return c

    def price(
        self,
        duals: dict[tuple[int, int], float],
        sigma_mw: float,
        rho_mw: tuple[float, ...],
        threshold: float,
        keep: int | None = COLUMNS_PER_ROUND,
        deadline: float | None = None,
        limit: int = MAX_CONFIGS,
    ) -> tuple[float, list[tuple[float, Config]]]:
        """The largest price of any configuration, and the best ones above ``threshold``.

        The price of a configuration is ``sum duals[t, b]`` over its stages minus
        ``sigma_mw`` times its site draw in mW minus ``rho_mw[r]`` times its draw in
        rack ``r`` in mW (both rounded up as in the full model).

        Parameters
        ----------
        duals
            Dual value of each stage kind ``(t, b)`` (0 when absent).
        sigma_mw, rho_mw
            Non-negative prices of a milliwatt at the site and in each rack of the unit.
        threshold
            Configurations priced above it are returned (at most ``keep``, best first).
        keep
            How many to return; ``None``: every configuration priced above
            ``threshold`` (which may be negative).
        deadline
            :func:`time.perf_counter` value; :class:`DeadlineReached` after it.
        limit
            With ``keep=None``: :class:`ModelTooLarge` once more are found.

        Returns
        -------
        (float, list of (float, Config))
            ``max(0, largest price)`` (exact: the empty configuration prices 0),
            and the best configurations priced above ``threshold``.
        """
        lam = [duals.get(kind, 0.0) for kind in self.options]
        search = _PriceSearch(self, lam, sigma_mw, rho_mw, threshold, keep, deadline, limit)
        search.rec(0, 0, 0.0, (0.0,) * self.n_racks, [])
        search.found.sort(key=lambda sc: -sc[0])
        return max(search.best, 0.0), search.found

    def completion(self, lam: list[float], sigma_mw: float) -> list[list[float]]:
        """An optimistic completion: ``fill[i][r]`` is the largest sum over kinds ``>= i``
        on ``r`` GPUs of (dual - sigma * least draw of the kind anywhere in the domain),
        positive terms only.

        The site cost ``sigma * ceil(total mW)`` is at least ``sigma * (mW so far + mW
        of the stages added)``, so this bounds every extension (rack budgets and rack
        prices ignored: they only lower it).
        """
        n = len(self.options)
        h = self.h
        table = self.placements()
        gain = []
        for j in range(n):
            least = math.inf
            for placed in table[j]:
                if placed is not None:
                    least = min(least, sum(placed[1]) * MW)
            gain.append(lam[j] - sigma_mw * least if least < math.inf else 0.0)
        fill = np.zeros((n + 1, h + 1))
        for i in range(n - 1, -1, -1):
            row = fill[i + 1].copy()
            if gain[i] > 0:
                t = self.options[i][0]
                for r in range(t, h + 1):  # unbounded: kind i again on the GPUs left
                    cand = gain[i] + row[r - t]
                    if cand > row[r]:
                        row[r] = cand
            fill[i] = row
        fill_l: list[list[float]] = fill.tolist()
        return fill_l

    def draws(self) -> list[list[float]]:
        """``sum`` of the extra draw per rack of every option at every start (0 where it
        cannot be placed), computed once."""
        if self._draws is None:
            self._draws = [
                [0.0 if placed is None else sum(placed[1]) for placed in row]
                for row in self.placements()
            ]
        return self._draws

    def placements(self) -> list[list[tuple[float, tuple[float, ...]] | None]]:
        """:meth:`place` of every option at every start (computed once)."""
        if self._table is None:
            self._table = [
                [self.place(j, st) for st in range(self.h + 1)] for j in range(len(self.options))
            ]
        return self._table


class _PriceSearch:
    """The depth-first search of :meth:`Pricing.price`, its state explicit.

    ``found`` holds the configurations kept (best first when ``keep`` is set),
    ``best`` the largest price seen. Labels seen per ``(start, first kind)``:
    ``(value, draw)``; a dominated label (no more value, no less draw) cannot
    lead further (pruned only when the maximum is asked for, not a listing).
    """

    def __init__(
        self,
        pricing: Pricing,
        lam: list[float],
        sigma_mw: float,
        rho_mw: tuple[float, ...],
        threshold: float,
        keep: int | None,
        deadline: float | None,
        limit: int,
    ) -> None:
        self.pricing = pricing
        self.lam = lam
        self.sigma_mw = sigma_mw
        self.rho_mw = rho_mw
        self.keep = keep
        self.deadline = deadline
        self.limit = limit
        self.everything = keep is None
        skip = pricing.skip_useless and not self.everything
        self.usable = [j for j in range(len(pricing.options)) if lam[j] > 0 or not skip]
        self.table = pricing.placements()
        self.draws = pricing.draws()
        self.fill = pricing.completion(lam, sigma_mw)
        self.best = 0.0
        self.found: list[tuple[float, Config]] = []
        self.floor_keep = threshold if self.everything else max(threshold, 0.0)
        self.counter = 0
        self.single = pricing.n_racks == 1
        self.idle0 = pricing.unit.idle_w[0] if self.single else 0.0
        self.budget0 = pricing.unit.budget_mw[0] if self.single else 0
        self.seen: dict[tuple[int, int], list[tuple[float, tuple[float, ...]]]] = {}
        self.fronts: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
        self.sig = sigma_mw * MW
        # per GPU position: GPUs left in its segment, and an optimistic value of the
        # segments after it (every kind, each segment on its own)
        h = pricing.h
        self.seg_end = pricing.seg_end
        self.later = [0.0] * (h + 1)
        if pricing.segmented:
            fill0 = self.fill[0]
            for start in range(h - 1, -1, -1):
                end = self.seg_end[start]
                if end < h:
                    self.later[start] = self.later[end] + fill0[self.seg_end[end] - end]

    def bar(self) -> float:
        """The price a configuration must beat to matter: to be listed, to be among the
        best ``keep`` above the threshold, or (else) for the exact maximum."""
        if self.everything:
            return self.floor_keep
        if self.keep and len(self.found) >= self.keep:
            return self.found[-1][0]
        return min(self.best, self.floor_keep)

    def rec(
        self,
        start: int,
        j0: int,
        value: float,
        extra: tuple[float, ...],
        stages: list[StageChoice],
    ) -> None:
        """Extend the configuration ``stages`` (next stage at GPU ``start``, kinds ``>= j0``)."""
        self.counter += 1
        if self.counter % 4096 == 0:
            _check(self.deadline)
        pricing = self.pricing
        if start >= pricing.h:
            return
        options = pricing.options
        table = self.table
        draws = self.draws
        lam = self.lam
        fill = self.fill
        sig = self.sig
        bar = self.bar()
        drawn = sum(extra)  # the same float for every option below
        left = self.seg_end[start] - start
        later = self.later[start]
        base = value + later - sig * drawn
        for j in self.usable[bisect.bisect_left(self.usable, j0) :]:
            if base + fill[j][left] < bar - 1e-9:
                # fill[j][left] bounds every kind >= j here (fill is non-increasing
                # in j and the bar never falls): each would fail the test below
                break
            placed = table[j][start]
            if placed is None:
                continue
            t = options[j][0]
            nv = value + lam[j]
            # the configuration and all its extensions score at most this
            optimistic = nv + fill[j][left - t] + later - sig * (drawn + draws[j][start])
            if optimistic <= bar + 1e-12:
                continue
            pi, add = placed
            new_extra = self.extend(extra, add)
            if new_extra is None:
                continue  # extensions draw more: none fits
            b = options[j][1]
            score = nv - pricing.cost(new_extra, self.sigma_mw, self.rho_mw)
            improved = score > self.best
            if improved:
                self.best = score
            if score > self.floor_keep:  # else offer() keeps nothing
                self.offer(score, stages, StageChoice(t, b, start, pi), new_extra)
                bar = self.bar()
            elif improved:
                bar = self.bar()
            if optimistic <= bar + 1e-12:
                continue
            nxt = pricing.after(start + t, j)
            if not self.everything and self.dominated(nxt, nv, new_extra):
                continue
            self.rec(*nxt, nv, new_extra, [*stages, StageChoice(t, b, start, pi)])
        skip = pricing.skip(start)
        if skip is None:
            return
        # the rest of this segment unused: the next one from its first GPU
        if value + later - sig * drawn <= self.bar() + 1e-12:
            return
        if not self.everything and self.dominated((skip, 0), value, extra):
            return
        self.rec(skip, 0, value, extra, stages)

    def extend(self, extra: tuple[float, ...], add: tuple[float, ...]) -> tuple[float, ...] | None:
        """The draw per rack with ``add`` on top of ``extra``; ``None`` when it does not fit."""
        if self.single:
            x0 = extra[0] + add[0]
            if not fits_mw(self.idle0 + x0, self.budget0):
                return None
            return (x0,)
        new_extra = tuple(x + y for x, y in zip(extra, add, strict=True))
        return new_extra if self.pricing.fits(new_extra) else None

    def offer(
        self,
        score: float,
        stages: list[StageChoice],
        last: StageChoice,
        extra: tuple[float, ...],
    ) -> None:
        """Keep the configuration ``stages + [last]`` if it scores high enough."""
        found = self.found
        if self.everything:
            if score > self.floor_keep:
                found.append((score, Config((*stages, last), extra)))
                if len(found) > self.limit:
                    raise ModelTooLarge(
                        f"more than {self.limit} configurations priced above the threshold"
                    )
            return
        keep = self.keep
        assert keep is not None
        if score > self.floor_keep and (len(found) < keep or score > found[-1][0]):
            found.append((score, Config((*stages, last), extra)))
            found.sort(key=lambda sc: -sc[0])
            del found[keep:]

    def dominated(self, key: tuple[int, int], nv: float, extra: tuple[float, ...]) -> bool:
        """Whether a label seen at ``key`` dominates ``(nv, extra)``; if not, record it."""
        if self.single:
            # Pareto front sorted by draw, values increasing along it
            xs, vs = self.fronts.setdefault(key, ([], []))
            x0 = extra[0]
            i = bisect.bisect_right(xs, x0)
            if i and vs[i - 1] >= nv:
                return True
            k = i
            while k < len(xs) and vs[k] <= nv:
                k += 1
            xs[i:k] = [x0]
            vs[i:k] = [nv]
            return False
        labels = self.seen.setdefault(key, [])
        if any(v >= nv and all(p <= q for p, q in zip(e, extra, strict=True)) for v, e in labels):
            return True
        labels.append((nv, extra))
        return False


@dataclass(frozen=True)
class MasterResult:
    """What :meth:`ColumnGeneration.solve` found at one step time.

    Attributes
    ----------
    capacity
        The integer master over the generated columns, readable by
        :func:`~ntp_opt.planners.exact.capacity.iter_stages`.
    solution
        The backend's answer for it.
    upper
        Proven upper bound on ``C(theta')`` (the Lagrangian bound of the LP, rounded down).
    lp_value
        Value of the last restricted master LP.
    rounds
        Pricing rounds.
    columns
        Configuration columns generated.
    """

    capacity: Capacity
    solution: IntSolution
    upper: int
    lp_value: float
    rounds: int
    columns: int

    @property
    def lower(self) -> int:
        """Value of the integer solution found (0 when none)."""
        return int(self.solution.objective) if self.solution.objective is not None else 0


@dataclass
class _Node:
    """Column generation at one node: its Lagrangian bound and the duals behind it."""

    bound: float
    lp_value: float
    worth: dict[tuple[int, int], float]
    sigma_mw: float
    rhos: list[tuple[float, ...]]
    prices: list[float]
    n_values: dict[tuple[int, int], float]
    used: list[tuple[int, Config]] = field(default_factory=list)

    @property
    def upper(self) -> int:
        """The bound rounded down (``C`` is an integer), with float slack; -1 if none."""
        if self.bound == -math.inf:
            return -1
        return math.floor(self.bound * (1 + 1e-9) + 1e-6)


def column_generation_for(
    prep: Prepared, degrees: tuple[int, ...], theta_max: float
) -> ColumnGeneration | None:
    """A :class:`ColumnGeneration` for these degrees, or ``None`` when it cannot help:
    ``highspy`` is missing, or a domain has more than :data:`MAX_KINDS` stage kinds at
    ``theta_max`` (the largest step time searched, where the most kinds fit).

    Parameters
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.
    degrees
        TP degrees replicas may use.
    theta_max
        The largest step time the search will ask about.

    Returns
    -------
    ColumnGeneration or None
    """
    if not column_generation_available():
        return None
    try:
        for ow in owners(prep, group_units=True):
            stage_options(prep, owner_domain(prep, ow), theta_max, degrees)
    except ModelTooLarge:
        return None
    return ColumnGeneration(prep, degrees)


def column_generation_available() -> bool:
    """Whether the master LP's solver (HiGHS, ``highspy``) can be imported."""
    return get_backend("highs").available()


@dataclass
class ColumnGeneration:
    """``C(theta')`` by column generation for one set of degrees, across step times.

    Patterns (the stage kinds of a configuration) that were used at one step
    time seed the master at the next.

    Parameters
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.
    degrees
        TP degrees replicas may use.
    """

    prep: Prepared
    degrees: tuple[int, ...]
    pool: dict[int, dict[tuple[tuple[int, int], ...], None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.owners = owners(self.prep, group_units=True)

    # -- the master LP ---------------------------------------------------------

    def solve(
        self,
        theta: float,
        backend: str = "cpsat",
        *,
        deadline: float | None = None,
        threads: int = 1,
        seed: int = 0,
        cancel: threading.Event | None = None,
        target: int | None = None,
        bound: Callable[[], int] | None = None,
    ) -> MasterResult:
        """Bounds on ``C(theta')``: the LP bound and an integer solution over the columns.

        Parameters
        ----------
        theta
            Step time before the resharding factor.
        backend
            Backend of the integer master (:data:`~ntp_opt.planners.exact.backends.BACKENDS`).
        deadline
            :func:`time.perf_counter` value: :class:`DeadlineReached` once it passes
            during column generation; the integer master gets the time left.
        threads, seed, cancel
            Passed to the backend.
        target
            The caller only asks whether ``C(theta') >= target``: when the LP bound
            is already below it, no integer master is solved (the result has no
            solution, ``lower`` 0 and the LP bound as ``upper``). When the integer
            master and the branching leave ``C`` open with ``lower < target <= upper``,
            a longer branch and bound (:data:`TARGET_NODES` nodes) prunes every node
            bounded below ``target``: ``upper`` drops below ``target`` when it closes.
        bound
            Called where the first integer master leaves a gap: an upper bound on
            ``C(theta')`` from elsewhere (the merged program,
            :func:`~ntp_opt.planners.exact.merged.merged_capacity`). Where it meets
            the integer master's value, ``C`` is proven without closing the gap here.

        Returns
        -------
        MasterResult

        Raises
        ------
        ModelTooLarge
            Too many stage kinds at this step time.
        DeadlineReached
            The deadline passed before the integer master.
        BackendUnavailable
            ``highspy`` (or the backend's package) is missing.
        """
        load_backend("highs")  # the master LP's solver, or BackendUnavailable at once
        master = _Master(
            self.prep,
            self.owners,
            self.degrees,
            theta,
            _IntOptions(backend, deadline, threads, seed, cancel),
        )
        if not master.kinds:  # no stage fits anywhere at this step time: C = 0
            empty = CapacityBuilder(self.prep).finish(theta, self.degrees)
            sol = IntSolution("optimal", np.zeros(0, dtype=np.int64), 0, 0.0, False, 0.0)
            return MasterResult(empty, sol, 0, 0.0, 0, 0)
        master.seed(self.pool)
        _check(deadline)
        root = master.generate({})
        lp_value = root.lp_value
        self._remember(root.used)
        if target is not None and root.upper < target:
            empty = CapacityBuilder(self.prep).finish(theta, self.degrees)
            sol = IntSolution("optimal", np.zeros(0, dtype=np.int64), 0, 0.0, False, 0.0)
            return MasterResult(
                empty, sol, max(0, root.upper), lp_value, master.rounds, len(master.columns)
            )
        master.start_integer(root)
        if bound is not None and master.open():
            master.upper = max(master.lower, min(master.upper, bound()))
        master.close_gap(root)
        if target is not None and master.open() and master.lower <= target - 1 < master.upper:
            # the caller only asks whether C reaches `target`: prune the nodes below it
            open_bound = master.branch(root, target - 1, TARGET_NODES)
            master.upper = max(master.lower, min(master.upper, math.floor(open_bound)))
        return MasterResult(
            master.cap, master.sol, int(master.upper), lp_value, master.rounds, len(master.columns)
        )

    def _remember(self, used: list[tuple[int, Config]]) -> None:
        """Keep the patterns of the configurations used at the root for later step times."""
        for oi, cfg in used:
            pool = self.pool.setdefault(oi, {})
            pool[tuple((st.t, st.b) for st in cfg.stages)] = None
            while len(pool) > POOL_SIZE:
                del pool[next(iter(pool))]


@dataclass(frozen=True)
class _IntOptions:
    """How the integer master is solved: backend, deadline and the backend's options."""

    backend: str
    deadline: float | None
    threads: int
    seed: int
    cancel: threading.Event | None


class _Master:
    """Column generation at one step time: the restricted master LP, its columns,
    and the integer master over them.

    Rows of the LP: a convexity row per owner, the racks of multi-domain units, a
    row per stage kind (stages - ``pp n[t, b]`` = 0), ``dp_max``, ``global_batch``,
    the site, and the branching rows ``S[t, beta] = sum of n[t, b] over b >= beta``
    (free at the root). Columns: ``n[t, b]``, one artificial column per kind row
    (stages missing, at a large cost, so that the LP stays feasible when branching
    raises an ``n``), then the configurations.
    """

    def __init__(
        self,
        prep: Prepared,
        owners: list[Owner],
        degrees: tuple[int, ...],
        theta: float,
        opts: _IntOptions,
    ) -> None:
        self.prep = prep
        self.job = prep.instance.job
        self.owners = owners
        self.degrees = degrees
        self.theta = theta
        self.opts = opts
        self.inf = math.inf  # HiGHS reads it as no bound
        # a domain whose GPUs are chosen exactly is priced over its exact listing
        self.pricers: list[Pricing | ListedPricing] = [
            ListedPricing(prep, ow, theta, degrees, opts.deadline)
            if prep.units[ow.units[0]].domains[ow.pos] in prep.choice
            else Pricing(prep, ow, theta, degrees)
            for ow in owners
        ]
        self.kinds = sorted(
            {k for p in self.pricers for k in p.options}, key=lambda k: (-k[0], -k[1])
        )
        self.below: dict[tuple[int, int], list[tuple[int, int]]] = {
            (t, b): [(t2, beta) for t2, beta in self.kinds if t2 == t and beta <= b]
            for t, b in self.kinds
        }
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.conv_row: list[int] = []
        self.rack_row: dict[tuple[int, int], int] = {}
        self.rack_room: dict[tuple[int, int], int] = {}
        self.kind_row: dict[tuple[int, int], int] = {}
        self.agg_row: dict[tuple[int, int], int] = {}
        self.site_room = prep.site_budget_mw - ceil_mw(prep.site_idle_w)
        self._build_rows()
        self.h = self._build_lp()
        self.n_cols_n = 2 * len(self.kinds)  # columns before the configurations
        self.columns: list[tuple[int, Config]] = []  # (owner index, config)
        self.seen: set[tuple[int, tuple[tuple[int, int, int, tuple[int, ...]], ...]]] = set()
        self.rounds = 0
        # the integer master: its program, solution, and the bounds on C
        self.cap: Capacity
        self.sol: IntSolution
        self.lower = 0
        self.upper = 0

    def _row(self, lo: float, hi: float) -> int:
        self.lo.append(lo)
        self.hi.append(hi)
        return len(self.lo) - 1

    def _build_rows(self) -> None:
        """The row bounds: conv per owner, racks of multi units, kinds, dp_max,
        global_batch, site, branching rows."""
        prep, job, inf = self.prep, self.job, self.inf
        for ow in self.owners:
            self.conv_row.append(self._row(-inf, float(ow.size)))
        # racks as rows for the multi-domain units owned domain by domain (whole
        # units fit their racks column by column)
        for u in dict.fromkeys(ow.multi for ow in self.owners if ow.multi is not None):
            unit = prep.units[u]
            for r in range(len(unit.racks)):
                room = unit.budget_mw[r] - ceil_mw(unit.idle_w[r])
                self.rack_room[(u, r)] = room
                self.rack_row[(u, r)] = self._row(-inf, room / MW)
        for k in self.kinds:
            self.kind_row[k] = self._row(0.0, 0.0)
        self.dp_row = self._row(-inf, float(job.replicas_max))
        self.gb_row = self._row(-inf, float(job.global_batch))
        self.site_row = self._row(-inf, self.site_room / MW)
        for k in self.kinds:
            self.agg_row[k] = self._row(-inf, inf)

    def _build_lp(self) -> HighsLP:
        """The LP with the rows, the ``n[t, b]`` and the artificial columns."""
        job, kinds = self.job, self.kinds
        h = HighsLP(self.lo, self.hi, threads=self.opts.threads, seed=self.opts.seed)
        for t, b in kinds:
            below = self.below[(t, b)]
            rows_n = [self.kind_row[(t, b)], self.dp_row, self.gb_row] + [
                self.agg_row[k] for k in below
            ]
            val = np.array([-float(job.pp), 1.0, float(b)] + [1.0] * len(below))
            idx = np.array(rows_n, dtype=np.int32)
            h.add_col(float(b), 0.0, float(job.replicas_max), idx, val)
        big_m = 1000.0 * (1.0 + max((b for _, b in kinds), default=1))
        for k in kinds:
            row = np.array([self.kind_row[k]], dtype=np.int32)
            h.add_col(-big_m, 0.0, self.inf, row, np.ones(1))
        return h

    def add(self, oi: int, cfg: Config) -> bool:
        """Add configuration ``cfg`` of owner ``oi`` as a column (``False``: already there)."""
        key = (oi, tuple((st.t, st.b, st.start, st.pos) for st in cfg.stages))
        if key in self.seen:
            return False
        self.seen.add(key)
        ow = self.owners[oi]
        entries: dict[int, float] = {self.conv_row[oi]: 1.0}
        for st in cfg.stages:
            r = self.kind_row[(st.t, st.b)]
            entries[r] = entries.get(r, 0.0) + 1.0
        site = ceil_mw(sum(cfg.extra_w))
        if site:
            entries[self.site_row] = site / MW
        if ow.multi is not None:
            for r, x in enumerate(cfg.extra_w):
                if x:
                    entries[self.rack_row[(ow.multi, r)]] = ceil_mw(x) / MW
        idx = np.array(list(entries), dtype=np.int32)
        val = np.array(list(entries.values()))
        self.h.add_col(0.0, 0.0, float(ow.size), idx, val)
        self.columns.append((oi, cfg))
        return True

    def seed(self, pool: dict[int, dict[tuple[tuple[int, int], ...], None]]) -> None:
        """Seed columns: patterns from earlier step times, and one kind repeated as often
        as it fits."""
        for oi, pr in enumerate(self.pricers):
            for pattern in list(pool.get(oi, {})):
                cfg = pr.build(pattern)
                if cfg is not None:
                    self.add(oi, cfg)
            for kind in pr.options:
                reps: list[tuple[int, int]] = []
                cfg = None
                while True:
                    nxt = pr.build((*reps, kind))
                    if nxt is None:
                        break
                    reps.append(kind)
                    cfg = nxt
                if cfg is not None:
                    self.add(oi, cfg)

    # -- LP and pricing rounds -----------------------------------------------------

    def generate(self, nb: dict[tuple[int, int], tuple[int, int]]) -> _Node:
        """Column generation with the sums ``S[t, beta]`` kept within ``nb``."""
        h, inf = self.h, self.inf
        for k, r in self.agg_row.items():
            lo_s, hi_s = nb.get(k, (-inf, inf))
            h.set_row_bounds(r, float(lo_s), float(hi_s))
        best: _Node | None = None
        while True:
            self.rounds += 1
            status = h.solve()
            if status == "infeasible" and nb:
                # the branching rows contradict dp_max or global_batch (the
                # artificial columns cover every stage row): no solution here
                return _Node(-math.inf, -math.inf, {}, 0.0, [], [], {})
            if status != "optimal":
                raise RuntimeError(f"column generation: master LP status {status!r}")
            lp_value = h.objective()
            dual = h.row_duals()
            node, added = self._price_round(dual, nb, lp_value)
            if best is None or node.bound < best.bound:
                best = node
            _check(self.opts.deadline)
            if not added or math.floor(lp_value + 1e-6) >= best.upper:
                break
        self._read_solution(best, lp_value)
        return best

    def _price_round(
        self, dual: np.ndarray, nb: dict[tuple[int, int], tuple[int, int]], lp_value: float
    ) -> tuple[_Node, int]:
        """Price every owner at the LP's duals: the round's Lagrangian bound (as a node)
        and how many columns joined."""
        # signs (reduced cost = cost - duals . column): <= rows carry a
        # non-negative dual in a maximisation; a stage of kind k is worth
        # -dual of its row (stages - pp n = 0)
        worth = {k: -float(dual[r]) for k, r in self.kind_row.items()}
        sigma_mw = max(0.0, float(dual[self.site_row])) / MW
        rho_mw = {key: max(0.0, float(dual[r])) / MW for key, r in self.rack_row.items()}
        bound = self._dual_bound(dual, nb, worth, sigma_mw, rho_mw)
        added = 0
        rhos: list[tuple[float, ...]] = []
        prices: list[float] = []
        for oi, (ow, pr) in enumerate(zip(self.owners, self.pricers, strict=True)):
            mu = max(0.0, float(dual[self.conv_row[oi]]))
            rho = (
                tuple(rho_mw[(ow.multi, r)] for r in range(pr.n_racks))
                if ow.multi is not None
                else (0.0,) * pr.n_racks
            )
            price, found = pr.price(
                worth, sigma_mw, rho, mu + PRICE_EPS, deadline=self.opts.deadline
            )
            bound += ow.size * price
            rhos.append(rho)
            prices.append(price)
            for _, cfg in found:
                added += self.add(oi, cfg)
        return _Node(bound, lp_value, worth, sigma_mw, rhos, prices, {}), added

    def _dual_bound(
        self,
        dual: np.ndarray,
        nb: dict[tuple[int, int], tuple[int, int]],
        worth: dict[tuple[int, int], float],
        sigma_mw: float,
        rho_mw: dict[tuple[int, int], float],
    ) -> float:
        """The Lagrangian bound's terms other than the owners' prices."""
        job, inf = self.job, self.inf
        delta = max(0.0, float(dual[self.dp_row]))
        gamma = max(0.0, float(dual[self.gb_row]))
        bound = job.replicas_max * delta + job.global_batch * gamma + self.site_room * sigma_mw
        bound += sum(self.rack_room[key] * v for key, v in rho_mw.items())
        ys: dict[tuple[int, int], float] = {}
        for k, r in self.agg_row.items():
            y = float(dual[r])
            lo_s, hi_s = nb.get(k, (-inf, inf))
            if y > 0 and hi_s < inf:
                bound += hi_s * y
            elif y < 0 and lo_s > -inf:
                bound += lo_s * y
            else:
                y = 0.0
            ys[k] = y
        for k, w in worth.items():
            rc = k[1] - job.pp * w - delta - k[1] * gamma - sum(ys[q] for q in self.below[k])
            bound += job.replicas_max * max(0.0, rc)
        return bound

    def _read_solution(self, node: _Node, lp_value: float) -> None:
        """Store the last LP's value, replica sums and used configurations in ``node``."""
        x = self.h.col_values()
        kinds = self.kinds
        node.lp_value = lp_value
        node.n_values = {
            (t, beta): sum(float(x[i]) for i, (t2, b) in enumerate(kinds) if t2 == t and b >= beta)
            for t, beta in kinds
        }
        node.used = [
            (oi, cfg) for ci, (oi, cfg) in enumerate(self.columns) if x[self.n_cols_n + ci] > 1e-9
        ]

    # -- the integer master ----------------------------------------------------------

    def start_integer(self, root: _Node) -> None:
        """The first integer master: the root's columns and their prefixes."""
        self.add_prefixes(root.used)
        self.cap = self.integer_master()
        self.sol = self.solve_int(self.cap, None)
        self.lower = int(self.sol.objective) if self.sol.objective is not None else 0
        self.upper = max(root.upper, self.lower)  # never below a feasible value

    def open(self) -> bool:
        """Whether the bounds still differ and the integer master was solved to optimality."""
        return self.lower < self.upper and self.sol.status == "optimal"

    def close_gap(self, root: _Node) -> None:
        """Near columns, listing configurations (small gap) and branching, while a gap stays."""
        if self.open():
            # a cheap try first: the best few configurations of every owner at the
            # root's duals (reduced cost near 0) join the integer master
            self.resolve(self._near_columns(root), False)
        if self.open() and root.upper - self.lower <= ENUM_GAP:
            self.close_by_enumeration(root)  # a small gap: usually few configurations to list
        if self.open():
            # Branch on the replica sums (few; the pricing is unchanged): the
            # largest bound over the open nodes bounds C.
            more = len(self.columns)
            open_bound = self.branch(root, self.lower)
            if len(self.columns) > more:
                self.resolve([], False)
            self.upper = max(self.lower, min(self.upper, math.floor(open_bound)))
            if self.open() and root.upper - self.lower > ENUM_GAP:
                self.close_by_enumeration(root)

    def _near_columns(self, root: _Node) -> list[tuple[int, Config]]:
        """The best few configurations of every owner at the root's duals."""
        near: list[tuple[int, Config]] = []
        for oi, pr in enumerate(self.pricers):
            _, found = pr.price(
                root.worth,
                root.sigma_mw,
                root.rhos[oi],
                root.prices[oi] - 1.0,
                keep=NEAR_COLUMNS,
                deadline=self.opts.deadline,
            )
            near.extend((oi, cfg) for _, cfg in found)
        return near

    def resolve(self, extra: list[tuple[int, Config]], proves: bool) -> None:
        """Add columns and solve the integer master again (warm: the old solution)."""
        old = self.cap
        for oi, cfg in extra:
            self.add(oi, cfg)
        self.cap = self.integer_master()
        sol = self.sol
        hint = _map_solution(old, sol.x, self.cap) if sol.x is not None else None
        sol2 = self.solve_int(self.cap, hint)
        if sol2.objective is not None and sol2.objective >= self.lower:  # the hint at least
            self.sol, self.lower = sol2, int(sol2.objective)
            if proves and sol2.status == "optimal":
                self.upper = self.lower
        else:
            self.cap = old  # keep the solution and its program together

    def close_by_enumeration(self, root: _Node) -> None:
        """Every integer solution x has value <= bound + sum rc_c x_c over the
        configurations (rc_c <= 0 at the root's duals), so one worth more than
        `lower` uses only configurations with rc_c > lower - bound: list them all
        (at most ENUM_LIMIT) and solve again; then the optimum is proven."""
        slack = root.bound * (1 + 1e-9) + 1e-6 - (self.lower + 1)
        try:
            extra: list[tuple[int, Config]] = []
            for oi, pr in enumerate(self.pricers):
                _, found = pr.price(
                    root.worth,
                    root.sigma_mw,
                    root.rhos[oi],
                    root.prices[oi] - slack - PRICE_EPS,
                    keep=None,
                    deadline=self.opts.deadline,
                    limit=ENUM_LIMIT - len(extra),
                )
                extra.extend((oi, cfg) for _, cfg in found)
        except ModelTooLarge:
            return  # too many: the gap stays open
        self.resolve(extra, True)

    def add_prefixes(self, used: list[tuple[int, Config]]) -> None:
        """For the integer master: used configurations with their last stages left out
        (stage counts often must drop to a multiple of ``pp``)."""
        for oi, cfg in used:
            for cut in range(1, len(cfg.stages)):
                prefix = self.pricers[oi].build(tuple((st.t, st.b) for st in cfg.stages[:cut]))
                if prefix is not None:
                    self.add(oi, prefix)

    def branch(self, root: _Node, lower: int, max_nodes: int | None = None) -> float:
        """Best-first branch and bound over the replica counts ``n``; returns the
        largest (rounded) bound of a node left open, ``lower`` when none.

        A node bounds ``n`` of some kinds; its column generation gives a Lagrangian
        bound valid for every integer solution in it. Nodes bounded by ``lower`` are
        pruned; a node whose LP has integral ``n`` stays open (its configuration
        counts may still be fractional) and so do the nodes left at ``max_nodes``
        (default :data:`MAX_NODES`).
        """
        if max_nodes is None:
            max_nodes = MAX_NODES
        deadline = self.opts.deadline
        heap: list[tuple[float, int, dict[tuple[int, int], tuple[int, int]], _Node]] = []
        ticks = itertools.count(1)
        _push(heap, next(ticks), {}, root, lower)
        open_bound = float(lower)
        nodes = 0
        while heap:
            neg, _, nb, node = heapq.heappop(heap)
            frac = [
                (abs(v - round(v)), k, v)
                for k, v in node.n_values.items()
                if abs(v - round(v)) > 1e-6
            ]
            if (
                not frac
                or nodes >= max_nodes
                or (deadline is not None and time.perf_counter() >= deadline)
            ):
                open_bound = max(open_bound, float(-neg))  # n integral: left open
                if not frac:
                    self.add_prefixes(node.used)
                    continue
                open_bound = max(open_bound, max(-item[0] for item in heap) if heap else -neg)
                break
            _, k, v = max(frac, key=lambda f: (min(f[0], 1 - f[0]), f[1]))
            lo_n, hi_n = nb.get(k, (0, self.job.replicas_max))
            for child in ((lo_n, math.floor(v)), (math.ceil(v), hi_n)):  # S[t, beta] <= / >=
                if child[0] > child[1]:
                    continue
                nbc = {**nb, k: child}
                nodes += 1
                _push(heap, next(ticks), nbc, self.generate(nbc), lower)
        return open_bound

    def integer_master(self) -> Capacity:
        """The program of :func:`~ntp_opt.planners.exact.capacity.build_capacity` on the columns."""
        prep = self.prep
        out = CapacityBuilder(prep)
        by_owner: dict[int, list[int]] = {}
        rack_terms: dict[tuple[int, int], dict[int, int]] = {}
        for oi, cfg in self.columns:
            ow = self.owners[oi]
            j = out.add_column(ow.units, ow.pos, cfg, ow.size)
            by_owner.setdefault(oi, []).append(j)
            if ow.multi is not None:
                for r, x in enumerate(cfg.extra_w):
                    if x:
                        rack_terms.setdefault((ow.multi, r), {})[j] = ceil_mw(x)
        for oi, vars_here in by_owner.items():
            ow = self.owners[oi]
            out.rows.append(
                Row(tuple(vars_here), (1,) * len(vars_here), None, ow.size, f"owner{oi}")
            )
        for (u, r), terms in rack_terms.items():
            unit = prep.units[u]
            room = unit.budget_mw[r] - ceil_mw(unit.idle_w[r])
            out.rows.append(Row(tuple(terms), tuple(terms.values()), None, room, f"rack{r}@{u}"))
        return out.finish(self.theta, self.degrees)

    def solve_int(self, cap: Capacity, hint: np.ndarray | None) -> IntSolution:
        """The integer master ``cap`` by the backend, with the time left."""
        opts = self.opts
        remaining = None
        if opts.deadline is not None:
            remaining = opts.deadline - time.perf_counter()
            if remaining <= 0.01:
                raise DeadlineReached("time limit reached during column generation")
        if not cap.classes:
            return IntSolution(
                "optimal", np.zeros(cap.program.n_vars, dtype=np.int64), 0, 0.0, False, 0.0
            )
        program = cap.program
        if hint is not None:
            program = IntProgram(
                program.lb, program.ub, program.obj, program.rows, program.names, hint
            )
        return solve_or_highs(
            program, opts.backend, deadline=opts.deadline, threads=opts.threads,
            seed=opts.seed, cancel=opts.cancel, work=MASTER_WORK,
        )  # fmt: skip


def _push(
    heap: list[tuple[float, int, dict[tuple[int, int], tuple[int, int]], _Node]],
    tick: int,
    nb: dict[tuple[int, int], tuple[int, int]],
    node: _Node,
    lower: int,
) -> None:
    """Push ``node`` (bounds ``nb``) unless its bound is no more than ``lower``."""
    if node.upper > lower:
        heapq.heappush(heap, (-node.upper, tick, nb, node))


def _map_solution(old: Capacity, x: np.ndarray, new: Capacity) -> np.ndarray:
    """``x`` (a solution of ``old``) as a solution of ``new``, whose columns extend ``old``'s."""
    y = np.zeros(new.program.n_vars, dtype=np.int64)
    y[: old.n_offset] = x[: old.n_offset]
    where = {key: i for i, key in enumerate(new.classes)}
    for i, key in enumerate(old.classes):
        y[new.n_offset + where[key]] = x[old.n_offset + i]
    return y
