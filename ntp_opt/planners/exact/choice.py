"""Exact GPU choice for domains where "fastest GPUs first" is not optimal.

:func:`~ntp_opt.planners.exact.configs.domain_configs` places a domain's stages
on consecutive blocks of its healthy GPUs in fastest-first order. That is
optimal when the domain's healthy GPUs share one TDP, one rack and board caps
that agree with speeds; otherwise (a domain across two racks as in NVL36x2,
mixed TDPs, caps that disagree with speeds) a slower or cheaper GPU, or
another rack split, can be better.

This module lists the configurations of such a domain exactly. Its healthy
GPUs fall into *groups* of interchangeable GPUs: same rack, TDP, board cap
and speed. Two GPUs of one group are exchanged by an automorphism of
everything the capacity model reads (a stage's slowest speed, its lowest
cap, its TDP per rack), so a stage is described completely by its kind
``(t, b)`` and its *split* ``k``: how many GPUs it takes from each group
(``sum k = t``, ``k[g] <= |group g|``). Its power multiplier follows from the
slowest speed and the lowest cap among the groups it uses
(:func:`~ntp_opt.planners.exact.configs.stage_power`), and its extra draw per
rack is ``sum_(g in rack) k[g] tdp[g] (pi - idle)``.

A configuration is a multiset of stage kinds (listed once each, in the order
of ``domain_configs``: non-increasing speed requirement) with a split per
stage such that the GPUs taken from every group fit in it and every rack of
the unit stays within budget. For each multiset every combination of splits
is searched (vectorised: the *states* after a prefix of the stages are the
distinct pairs (GPUs used per group, extra draw per rack)); a multiset with
no feasible split is dropped with all its extensions (an extension's splits,
restricted to the prefix, would be feasible). What the capacity program sees
of a configuration is its kinds and its draw: the site row only (a domain
alone in its power unit: one configuration per multiset, the feasible split
with the least site draw), or every rack as well (a domain sharing racks:
the splits whose draws per rack are Pareto-minimal). So the listing is exact
for these domains: no plan is lost.

The number of splits grows with the number of groups, and the states with
the number of stages per domain; :func:`choice_groups` takes a domain only
when both stay small (:data:`MAX_SPLITS`, :data:`MAX_STATES`), otherwise it
keeps fastest-first and the result is not claimed optimal.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ntp_opt.model.job import Job
from ntp_opt.rules.power import ceil_mw_array, extra_draw, fits_mw
from ntp_opt.rules.tolerances import BUDGET_SLACK, FLOAT_NOISE

__all__ = [
    "MAX_SPLITS",
    "MAX_STATES",
    "ChoiceDomain",
    "ChoiceTooLarge",
    "Listed",
    "choice_configs",
    "choice_groups",
]

#: Largest number of splits of one stage degree over a domain's groups.
MAX_SPLITS = 2_000
#: Largest number of split states per multiset of stage kinds (estimated: splits^stages).
MAX_STATES = 20_000

#: A listed configuration: its stages ``(t, b, power, GPU positions)`` and extra draw per rack.
Listed = tuple[tuple[tuple[int, int, float, tuple[int, ...]], ...], tuple[float, ...]]


class ChoiceTooLarge(RuntimeError):
    """More configurations or split states than allowed."""


@dataclass(frozen=True)
class ChoiceDomain:
    """A domain's healthy GPUs as groups of interchangeable GPUs.

    Attributes
    ----------
    members
        Per group: positions in the domain's stage order (fastest first).
    speed, tdp, cap
        Per group: speed, TDP (W) and largest power multiplier of its GPUs.
    rack
        Per group: position of its rack in the unit's rack list.
    single
        Whether the domain is alone in its power unit (its racks are not
        rows of the capacity program).
    """

    members: tuple[tuple[int, ...], ...]
    speed: np.ndarray
    tdp: np.ndarray
    cap: np.ndarray
    rack: np.ndarray
    single: bool
    _splits: dict[int, np.ndarray] = field(default_factory=dict, compare=False, repr=False)
    # the last listings (the search asks for the same step time more than once)
    _listed: dict[tuple[object, ...], list[Listed]] = field(
        default_factory=dict, compare=False, repr=False
    )
    #: Listed configurations with the objects ``domain_configs`` built for them.
    built: dict[Listed, object] = field(default_factory=dict, compare=False, repr=False)
    # the last stage's split per pair of split tables (:class:`_Lister`), per unit budget
    _pairs: dict[tuple[object, ...], dict[tuple[object, object], _Pair | None]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def size(self) -> np.ndarray:
        """GPUs per group."""
        return np.array([len(m) for m in self.members], dtype=np.int64)

    def splits(self, t: int) -> np.ndarray:
        """Every split of a degree-``t`` stage: rows ``k`` with ``sum k = t`` and
        ``0 <= k[g] <= |group g|`` (shape ``(n, groups)``; cached)."""
        if t not in self._splits:
            sizes = [len(m) for m in self.members]
            rows = [
                k
                for k in itertools.product(*(range(min(n, t) + 1) for n in sizes[:-1]))
                if 0 <= t - sum(k) <= sizes[-1]
            ]
            arr = np.array([(*k, t - sum(k)) for k in rows], dtype=np.int64).reshape(-1, len(sizes))
            self._splits[t] = arr
        return self._splits[t]


@functools.lru_cache(maxsize=4096)
def _count_splits(sizes: tuple[int, ...], t: int) -> int:
    """Number of ``k`` with ``sum k = t`` and ``0 <= k[g] <= sizes[g]`` (a small DP)."""
    ways = [1] + [0] * t
    for n in sizes:
        new = [0] * (t + 1)
        for total in range(t + 1):
            if ways[total]:
                for k in range(min(n, t - total) + 1):
                    new[total + k] += ways[total]
        ways = new
    return ways[t]


def choice_groups(
    rack_pos: np.ndarray,
    tdp: np.ndarray,
    cap: np.ndarray,
    speed: np.ndarray,
    degrees: tuple[int, ...],
    single: bool,
) -> tuple[ChoiceDomain | None, str]:
    """Group a domain's GPUs for the exact choice, if the listing stays small.

    Parameters
    ----------
    rack_pos, tdp, cap, speed
        Per healthy GPU of the domain, in stage order: its rack's position in
        the unit, TDP, largest power multiplier and speed.
    degrees
        Every TP degree the job allows.
    single
        Whether the domain is alone in its power unit.

    Returns
    -------
    (ChoiceDomain or None, str)
        The groups, or ``None`` and why the domain is left to fastest-first.
    """
    keys: dict[tuple[int, float, float, float], list[int]] = {}
    for p, key in enumerate(
        zip(
            rack_pos.tolist(),
            tdp.tolist(),
            cap.tolist(),
            speed.tolist(),
            strict=True,
        )
    ):
        keys.setdefault(key, []).append(p)
    sizes = [len(v) for v in keys.values()]
    h = sum(sizes)
    usable = [t for t in degrees if t <= h]
    if not usable:
        return None, "no stage fits"
    worst = max(_count_splits(tuple(sorted(sizes)), t) for t in usable)
    stages = h // min(usable)
    if worst > MAX_SPLITS or worst**stages > MAX_STATES:
        return None, (
            f"{len(sizes)} groups of interchangeable GPUs and up to {stages} stages "
            f"({worst} splits per stage)"
        )
    ks = list(keys)
    return (
        ChoiceDomain(
            members=tuple(tuple(keys[k]) for k in ks),
            speed=np.array([k[3] for k in ks]),
            tdp=np.array([k[1] for k in ks]),
            cap=np.array([k[2] for k in ks]),
            rack=np.array([k[0] for k in ks], dtype=np.int64),
            single=single,
        ),
        "",
    )


#: A two-stage configuration of a domain alone in its unit, as its split tables decide
#: it: per stage the power multiplier and GPU positions, then the draw per rack.
_Pair = tuple[float, tuple[int, ...], float, tuple[int, ...], tuple[float, ...]]
#: Largest number of pairs remembered per domain and unit budget.
_MAX_PAIRS = 50_000


@dataclass
class _Table:
    """The feasible splits of every stage kind at one step time.

    Kinds whose splits, powers and draws coincide (same degree, same power
    multiplier on every split: e.g. every level that needs no boost) share
    their rows: kind ``j`` reads rows ``lo[j]:hi[j]``.
    """

    k: np.ndarray  # (rows, groups)
    add: np.ndarray  # (rows, racks): extra draw in W
    power: np.ndarray
    lo: list[int]
    hi: list[int]
    rep: list[int]  # per kind: the kind whose rows it reads
    key: list[tuple[int, bytes]]  # per kind: what decides its rows (degree, multipliers)


def _table(
    job: Job,
    cd: ChoiceDomain,
    options: list[tuple[int, int]],
    n_racks: int,
    theta: float,
    idle_r: np.ndarray,
    budget_r: np.ndarray,
) -> _Table:
    idle = job.idle_power_fraction
    alpha = job.power_exponent
    boost = alpha > 0 and job.max_boost > 0
    onehot = np.zeros((len(cd.members), n_racks))
    onehot[np.arange(len(cd.members)), cd.rack] = 1.0
    ks, adds, pows = [], [], []
    lo: list[int] = []
    hi_: list[int] = []
    rep: list[int] = []
    keys: list[tuple[int, bytes]] = []
    seen: dict[tuple[int, bytes], int] = {}
    rows = 0
    for j, (t, b) in enumerate(options):
        k = cd.splits(t)
        used = k > 0
        slowest = np.where(used, cd.speed[None, :], np.inf).min(axis=1)
        hi = np.where(used, cd.cap[None, :], np.inf).min(axis=1)
        hi = np.minimum(hi, 1.0 + job.max_boost)
        # as stage_power: the speed-up needed, then the multiplier (None: > cap)
        need = b * job.seq_time_s / (theta * job.tp_factor(t) * slowest)
        plain = need <= 1.0 * (1 + FLOAT_NOISE)
        if boost:
            with np.errstate(divide="ignore", invalid="ignore"):
                pi = np.where(plain, 1.0, need ** (1.0 / alpha))
            ok = plain | ((hi > 1.0) & (pi <= hi * (1 + BUDGET_SLACK)))
            pi = np.where(plain, 1.0, np.minimum(pi, hi))
        else:
            ok = plain
            pi = np.ones(len(k))
        pi = np.where(ok, pi, np.nan)
        key = (t, pi.tobytes())
        keys.append(key)
        if key in seen:  # the same rows as an earlier kind
            r = seen[key]
            lo.append(lo[r])
            hi_.append(hi_[r])
            rep.append(r)
            continue
        seen[key] = j
        k, pi = k[ok], pi[ok]
        add = extra_draw((k * cd.tdp[None, :]) @ onehot, pi[:, None], idle)
        # a split whose draw alone breaks a rack never fits (draws only add up)
        alone = np.all(fits_mw(idle_r + add, budget_r), axis=1)
        k, pi, add = k[alone], pi[alone], add[alone]
        ks.append(k)
        adds.append(add)
        pows.append(pi)
        lo.append(rows)
        rows += len(k)
        hi_.append(rows)
        rep.append(j)
    g = len(cd.members)
    return _Table(
        k=np.concatenate(ks) if ks else np.zeros((0, g), dtype=np.int64),
        add=np.concatenate(adds) if adds else np.zeros((0, n_racks)),
        power=np.concatenate(pows) if pows else np.zeros(0),
        lo=lo,
        hi=hi_,
        rep=rep,
        key=keys,
    )


def _pareto(draws: np.ndarray) -> list[int]:
    """Rows of ``draws`` not dominated (componentwise ``<=``, one strictly) by another."""
    keep: list[int] = []
    order = np.lexsort(draws.T[::-1])
    for i in order.tolist():
        if not any(bool(np.all(draws[j] <= draws[i])) for j in keep):
            keep.append(i)
    return keep


def choice_configs(
    job: Job,
    cd: ChoiceDomain,
    unit_idle_w: tuple[float, ...],
    unit_budget_mw: tuple[int, ...],
    theta: float,
    degrees: tuple[int, ...],
    options: list[tuple[int, int]],
    check: Callable[[], None],
    name: str = "",
    limit: int | None = None,
) -> list[Listed]:
    """Every configuration of a grouped domain that the capacity program needs (the empty
    one first).

    Parameters
    ----------
    job
        The job.
    cd
        The domain's groups (:func:`choice_groups`).
    unit_idle_w, unit_budget_mw
        Per rack of the domain's unit: idle draw (W) and budget (mW).
    theta
        Step time before the resharding factor.
    degrees
        TP degrees replicas may use.
    options
        Stage kinds ``(t, b)`` in listing order (as ``domain_configs`` sorts them).
    check
        Called now and then; raises to stop (a deadline).
    name
        The domain's id, for messages.
    limit
        Largest number of configurations (:class:`ChoiceTooLarge` beyond).

    Returns
    -------
    list of Listed
        Each configuration's stages (degree, batch level, power multiplier, GPU
        positions in the domain's stage order) and extra draw per rack.
    """
    key = (theta, degrees, tuple(options), unit_idle_w, unit_budget_mw, limit)
    if key in cd._listed:
        return cd._listed[key]
    lister = _Lister(job, cd, unit_idle_w, unit_budget_mw, theta, degrees, options, check)
    lister.name, lister.limit = name, limit
    g = len(cd.members)
    lister.rec(
        0,
        [],
        np.zeros((1, g), dtype=np.int64),
        np.zeros((1, lister.n_racks)),
        np.zeros((1, 0), dtype=np.int64),
        0,
    )
    configs = lister.configs
    if len(cd._listed) >= 4:
        del cd._listed[next(iter(cd._listed))]
    cd._listed[key] = configs
    return configs


def _best(site: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Per row: the column of least ``site``, ties to the largest ``room``."""
    low = site == site.min(axis=1, keepdims=True)
    pick: np.ndarray = np.where(low, room, -np.inf).argmax(axis=1)
    return pick


#: Per stage kind's rows: the configurations to list (state indices) and the states
#: (GPUs used per group, draw per rack, split rows so far).
_States = tuple[list[int], np.ndarray, np.ndarray, np.ndarray]


class _Lister:
    """The listing of :func:`choice_configs`: a depth-first search over stage kinds
    whose states (splits taken per group, draw per rack) advance in arrays."""

    def __init__(
        self,
        job: Job,
        cd: ChoiceDomain,
        unit_idle_w: tuple[float, ...],
        unit_budget_mw: tuple[int, ...],
        theta: float,
        degrees: tuple[int, ...],
        options: list[tuple[int, int]],
        check: Callable[[], None],
    ) -> None:
        self.cd = cd
        self.options = options
        self.check = check
        self.name = ""
        self.limit: int | None = None
        self.n_racks = len(unit_idle_w)
        self.idle_r = np.array(unit_idle_w)
        self.budget_r = np.array(unit_budget_mw, dtype=float)
        self.table = _table(job, cd, options, self.n_racks, theta, self.idle_r, self.budget_r)
        self.sizes = cd.size
        self.h = int(self.sizes.sum())
        self.min_t = min((t for t in degrees if t <= self.h), default=self.h + 1)
        self.configs: list[Listed] = [((), (0.0,) * self.n_racks)]
        self.k_rows = self.table.k.tolist()
        self.power_rows = self.table.power.tolist()
        self.placed: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]
        self.placed = {}
        self.pairs = cd._pairs.setdefault((unit_idle_w, unit_budget_mw), {})
        if len(self.pairs) > _MAX_PAIRS:
            self.pairs.clear()

    def remember(self, first: tuple[int, bytes], r: int, got: _Pair | None) -> None:
        """The last stage's pick after a first stage (``None``: none fits)."""
        self.pairs[(first, self.table.key[r])] = got

    def place(self, row: int, ptr: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """GPU positions of split ``row`` taken after ``ptr`` GPUs of each group, and the
        new ``ptr``."""
        key = (row, ptr)
        if key not in self.placed:
            pos: list[int] = []
            nxt = list(ptr)
            for g, n in enumerate(self.k_rows[row]):
                if n:
                    pos.extend(self.cd.members[g][ptr[g] : ptr[g] + n])
                    nxt[g] += n
            self.placed[key] = (tuple(sorted(pos)), tuple(nxt))
        return self.placed[key]

    def headroom(self, draw: np.ndarray) -> np.ndarray:
        """The least budget left in any rack (mW), per state (last axis: racks)."""
        used = ceil_mw_array(self.idle_r + draw)
        left: np.ndarray = (self.budget_r - used).min(axis=-1)
        return left

    def make(self, path: list[int], hist: np.ndarray, draw: np.ndarray) -> Listed:
        """The listed configuration of stage kinds ``path`` on split rows ``hist``."""
        ptr = (0,) * len(self.cd.members)
        stages = []
        for j, row in zip(path, hist.tolist(), strict=True):
            pos, ptr = self.place(row, ptr)
            t, b = self.options[j]
            stages.append((t, b, self.power_rows[row], pos))
        return tuple(stages), tuple(draw.tolist())

    def made(self, j1: int, j2: int, got: _Pair) -> Listed:
        """A remembered pair as a listed configuration of stage kinds ``j1``, ``j2``."""
        p1, pos1, p2, pos2, drawn = got
        (t1, b1), (t2, b2) = self.options[j1], self.options[j2]
        return ((t1, b1, p1, pos1), (t2, b2, p2, pos2)), drawn

    def add(self, config: Listed) -> None:
        """List a configuration (:class:`ChoiceTooLarge` past the limit)."""
        self.configs.append(config)
        self.check_limit()

    def check_limit(self) -> None:
        """:class:`ChoiceTooLarge` once more than ``limit`` configurations are listed."""
        if self.limit is not None and len(self.configs) > self.limit:
            raise ChoiceTooLarge(
                f"domain {self.name!r} has more than {self.limit} stage configurations "
                "at this step time"
            )

    def rec(
        self,
        j0: int,
        path: list[int],
        used: np.ndarray,
        draw: np.ndarray,
        hist: np.ndarray,
        total: int,
    ) -> None:
        """List the configurations extending ``path`` (kinds ``>= j0``) on its states."""
        self.check()
        table, options, h, min_t = self.table, self.options, self.h, self.min_t
        if total + min_t > h:
            return
        kinds = [
            j
            for j in range(j0, len(options))
            if table.hi[j] > table.lo[j] and options[j][0] + total <= h
        ]
        if not kinds:
            return
        reps = sorted({table.rep[j] for j in kinds})
        # The last stage of a domain alone in its unit after one stage: the pick depends
        # on the two stages' split tables only, which mostly repeat from one step time
        # to the next (every level that needs no boost shares one): remembered per pair.
        last = (
            self.cd.single
            and len(path) == 1
            and all(total + options[j][0] + min_t > h for j in kinds)
        )
        if not last:
            self.extend(reps, _Step(self, reps, used, draw, hist), total, path, kinds)
            return
        first = table.key[path[0]]
        reps = [r for r in reps if (first, table.key[r]) not in self.pairs]
        if reps:
            self.remember_last(reps, _Step(self, reps, used, draw, hist), first)
        for j in kinds:
            got = self.pairs[(first, table.key[j])]
            if got is not None:
                self.configs.append(self.made(path[0], j, got))
                self.check_limit()

    def remember_last(self, reps: list[int], step: _Step, first: tuple[int, bytes]) -> None:
        """Remember the last stage's pick per pair (``first``: the first stage's table)."""
        if not step.ok.any():
            for r in reps:
                self.remember(first, r, None)
            return
        for r in reps:
            res = step.states(r, False)
            if res is None:
                self.remember(first, r, None)
                continue
            _, _, d2, h2 = res
            row1, row2 = h2[0].tolist()
            pos1, ptr = self.place(row1, (0,) * len(self.cd.members))
            pos2, _ = self.place(row2, ptr)
            power_rows = self.power_rows
            got = (power_rows[row1], pos1, power_rows[row2], pos2, tuple(d2[0].tolist()))
            self.remember(first, r, got)

    def extend(
        self, reps: list[int], step: _Step, total: int, path: list[int], kinds: list[int]
    ) -> None:
        """Extend the states by one stage of every kind in ``kinds`` (reading rows of
        ``reps``): list the configurations and recurse."""
        if not step.ok.any():
            return
        for j in kinds:
            t = self.options[j][0]
            deeper = total + t + self.min_t <= self.h
            res = step.states(self.table.rep[j], deeper or not self.cd.single)
            if res is None:
                continue
            picks, u2, d2, h2 = res
            for p in picks:
                self.configs.append(self.make([*path, j], h2[p], d2[p]))
            self.check_limit()
            if deeper:
                self.rec(j, [*path, j], u2, d2, h2, total + t)


class _Step:
    """One stage more on every state: every candidate split of the kinds ``reps`` on
    every state, which fit, and per kind the states it leads to (computed once)."""

    def __init__(
        self,
        lister: _Lister,
        reps: list[int],
        used: np.ndarray,
        draw: np.ndarray,
        hist: np.ndarray,
    ) -> None:
        table = lister.table
        self.lister = lister
        self.hist = hist
        sizes_r = [table.hi[r] - table.lo[r] for r in reps]
        self.cand = np.concatenate([np.arange(table.lo[r], table.hi[r]) for r in reps])
        self.seg_of = dict(
            zip(reps, np.split(np.arange(len(self.cand)), np.cumsum(sizes_r)[:-1]), strict=True)
        )
        # every candidate split on every state
        self.new_used = table.k[self.cand][:, None, :] + used[None, :, :]
        self.new_draw = table.add[self.cand][:, None, :] + draw[None, :, :]
        ok = np.all(self.new_used <= lister.sizes, axis=2)
        ok &= np.all(fits_mw(lister.idle_r + self.new_draw, lister.budget_r), axis=2)
        self.ok = ok
        self.results: dict[int, _States | None] = {}
        if ok.any() and lister.cd.single:
            # the least site draw; among equal ones the most headroom in the tightest rack
            # (any is exact; this one keeps fitting longest as the step time shrinks)
            site = np.where(ok, ceil_mw_array(self.new_draw.sum(axis=2)), np.inf)
            room = np.where(ok, lister.headroom(self.new_draw), -np.inf)
            self.best_s = _best(site, room)
            self.best_v = site[np.arange(len(self.cand)), self.best_s]
            self.best_room = room[np.arange(len(self.cand)), self.best_s]

    def states(self, r: int, deeper: bool) -> _States | None:
        """For the rows of kind ``r``: the configurations to list (state indices) and,
        when ``deeper``, the distinct states to extend."""
        if r in self.results:
            return self.results[r]
        seg = self.seg_of[r]
        seg_ok = self.ok[seg]
        out: _States | None = None
        if seg_ok.any():
            out = self._states(seg, seg_ok, deeper)
        self.results[r] = out
        return out

    def _states(self, seg: np.ndarray, seg_ok: np.ndarray, deeper: bool) -> _States:
        """:meth:`states` where some split of the kind fits."""
        lister = self.lister
        single = lister.cd.single
        ci, si = np.nonzero(seg_ok)
        ci = seg[ci]
        if single and not deeper:
            c = int(seg[int(_best(self.best_v[seg][None, :], self.best_room[seg][None, :])[0])])
            ci, si = np.array([c]), np.array([int(self.best_s[c])])
        u2 = self.new_used[ci, si]
        d2 = self.new_draw[ci, si]
        h2 = np.concatenate((self.hist[si], self.cand[ci][:, None]), axis=1)
        if deeper:  # distinct states only (same GPUs per group and draws)
            _, first = np.unique(np.concatenate((u2, d2), axis=1), axis=0, return_index=True)
            first = np.sort(first)
            u2, d2, h2 = u2[first], d2[first], h2[first]
            if len(u2) > MAX_STATES:
                raise ChoiceTooLarge(f"domain {lister.name!r}: more than {MAX_STATES} split states")
        if single:
            site_u = ceil_mw_array(d2.sum(axis=1))
            picks = [int(_best(site_u[None, :], lister.headroom(d2)[None, :])[0])]
        else:  # the racks are rows: every Pareto-minimal draw
            picks = _pareto(d2)
        return picks, u2, d2, h2
