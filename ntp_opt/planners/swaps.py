"""Local search by stage swaps: improve a plan while moving few GPUs.

Used by :func:`ntp_opt.workflows.replan.replan` after an event. A *slot* is one stage's
share of its domain: the stage's GPUs, plus the domain's unused healthy GPUs
when the stage is the only one in its domain. A replica of slots runs at the
allowed degree ``t`` maximising ``f(t) * min_k s_k(t)``, where ``s_k(t)`` is
the ``t``-th fastest speed of slot ``k`` (its stages then use their ``t``
fastest GPUs). Moves, each scored first by the change in the two replicas'
speeds at power 1 and then, for the most promising few, by the exact batch
split:

* **re-degree** a replica (after a repair its slots may run a higher degree);
* **swap** a slot of a focus replica with a slot of another replica (packs a
  damaged domain into an already reduced replica, as the paper's "pack failed
  domains together", one pair at a time);
* **swap in** a spare domain for a slot of a focus replica.

Each accepted move migrates about two stages' GPUs. Power multipliers are set
to 1 by the search; the caller re-applies boosts
(:func:`ntp_opt.workflows.replan.reboost`). Deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, repeat
from operator import itemgetter
from typing import Any

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.rules.goodput import BatchSplit, split_batch
from ntp_opt.rules.tolerances import ABS_NOISE, IMPROVE_TOL


@dataclass(frozen=True)
class _Slots:
    """Every slot as arrays, slot ``k`` by its index: its GPUs
    ``gpus[bounds[k]:bounds[k + 1]]`` (fastest first) and their speeds, its
    row ``tables[k]`` of ``s(t)`` per allowed degree (-inf where the slot is
    too small), its domain, the layout stage it was read from (``origin``,
    -1: a spare domain, or unknown) and whether its first GPUs are that
    stage's, in the plan's order (``same``). The search moves slot indices."""

    gpus: np.ndarray
    speeds: np.ndarray
    tables: np.ndarray
    bounds: np.ndarray
    domain: np.ndarray
    origin: np.ndarray
    same: np.ndarray


def _slots(
    instance: Instance, plan: Plan, layout: Layout | None = None
) -> tuple[_Slots, list[list[int]], list[int]]:
    """Slots of every replica's stages, and one slot per unused domain: the
    slots, and per replica and for the spare domains the slots' indices.

    ``layout``: the plan's :class:`~ntp_opt.model.layout.Layout`, when known:
    the same slots, read from its arrays with every slot's GPUs sorted at
    once (by slot, speed descending, then their order: the stage's own GPUs
    in plan order, then the domain's unused ones). Without it, the plan's
    node ids are read and each slot is sorted on its own
    (:func:`_slots_of_plan`, the reference the tests compare with).
    """
    if layout is None:
        return _slots_of_plan(instance, plan)
    a = instance.arrays
    used = np.zeros(a.n_gpus, dtype=bool)
    used[layout.gpus] = True
    free = a.healthy & ~used
    n_stages = layout.n_stages
    stages_in = np.bincount(layout.domain, minlength=a.n_domains)
    has_free = np.bincount(a.gpu_domain[free], minlength=a.n_domains) > 0
    spare_d = np.flatnonzero((stages_in == 0) & has_free).tolist()
    # slots: the stages (layout order), then the spare domains
    doms = np.concatenate((layout.domain, np.array(spare_d, dtype=np.int64)))
    parts = [layout.gpus]
    owners = [np.repeat(np.arange(n_stages, dtype=np.int64), np.diff(layout.offsets))]
    single = np.flatnonzero((stages_in[layout.domain] == 1) & has_free[layout.domain]).tolist()
    # the unused GPUs of those domains at once, each domain's in its own order
    # (``domain_gpus`` lists a domain's GPUs by index): one slot per domain
    slot_of = np.full(a.n_domains, -1, dtype=np.int64)
    slot_of[layout.domain[single]] = single
    slot_of[spare_d] = np.arange(n_stages, n_stages + len(spare_d))
    loose = np.flatnonzero(free)
    extra = loose[slot_of[a.gpu_domain[loose]] >= 0]
    extra_owner = slot_of[a.gpu_domain[extra]]
    parts.append(extra)
    owners.append(extra_owner)
    flat = np.concatenate(parts)
    owner = np.concatenate(owners)
    speed = a.speed[flat]
    own_speed = speed[: len(layout.gpus)]
    order = np.lexsort((-speed, owner))  # stable: ties keep their order
    flat, speed = flat[order], speed[order]
    stage_sizes = np.diff(layout.offsets)
    sizes = np.bincount(extra_owner, minlength=len(doms))
    sizes[:n_stages] += stage_sizes
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    degrees = np.array(instance.job.allowed, dtype=np.int64)
    fits = degrees[None, :] <= sizes[:, None]
    at = np.where(fits, starts[:, None] + degrees[None, :] - 1, 0)
    tables = np.where(fits, speed[at] if len(speed) else 0.0, -np.inf)
    bounds = np.concatenate((starts, [len(flat)]))
    same = _sorted_stages(layout, own_speed, extra_owner, a.speed[extra])
    origin = np.concatenate((np.arange(n_stages, dtype=np.int64), np.full(len(spare_d), -1)))
    slots = _Slots(flat, speed, tables, bounds, doms, origin, same)
    # a layout lists each replica's stages together, in order
    cut = np.searchsorted(layout.replica, np.arange(len(plan.replicas) + 1)).tolist()
    reps = [list(range(cut[r], cut[r + 1])) for r in range(len(plan.replicas))]
    return slots, reps, list(range(n_stages, len(doms)))


def _sorted_stages(
    layout: Layout, own_speed: np.ndarray, extra_owner: np.ndarray, extra_speed: np.ndarray
) -> np.ndarray:
    """Per stage: are its slot's first GPUs the stage's own, in the plan's order?

    The slots are sorted stably by speed, descending, the stage's GPUs (speeds
    ``own_speed``, layout order) before its domain's unused ones (owners
    ``extra_owner``, speeds ``extra_speed``): a stage keeps its GPUs first and
    in order unless a GPU of it is faster than the one before it, or an unused
    GPU of its slot is faster than its slowest.
    """
    n_stages = layout.n_stages
    same = np.ones(n_stages, dtype=bool)
    rises = np.flatnonzero(own_speed[1:] > own_speed[:-1])
    if len(rises):
        stage_of = np.searchsorted(layout.offsets, rises, side="right") - 1
        inside = rises + 1 < layout.offsets[stage_of + 1]
        same[stage_of[inside]] = False
    mine = extra_owner < n_stages
    if mine.any():  # an unused GPU faster than its stage's slowest (stages with a GPU)
        sizes = np.diff(layout.offsets)
        full = np.flatnonzero(sizes > 0)
        slowest = np.full(n_stages, np.inf)
        slowest[full] = np.minimum.reduceat(own_speed, layout.offsets[full])
        k = extra_owner[mine]
        same[k[extra_speed[mine] > slowest[k]]] = False
    return same


def _table(degrees: np.ndarray, speeds: np.ndarray) -> np.ndarray:
    """``s(t)`` per allowed degree from a slot's speeds (descending), -inf where too small."""
    out = np.full(len(degrees), -np.inf)
    ok = degrees <= len(speeds)
    out[ok] = speeds[degrees[ok] - 1]
    return out


def _slots_of_plan(instance: Instance, plan: Plan) -> tuple[_Slots, list[list[int]], list[int]]:
    """:func:`_slots` from the plan's node ids, one slot at a time."""
    a = instance.arrays
    index = a.gpu_index
    degrees = np.array(instance.job.allowed, dtype=np.int64)
    used = np.zeros(a.n_gpus, dtype=bool)
    stages_in: dict[int, int] = {}
    for rep in plan.replicas:
        for st in rep.stages:
            d = a.domain_index[st.domain]
            stages_in[d] = stages_in.get(d, 0) + 1
            used[[index[g] for g in st.gpus]] = True
    free = a.healthy & ~used
    parts: list[np.ndarray] = []
    doms: list[int] = []
    reps = [
        [
            _add_slot(
                instance,
                stages_in,
                free,
                parts,
                doms,
                a.domain_index[st.domain],
                np.array([index[x] for x in st.gpus], dtype=np.int64),
            )
            for st in rep.stages
        ]
        for rep in plan.replicas
    ]
    spare = [
        _add_slot(instance, stages_in, free, parts, doms, d, np.empty(0, dtype=np.int64))
        for d in range(a.n_domains)
        if d not in stages_in and free[a.domain_gpus[d]].any()
    ]
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    bounds = np.concatenate(([0], np.cumsum([len(g) for g in parts], dtype=np.int64)))
    tables = np.array([_table(degrees, a.speed[g]) for g in parts]).reshape(
        len(parts), len(degrees)
    )
    n = len(parts)
    slots = _Slots(
        flat,
        a.speed[flat],
        tables,
        bounds.astype(np.int64),
        np.array(doms, dtype=np.int64),
        np.full(n, -1, dtype=np.int64),
        np.zeros(n, dtype=bool),
    )
    return slots, reps, spare


def _add_slot(
    instance: Instance,
    stages_in: dict[int, int],
    free: np.ndarray,
    parts: list[np.ndarray],
    doms: list[int],
    d: int,
    own: np.ndarray,
) -> int:
    """Append the slot of GPUs ``own`` in domain ``d`` (with the domain's ``free``
    GPUs when it holds at most one stage), fastest first, to ``parts`` and ``doms``;
    its index."""
    a = instance.arrays
    g = own
    if stages_in.get(d, 0) <= 1:
        members = a.domain_gpus[d]
        g = np.concatenate([own, members[free[members]]])
    parts.append(g[np.argsort(-a.speed[g], kind="stable")])
    doms.append(d)
    return len(parts) - 1


def _exclusive_min(t: np.ndarray) -> np.ndarray:
    """``out[r, k] = min over stages j != k of t[r, j]`` (+inf for one stage)."""
    n = t.shape[1]
    inf = np.full_like(t[:, :1], np.inf)
    pre = np.concatenate([inf, np.minimum.accumulate(t, axis=1)[:, : n - 1]], axis=1)
    suf = np.concatenate([np.minimum.accumulate(t[:, ::-1], axis=1)[:, ::-1][:, 1:], inf], axis=1)
    return np.minimum(pre, suf)


def _max_last(x: np.ndarray) -> np.ndarray:
    """``x.max(axis=-1)`` for a short last axis (the allowed degrees), one
    element-wise maximum per column: the same numbers, without numpy's slow
    reduction over a short inner axis."""
    out = x[..., 0].copy()
    for i in range(1, x.shape[-1]):
        np.maximum(out, x[..., i], out=out)
    return out


def _distinct(x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The distinct rows of a small 2-D array (first seen first) and each row's
    index among them (``rows[back]`` is ``x``); ``None`` when every row differs."""
    seen: dict[tuple[float, ...], int] = {}
    firsts: list[int] = []
    back: list[int] = []
    for i, row in enumerate(x.tolist()):
        j = seen.setdefault(tuple(row), len(firsts))
        if j == len(firsts):
            firsts.append(i)
        back.append(j)
    if len(firsts) == len(back):
        return x, None
    return x[firsts], np.array(back, dtype=np.int64)


def _expand(v: np.ndarray, back: np.ndarray | None) -> np.ndarray:
    """``v[back]``, or ``v`` itself when ``back`` is ``None`` (see :func:`_distinct`)."""
    return v if back is None else v[back]


def _leading(gain: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """``np.nonzero(gain > ABS_NOISE)`` less the moves that cannot be among the
    ``top`` best: those whose gain is below the ``top``-th largest of them (ties
    kept, so the best ``top`` moves in the search's order are all there)."""
    ok = gain > ABS_NOISE
    n = int(np.count_nonzero(ok))
    if n > top:
        vals = gain[ok]
        ok &= gain >= np.partition(vals, n - top)[n - top]
    return np.nonzero(ok)


Splitter = Callable[[Job, list[float], list[int]], BatchSplit | None]
"""What the swap search calls for an exact split: :func:`~ntp_opt.rules.goodput.split_batch`,
or a function giving its result for the same arguments (a re-planning chain's kept splits)."""


class _Search:
    def __init__(
        self,
        instance: Instance,
        slots: _Slots,
        reps: list[list[int]],
        spare: list[int],
        splitter: Splitter = split_batch,
    ):
        job = instance.job
        self.job = job
        self.splitter = splitter
        self.degrees = np.array(job.allowed, dtype=np.int64)
        self.factor = np.array([job.tp_factor(int(t)) for t in self.degrees])
        self.slots = slots
        self.reps = reps
        self.spare = spare
        self.whole: np.ndarray | None = None  # the tables of :meth:`tables` as one array
        self.splits: dict[tuple[tuple[int, ...], tuple[float, ...]], BatchSplit | None] = {}
        self.bests: dict[tuple[tuple[int, ...], bytes], tuple[int, float]] = {}

    def best(self, tables: np.ndarray) -> tuple[int, float]:
        """Degree and power-1 speed (``f(t) * min s``) of a replica from its slot tables
        (kept under the tables' shape and bytes: equal moves share it)."""
        key = (tables.shape, tables.tobytes())
        got = self.bests.get(key)
        if got is None:
            got = self.bests[key] = self._best(tables)
        return got

    def _best(self, tables: np.ndarray) -> tuple[int, float]:
        """:meth:`best`, computed."""
        worst = tables.min(axis=0) * self.factor
        worst = np.where(np.isfinite(worst), worst, -np.inf)
        k = len(worst) - 1 - int(np.argmax(worst[::-1]))  # larger degree on ties
        if not np.isfinite(worst[k]):
            return 0, 0.0
        return int(self.degrees[k]), float(worst[k])

    def tables(self) -> tuple[list[np.ndarray], list[int], list[float]]:
        """Every replica's slot tables, and its :meth:`best` degree and speed.

        Replicas of equally many stages are read as one array (each table a
        view of it, kept as :attr:`whole`) and their degrees found at once:
        the same numbers as :meth:`best` one replica at a time.
        """
        reps = self.reps
        n_st = {len(r) for r in reps}
        self.whole = None
        if len(n_st) != 1 or 0 in n_st:
            tables = [self.slots.tables[r] for r in reps]
            cur = [self.best(t) for t in tables]
            return tables, [t for t, _ in cur], [v for _, v in cur]
        rows = np.fromiter(chain.from_iterable(reps), dtype=np.int64)
        big = self.slots.tables[rows].reshape(len(reps), n_st.pop(), -1)
        worst = big.min(axis=1) * self.factor
        worst = np.where(np.isfinite(worst), worst, -np.inf)
        n_deg = worst.shape[1]
        k = n_deg - 1 - np.argmax(worst[:, ::-1], axis=1)  # larger degree on ties
        value = worst[np.arange(len(reps)), k]
        ok = np.isfinite(value)
        tps: list[int] = np.where(ok, self.degrees[k], 0).tolist()
        speeds: list[float] = np.where(ok, value, 0.0).tolist()
        self.whole = big
        return list(big), tps, speeds

    def split(self, tps: list[int], speeds: list[float]) -> BatchSplit | None:
        """The exact split of the replicas of degree ``tps[r] > 0`` at ``speeds``.

        Kept for the search's call under ``(tps, speeds)``: moves that give
        the same degrees and speeds (a slot swapped with any of a replica's
        equal slots) share one split.
        """
        key = (tuple(tps), tuple(speeds))
        if key in self.splits:
            return self.splits[key]
        keep = [i for i, t in enumerate(tps) if t > 0]
        c = self.job.seq_time_s
        got = self.splitter(self.job, [speeds[i] / c for i in keep], [tps[i] for i in keep])
        self.splits[key] = got
        return got

    def goodput(self, tps: list[int], speeds: list[float]) -> float:
        split = self.split(tps, speeds)
        return 0.0 if split is None else split.goodput


def improve(
    instance: Instance,
    plan: Plan,
    focus: set[int],
    *,
    rounds: int = 3,
    top: int = 6,
    layout: Layout | None = None,
) -> Plan | None:
    """Improve ``plan`` by re-degree and swap moves around the ``focus`` replicas.

    The plan of :func:`improve_layout` (see there).
    """
    got = improve_layout(instance, plan, focus, rounds=rounds, top=top, layout=layout)
    return None if got is None else got[0]


def improve_layout(
    instance: Instance,
    plan: Plan,
    focus: set[int],
    *,
    rounds: int = 3,
    top: int = 6,
    layout: Layout | None = None,
    splitter: Splitter = split_batch,
) -> tuple[Plan, Layout] | None:
    """Improve ``plan`` by re-degree and swap moves around the ``focus`` replicas.

    Parameters
    ----------
    instance
        The instance (the plan is feasible for it).
    plan
        The plan to improve.
    focus
        Indices of replicas the moves start from (e.g. those an event hit).
    rounds
        Most moves accepted.
    top
        Candidates per round scored with the exact batch split.
    layout
        The plan's :class:`~ntp_opt.model.layout.Layout`, when the caller has
        it (re-planning does): the slots are read from its arrays, not from
        the plan's node ids. The result is the same.
    splitter
        The exact split (:data:`Splitter`): re-planning passes one that
        shares the splits its re-boosts compute. The result is the same.

    Returns
    -------
    (Plan, Layout) or None
        The improved plan at power 1 (not yet validated; local batches from
        the exact split) and its layout (made from the slots, equal to
        :meth:`~ntp_opt.model.layout.Layout.from_plan` of it), or ``None``
        when no move improves goodput at power 1.
    """
    if not plan.replicas or not focus:
        return None
    slots, reps, spare = _slots(instance, plan, layout)
    s = _Search(instance, slots, reps, spare, splitter)
    tables, tps, speeds = s.tables()
    whole = s.whole  # every table as one array (views of it), when the replicas allow
    spare_tab = [slots.tables[k].copy() for k in spare]
    value = s.goodput(tps, speeds)
    start_value = value
    focus = {f for f in focus if 0 <= f < len(reps)}
    changed = False
    last: BatchSplit | None = None  # the split of the last move taken (at ``tps``, ``speeds``)
    kept: dict[int | str, np.ndarray] = {}  # what the last round computed (_candidates)
    moved: set[int] | None = None  # the replicas the last move changed
    for _ in range(rounds):
        big = np.stack(tables) if whole is None else whole  # (replicas, pp, degrees)
        cands = _candidates(s, big, speeds, spare_tab, focus, top, kept, moved)
        best_move = _best_move(s, cands, tables, spare_tab, tps, speeds, value, top)
        if best_move is None:
            break
        value, kind, a_i, i, b_i, j, tps, speeds, last = best_move
        if kind == "swap":
            reps[a_i][i], reps[b_i][j] = reps[b_i][j], reps[a_i][i]
            tables[a_i][i], tables[b_i][j] = tables[b_i][j].copy(), tables[a_i][i].copy()
            focus.add(b_i)
        else:
            reps[a_i][i], spare[j] = spare[j], reps[a_i][i]
            tables[a_i][i], spare_tab[j] = spare_tab[j].copy(), tables[a_i][i].copy()
        moved = {a_i, b_i} if kind == "swap" else {a_i}
        changed = True
    # re-degree alone (e.g. after a repair) is covered by recomputing every
    # replica's best degree from its slots above
    if not changed and value <= start_value * (1 + IMPROVE_TOL):
        # the slots' best degrees may still differ from the plan's (repairs)
        if all(t == rep.tp for t, rep in zip(tps, plan.replicas, strict=True)):
            return None
    return _plan(instance, plan, slots, reps, tps, speeds, layout, last if changed else None)


_Candidate = tuple[float, str, int, int, int, int]
"""A move scored at power 1: ``(-gain, kind, A, i, B, j)`` (kind ``"swap"``: slot
``i`` of replica ``A`` with slot ``j`` of replica ``B``; ``"spare"``: with spare
slot ``j``, ``B`` -1)."""

_Move = tuple[float, str, int, int, int, int, list[int], list[float], BatchSplit | None]
"""A move with its exact split: ``(goodput, kind, A, i, B, j, degrees, speeds, split)``."""


def _candidates(
    s: _Search,
    big: np.ndarray,
    speeds: list[float],
    spare_tab: list[np.ndarray],
    focus: set[int],
    top: int,
    kept: dict[int | str, np.ndarray] | None = None,
    moved: set[int] | None = None,
) -> list[_Candidate]:
    """The moves from the ``focus`` replicas that can be among the ``top`` best by
    their gain in the two replicas' speeds (``big``: every replica's slot tables).

    ``kept``: what the last call computed, updated here (each focus
    replica's swap gains, and under ``"fbig"`` / ``"fex"`` every replica's
    tables and minima over its other stages, times f(t)); ``moved``: the
    replicas whose tables or speed changed since (``None``: unknown). Only
    the moved replicas' rows are computed again (:func:`_times_f`), and a
    kept replica that did not move has only the columns of the moved ones
    recomputed (:func:`_swap_gain`): every number is computed per replica
    and element-wise, so the same numbers as computing them all.
    """
    cands: list[_Candidate] = []
    cur_v = np.array(speeds)
    f = s.factor
    sp_tab = np.array(spare_tab) if spare_tab else np.zeros((0, len(f)))
    fbig, fex = _times_f(big, f, kept, moved)
    fsp = sp_tab * f
    for a_i in sorted(focus):
        # every slot i of A against every slot (b, j) at once: A gets (b, j)
        # and b gets A's slot i (element for element the same numbers as
        # one slot at a time)
        rest = fex[a_i]  # (pp, degrees): min over A's other stages, times f(t)
        last = None if kept is None or moved is None or a_i in moved else kept.get(a_i)
        if last is None:
            gain = _swap_gain(a_i, fbig, fex, cur_v, None)
            gain[:, a_i, :] = -np.inf
        else:
            gain = last.copy()
            cols = np.array(sorted(moved or ()), dtype=np.int64)
            gain[:, cols, :] = _swap_gain(a_i, fbig, fex, cur_v, cols)
        if kept is not None:
            kept[a_i] = gain
        ii, bb, jj = _leading(gain, top)
        cands.extend(
            zip(
                (-gain[ii, bb, jj]).tolist(),
                repeat("swap"),
                repeat(a_i),
                ii.tolist(),
                bb.tolist(),
                jj.tolist(),
                strict=False,
            )
        )
        if len(sp_tab):
            vs = _max_last(np.minimum(rest[:, None, :], fsp[None])) - cur_v[a_i]
            ii, jj = _leading(vs, top)
            cands.extend(
                zip(
                    (-vs[ii, jj]).tolist(),
                    repeat("spare"),
                    repeat(a_i),
                    ii.tolist(),
                    repeat(-1),
                    jj.tolist(),
                    strict=False,
                )
            )
    return cands


def _times_f(
    big: np.ndarray,
    f: np.ndarray,
    kept: dict[int | str, np.ndarray] | None,
    moved: set[int] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Every replica's slot tables and minima over its other stages
    (:func:`_exclusive_min`), times f(t): f(t) * min(x, y) is min(f(t) x, f(t)
    y), rounding included (f(t) > 0), so the products are taken once a round.
    With ``kept`` (:func:`_candidates`), only the ``moved`` replicas' rows."""
    if kept is None or moved is None or "fbig" not in kept:
        fbig, fex = big * f, _exclusive_min(big) * f
    else:
        rows = np.array(sorted(moved), dtype=np.int64)
        fbig, fex = kept["fbig"].copy(), kept["fex"].copy()
        fbig[rows] = big[rows] * f
        fex[rows] = _exclusive_min(big[rows]) * f
    if kept is not None:
        kept["fbig"], kept["fex"] = fbig, fex
    return fbig, fex


def _swap_gain(
    a_i: int, fbig: np.ndarray, fex: np.ndarray, cur_v: np.ndarray, cols: np.ndarray | None
) -> np.ndarray:
    """The gain in the two replicas' speeds of every swap of a slot ``i`` of
    replica ``a_i`` with a slot ``(b, j)``, ``(pp, replicas, pp)``, for the
    replicas ``cols`` only (``None``: all): ``a_i`` gets ``(b, j)`` and ``b``
    gets slot ``i`` (``fbig``, ``fex``: the tables and the minima over the
    other stages, times f(t); element for element the same numbers as one
    slot at a time)."""
    big_b = fbig if cols is None else fbig[cols]
    ex_b = fex if cols is None else fex[cols]
    v_b = cur_v if cols is None else cur_v[cols]
    # each distinct row once (A's slots mostly share their tables)
    rows, back = _distinct(fex[a_i])  # min over A's other stages
    va = _expand(_max_last(np.minimum(rows[:, None, None, :], big_b[None])), back)
    rows, back = _distinct(fbig[a_i])
    vb = _expand(_max_last(np.minimum(ex_b[None], rows[:, None, None, :])), back)
    return va + vb - cur_v[a_i] - v_b[None, :, None]


def _best_move(
    s: _Search,
    cands: list[_Candidate],
    tables: list[np.ndarray],
    spare_tab: list[np.ndarray],
    tps: list[int],
    speeds: list[float],
    value: float,
    top: int,
) -> _Move | None:
    """The best of the ``top`` best candidates by the exact split, when it improves
    on ``value``."""
    best_move: _Move | None = None
    # the best ``top`` in sorted order (``heapq.nsmallest`` is ``sorted()[:top]``)
    for _, kind, a_i, i, b_i, j in heapq.nsmallest(top, cands):
        new_t, new_v = list(tps), list(speeds)
        ta = tables[a_i]
        if kind == "swap":
            tb = tables[b_i]
            new_a = ta.copy()
            new_a[i] = tb[j]
            new_b = tb.copy()
            new_b[j] = ta[i]
            new_t[a_i], new_v[a_i] = s.best(new_a)
            new_t[b_i], new_v[b_i] = s.best(new_b)
        else:
            new_a = ta.copy()
            new_a[i] = spare_tab[j]
            new_t[a_i], new_v[a_i] = s.best(new_a)
        got = s.split(new_t, new_v)
        g = 0.0 if got is None else got.goodput
        if g > value * (1 + IMPROVE_TOL) and (best_move is None or g > best_move[0]):
            best_move = (g, kind, a_i, i, b_i, j, new_t, new_v, got)
    return best_move


def _plan(
    instance: Instance,
    plan: Plan,
    slots: _Slots,
    reps: list[list[int]],
    tps: list[int],
    speeds: list[float],
    layout: Layout | None = None,
    split: BatchSplit | None = None,
) -> tuple[Plan, Layout] | None:
    """The plan and layout of the slots ``reps`` at degrees ``tps``; ``split``:
    the exact split at ``tps`` and ``speeds`` when the search has it."""
    job = instance.job
    keep = [r for r, t in enumerate(tps) if t > 0]
    if split is None:
        c = job.seq_time_s
        split = split_batch(job, [speeds[r] / c for r in keep], [tps[r] for r in keep])
    if split is None:
        return None
    kept = [(r, int(b)) for r, b in zip(keep, split.batches, strict=True) if b > 0]
    pp = np.array([len(reps[r]) for r, _ in kept], dtype=np.int64)
    n = int(pp.sum())
    starts = np.cumsum(pp) - pp
    ks = np.fromiter(chain.from_iterable(reps[r] for r, _ in kept), dtype=np.int64, count=n)
    lens = np.repeat(np.array([tps[r] for r, _ in kept], dtype=np.int64), pp)
    # every stage's first GPUs gathered at once
    firsts = slots.bounds[ks]
    ends = np.cumsum(lens)
    total = int(ends[-1]) if n else 0
    flat = slots.gpus[np.arange(total) + np.repeat(firsts - (ends - lens), lens)]
    old = _OldStages.of(plan, layout, slots, ks, lens, pp, starts)
    replicas = _swap_replicas(instance, plan, slots, reps, tps, kept, flat, lens, ks, starts, old)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    lay = Layout(
        replica=np.repeat(np.arange(len(kept), dtype=np.int64), pp),
        stage=np.arange(n, dtype=np.int64) - np.repeat(starts, pp),
        domain=slots.domain[ks],
        offsets=offsets,
        gpus=flat.astype(np.int64, copy=False),
        power=np.ones(n),
        degree=np.array([tps[r] for r, _ in kept], dtype=np.int64),
        batch=np.array([b for _, b in kept], dtype=np.int64),
        metrics={"policy": "swaps"},
        instance=plan.instance,
    )
    return Plan(plan.instance, tuple(replicas), {"policy": "swaps"}), lay


@dataclass(frozen=True)
class _OldStages:
    """Which stages of the swap plan are the running plan's: per stage, whether it
    is (``is_old``: read from the layout, its first GPUs its own, in order, and as
    many) and which plan replica and stage it was (``rep_of``, ``st_of``); per
    replica, whether it is a whole plan replica (``whole``: all of one plan
    replica's stages, in its order, each at power 1)."""

    is_old: np.ndarray
    whole: np.ndarray
    rep_of: list[int]
    st_of: list[int]

    @classmethod
    def of(
        cls,
        plan: Plan,
        layout: Layout | None,
        slots: _Slots,
        ks: np.ndarray,
        lens: np.ndarray,
        pp: np.ndarray,
        starts: np.ndarray,
    ) -> _OldStages:
        """Read them from the slots ``ks`` of the stages (``lens`` GPUs each; ``pp``
        stages per replica from ``starts``)."""
        n = len(ks)
        is_old = np.zeros(n, dtype=bool)
        whole = np.zeros(len(pp), dtype=bool)
        if layout is None or not plan.replicas or not n:
            return cls(is_old, whole, [], [])
        origin = slots.origin[ks]
        sizes = np.diff(layout.offsets)
        at = np.maximum(origin, 0)
        # a spare domain's slot (origin -1) has no ``same`` flag: it is no old stage
        is_old = (origin >= 0) & slots.same[at] & (sizes[at] == lens)
        p_of = layout.replica[at]
        if (pp > 0).all():
            ok = (
                is_old
                & (layout.stage[at] == np.arange(n) - np.repeat(starts, pp))
                & (p_of == np.repeat(p_of[starts], pp))
            )
            # ... and every stage of that plan replica (as many), each at power 1
            # (the layout's powers are the plan's)
            whole = np.logical_and.reduceat(ok & (layout.power[at] == 1.0), starts) & (
                np.bincount(layout.replica, minlength=len(plan.replicas))[p_of[starts]] == pp
            )
        return cls(is_old, whole, p_of.tolist(), layout.stage[at].tolist())


def _swap_replicas(
    instance: Instance,
    plan: Plan,
    slots: _Slots,
    reps: list[list[int]],
    tps: list[int],
    kept: list[tuple[int, int]],
    flat: np.ndarray,
    lens: np.ndarray,
    ks: np.ndarray,
    starts: np.ndarray,
    old: _OldStages,
) -> list[Replica]:
    """The swap plan's replicas in node ids: the plan's replica or stage objects
    where :class:`_OldStages` allows, the other stages' GPU ids looked up at once."""
    a = instance.arrays
    fresh = flat[np.repeat(~old.is_old, lens)].tolist()
    names: tuple[Any, ...] = (
        itemgetter(*fresh)(a.gpu_ids) if len(fresh) > 1 else tuple(a.gpu_ids[g] for g in fresh)
    )
    domain_ids = a.domain_ids
    old_l, ks_l, first_l = old.is_old.tolist(), ks.tolist(), starts.tolist()
    whole_l, rep_of, st_of = old.whole.tolist(), old.rep_of, old.st_of
    replicas = []
    pos = 0
    for q, (r, b) in enumerate(kept):
        t = tps[r]
        i0 = first_l[q]
        if whole_l[q]:  # the plan's replica (its object, when the batch is the same)
            prev = plan.replicas[rep_of[i0]]
            same = prev.tp == t and prev.local_batch == b
            replicas.append(prev if same else Replica(tp=t, local_batch=b, stages=prev.stages))
            continue
        stages = []
        for i in range(i0, i0 + len(reps[r])):
            if old_l[i]:
                o = plan.replicas[rep_of[i]].stages[st_of[i]]
                stages.append(o if o.power == 1.0 else Stage(o.domain, o.gpus, 1.0))
                continue
            stages.append(Stage(domain_ids[int(slots.domain[ks_l[i]])], names[pos : pos + t], 1.0))
            pos += t
        replicas.append(Replica(tp=t, local_batch=b, stages=tuple(stages)))
    return replicas
