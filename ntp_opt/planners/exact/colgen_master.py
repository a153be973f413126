"""The master of the column generation at one step time: LP, columns, integer master.

:class:`Master` holds the restricted master LP (HiGHS, through
:class:`~ntp_opt.planners.exact.backends.highs.HighsLP`) over the configurations
generated so far, prices every owner at its duals
(:mod:`ntp_opt.planners.exact.colgen_pricing`) for the Lagrangian bound and new
columns, solves the integer master over the columns with an exact backend, and
closes the gap between them (near columns, listing, branching over replica
counts). :class:`~ntp_opt.planners.exact.colgen.ColumnGeneration` drives it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ntp_opt.planners.exact.backends import solve_or_highs
from ntp_opt.planners.exact.backends.highs import HighsLP
from ntp_opt.planners.exact.capacity import Capacity, CapacityBuilder
from ntp_opt.planners.exact.choice_pricing import ListedPricing
from ntp_opt.planners.exact.colgen_pricing import (
    PRICE_EPS,
    Owner,
    Pricing,
    check_deadline,
)
from ntp_opt.planners.exact.model import Config, DeadlineReached, ModelTooLarge, Prepared
from ntp_opt.planners.exact.program import IntProgram, IntSolution, Row
from ntp_opt.rules.power import MW, ceil_mw

__all__ = ["IntOptions", "Master", "MasterNode"]

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
#: CP-SAT's deterministic time (about CPU seconds) on one integer master; past it the
#: master goes to HiGHS (always there: it solves the master LP), which solves the
#: masters CP-SAT finds hard (e.g. 211 columns at 131k DGX GPUs: HiGHS 1 s, CP-SAT
#: more than 19 s) in about a second.
MASTER_WORK = 1.0


@dataclass
class MasterNode:
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


@dataclass(frozen=True)
class IntOptions:
    """How the integer master is solved: backend, deadline and the backend's options."""

    backend: str
    deadline: float | None
    threads: int
    seed: int
    cancel: threading.Event | None


class Master:
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
        opts: IntOptions,
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

    def generate(self, nb: dict[tuple[int, int], tuple[int, int]]) -> MasterNode:
        """Column generation with the sums ``S[t, beta]`` kept within ``nb``."""
        h, inf = self.h, self.inf
        for k, r in self.agg_row.items():
            lo_s, hi_s = nb.get(k, (-inf, inf))
            h.set_row_bounds(r, float(lo_s), float(hi_s))
        best: MasterNode | None = None
        while True:
            self.rounds += 1
            status = h.solve()
            if status == "infeasible" and nb:
                # the branching rows contradict dp_max or global_batch (the
                # artificial columns cover every stage row): no solution here
                return MasterNode(-math.inf, -math.inf, {}, 0.0, [], [], {})
            if status != "optimal":
                raise RuntimeError(f"column generation: master LP status {status!r}")
            lp_value = h.objective()
            dual = h.row_duals()
            node, added = self._price_round(dual, nb, lp_value)
            if best is None or node.bound < best.bound:
                best = node
            check_deadline(self.opts.deadline)
            if not added or math.floor(lp_value + 1e-6) >= best.upper:
                break
        self._read_solution(best, lp_value)
        return best

    def _price_round(
        self, dual: np.ndarray, nb: dict[tuple[int, int], tuple[int, int]], lp_value: float
    ) -> tuple[MasterNode, int]:
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
        return MasterNode(bound, lp_value, worth, sigma_mw, rhos, prices, {}), added

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

    def _read_solution(self, node: MasterNode, lp_value: float) -> None:
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

    def start_integer(self, root: MasterNode) -> None:
        """The first integer master: the root's columns and their prefixes."""
        self.add_prefixes(root.used)
        self.cap = self.integer_master()
        self.sol = self.solve_int(self.cap, None)
        self.lower = int(self.sol.objective) if self.sol.objective is not None else 0
        self.upper = max(root.upper, self.lower)  # never below a feasible value

    def open(self) -> bool:
        """Whether the bounds still differ and the integer master was solved to optimality."""
        return self.lower < self.upper and self.sol.status == "optimal"

    def close_gap(self, root: MasterNode) -> None:
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

    def _near_columns(self, root: MasterNode) -> list[tuple[int, Config]]:
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

    def close_by_enumeration(self, root: MasterNode) -> None:
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

    def branch(self, root: MasterNode, lower: int, max_nodes: int | None = None) -> float:
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
        heap: list[tuple[float, int, dict[tuple[int, int], tuple[int, int]], MasterNode]] = []
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
        """The program of :func:`~ntp_opt.planners.exact.capacity.build_capacity`, over the
        columns."""
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
    heap: list[tuple[float, int, dict[tuple[int, int], tuple[int, int]], MasterNode]],
    tick: int,
    nb: dict[tuple[int, int], tuple[int, int]],
    node: MasterNode,
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
