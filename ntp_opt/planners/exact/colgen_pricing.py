"""Pricing of the column generation: the configurations of one owner at one step time.

:mod:`ntp_opt.planners.exact.colgen` solves the capacity program with
configurations generated on demand. An *owner* (:class:`Owner`) is a domain
class, or a domain of a multi-domain unit (or a whole such unit); its
configurations (:class:`Pricing`) are the ones
:func:`~ntp_opt.planners.exact.configs.domain_configs` would list: stages on
consecutive blocks of the domain's GPUs in stage order, kinds in non-increasing
speed requirement, fitting the unit's rack budgets. :meth:`Pricing.price` finds
the configuration of the largest price ``sum dual(t, b) - dual_site * site_mW -
sum dual_rack * rack_mW`` exactly, by a depth-first search bounded by an unbounded
knapsack over the positive duals.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass

import numpy as np

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
    unit_fits,
    unit_key,
)
from ntp_opt.rules.power import MW, ceil_mw, extra_draw, fits_mw

__all__ = [
    "Owner",
    "Pricing",
    "check_deadline",
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


def check_deadline(deadline: float | None) -> None:
    """Stop once the deadline passed.

    Parameters
    ----------
    deadline
        A :func:`time.perf_counter` value, or ``None``.

    Raises
    ------
    DeadlineReached
        ``deadline`` has passed.
    """
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
        return unit_fits(self.unit, extra)

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
            check_deadline(self.deadline)
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
