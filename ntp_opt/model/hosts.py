"""Host-compact stages: the same plan with each stage's GPUs on as few hosts as possible.

A planner picks how many GPUs of which kind each stage takes in a domain; which
of several interchangeable GPUs it takes changes nothing the model measures but
matters to the launcher: ``torchrun`` numbers a host's ranks contiguously, so a
host whose GPUs serve two stages that are not neighbours in Megatron's rank
order cannot be launched with it (``docs/export.md``). :func:`pack_hosts`
re-assigns, inside every domain, the GPUs of each class of interchangeable GPUs
among the domain's stages and its idle GPUs, whole hosts (trays) first.

Two healthy GPUs are interchangeable when they share domain, rack, ``speed``,
``tdp_w`` and ``max_power_w`` and sit on trays that cannot fail within the
horizon (tray ``p_fail`` 0 and every GPU of the tray at ``p_fail`` 0). A stage
keeps its domain, power multiplier and the number of GPUs of every class, and an
idle GPU stays idle in its class, so every stage's slowest speed, every board
limit, every rack's and the site's draw, hence goodput, power and the failure
scenarios (whatever the blast radius) are unchanged. GPUs of a tray that may fail
are never moved.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan

__all__ = ["host_splits", "pack_hosts", "pack_plan_hosts"]


def movable_gpus(instance: Instance) -> np.ndarray:
    """Per GPU: healthy and on a tray that cannot fail (tray and GPUs at ``p_fail`` 0)."""
    a = instance.arrays
    risky = np.bincount(a.gpu_tray, weights=(a.p_fail > 0), minlength=len(a.tray_ids)) > 0
    risky |= a.tray_p_fail > 0
    return a.healthy & ~risky[a.gpu_tray]


def _classes(instance: Instance, idx: np.ndarray) -> np.ndarray:
    """Class id of GPUs ``idx``: equal ids share domain, rack, speed, tdp and max power."""
    a = instance.arrays
    cols = (a.gpu_domain[idx], a.gpu_rack[idx], a.speed[idx], a.tdp[idx], a.max_power[idx])
    order = np.lexsort(cols[::-1])
    change = np.zeros(len(idx), dtype=bool)
    for col in cols:
        srt = col[order]
        change[1:] |= srt[1:] != srt[:-1]
    out = np.empty(len(idx), dtype=np.int64)
    out[order] = np.cumsum(change)
    return out


def host_splits(instance: Instance, layout: Layout) -> int:
    """Number of trays whose GPUs serve two or more stages of ``layout``."""
    a = instance.arrays
    sizes = np.diff(layout.offsets)
    owner = np.repeat(np.arange(layout.n_stages, dtype=np.int64), sizes)
    pairs = np.unique(a.gpu_tray[layout.gpus] * (layout.n_stages + 1) + owner)
    trays = pairs // (layout.n_stages + 1)
    return int((np.bincount(trays) > 1).sum()) if len(trays) else 0


def _well_formed(instance: Instance, layout: Layout) -> bool:
    """Distinct known healthy GPUs, each in its stage's domain (else nothing moves)."""
    a = instance.arrays
    g = layout.gpus
    if g.min() < 0 or g.max() >= a.n_gpus or layout.domain.min() < 0:
        return False
    if layout.degree.min() < 1 or layout.batch.min() < 1 or not np.isfinite(layout.power).all():
        return False
    if np.bincount(g, minlength=a.n_gpus).max() > 1 or not a.healthy[g].all():
        return False
    return bool((a.gpu_domain[g] == np.repeat(layout.domain, np.diff(layout.offsets))).all())


def _fill(
    caps: Sequence[int], needs: Sequence[int], spares: Sequence[int]
) -> list[list[tuple[int, int]]]:
    """Per host (index into ``caps``): ``(stage position, count)`` in fill order.

    Stages are filled in order, whole hosts first (largest first, then host
    order); a stage's remainder goes to a host whose leftover can stay idle
    (within the group's slack), preferably one with room for the stage's
    ``spares`` too, the smallest such. When every choice would leave more than
    the slack, whole hosts summing exactly to the stage's size are taken if
    there are such, else the next stage starts on the remainder host.
    """
    order = sorted(range(len(caps)), key=lambda h: (-caps[h], h))
    out: list[list[tuple[int, int]]] = [[] for _ in caps]
    slack = sum(caps) - sum(needs)
    free = list(order)  # hosts not yet touched, largest first
    carry: tuple[int, int] | None = None  # (host, GPUs left) shared with the next stage
    for s, need in enumerate(needs):
        if carry is not None:
            h, left = carry
            take = min(left, need)
            out[h].append((s, take))
            need -= take
            carry = (h, left - take) if left > take else None
        if need > 0 and carry is None:
            exact = _exact_fit([caps[h] for h in free], need)
            remainder = _greedy_leftover([caps[h] for h in free], need, spares[s], slack)
            if exact is not None and remainder > slack:  # whole hosts instead of sharing one
                for h in [free[j] for j in exact]:
                    out[h].append((s, caps[h]))
                free = [h for j, h in enumerate(free) if j not in set(exact)]
                need = 0
        while need > 0:
            whole = next((h for h in free if caps[h] <= need), None)
            if whole is not None:
                free.remove(whole)
                out[whole].append((s, caps[whole]))
                need -= caps[whole]
                continue
            fits = [h for h in free if caps[h] >= need]
            if not fits:  # cannot happen for a valid plan: keep the group as it is
                raise ValueError("hosts too small")
            h = min(fits, key=lambda h: _remainder_key(caps[h], need, spares[s], slack, h))
            free.remove(h)
            out[h].append((s, need))
            left = caps[h] - need
            need = 0
            if left > slack:
                carry = (h, left)
            else:
                slack -= left
    return out


def _remainder_key(
    cap: int, need: int, spares: int, slack: int, h: int
) -> tuple[bool, bool, int, int]:
    """Preference of a host for a stage's remainder (smallest first): its leftover can
    stay idle, it has room for the stage's inactive ranks, it is small."""
    return (cap - need > slack, cap < need + spares, cap, h)


def _greedy_leftover(caps: list[int], need: int, spares: int, slack: int) -> int:
    """GPUs the greedy fill of one stage leaves on its remainder host (``caps`` largest first)."""
    rest = list(caps)
    while need > 0:
        whole = next((c for c in rest if c <= need), None)
        if whole is None:
            fits = [c for c in rest if c >= need]
            if not fits:
                return 0
            return min(fits, key=lambda c: _remainder_key(c, need, spares, slack, 0)) - need
        rest.remove(whole)
        need -= whole
    return 0


def _exact_fit(caps: list[int], need: int) -> list[int] | None:
    """Positions in ``caps`` of whole hosts summing to ``need`` exactly (largest first), or None."""
    by_cap: dict[int, list[int]] = {}
    for j, c in enumerate(caps):
        by_cap.setdefault(c, []).append(j)
    values = sorted(by_cap, reverse=True)
    return _exact_fit_from(by_cap, values, set(), 0, need)


def _exact_fit_from(
    by_cap: dict[int, list[int]],
    values: list[int],
    seen: set[tuple[int, int]],
    i: int,
    left: int,
) -> list[int] | None:
    """:func:`_exact_fit`'s search over host sizes ``values[i:]`` for ``left`` GPUs."""
    if left == 0:
        return []
    if i == len(values) or (i, left) in seen:
        return None
    seen.add((i, left))
    v = values[i]
    for k in range(min(len(by_cap[v]), left // v), -1, -1):
        found = _exact_fit_from(by_cap, values, seen, i + 1, left - k * v)
        if found is not None:
            return by_cap[v][:k] + found
    return None


def _score(trays: np.ndarray, owner: np.ndarray, n_stages: int) -> tuple[int, int]:
    """(trays serving two or more stages, distinct (tray, stage) pairs) of one group."""
    used = owner >= 0
    pairs = np.unique(trays[used] * (n_stages + 1) + owner[used])
    t = pairs // (n_stages + 1)
    _, counts = np.unique(t, return_counts=True)
    return int((counts > 1).sum()), len(pairs)


def pack_hosts(instance: Instance, layout: Layout) -> Layout:
    """The same plan with every stage's GPUs packed onto whole hosts where possible.

    Inside each domain and each class of interchangeable GPUs (see the module
    docstring), the class's GPUs are dealt out again to the domain's stages
    (in replica, then stage order: consecutive stages of a replica are
    neighbours in Megatron's rank order) and to idle: whole trays first; the
    GPUs a reduced stage leaves free on its last tray stay idle when the
    domain has idle GPUs to spare, so that the export can put the stage's
    inactive ranks there. A group is rewritten only when that does not add
    trays shared by stages. Deterministic.

    Parameters
    ----------
    instance
        The instance the layout is for.
    layout
        A layout (a plan's). Unless its GPUs are distinct, healthy GPUs of
        their stages' domains, it is returned as it is (the validator reports
        what is wrong).

    Returns
    -------
    Layout
        The same replicas, domains, powers, degrees and batches; each stage
        keeps its number of GPUs of every class (its GPUs in index order), so
        goodput, power and expected goodput are those of ``layout``. A
        stage's GPUs are listed tray by tray, trays with idle GPUs last (the
        export's local-rank order, so that the plan reads back unchanged).
        ``layout`` itself when nothing changes.
    """
    a = instance.arrays
    n_st = layout.n_stages
    if n_st == 0 or len(layout.gpus) == 0 or not _well_formed(instance, layout):
        return layout
    sizes = np.diff(layout.offsets)
    owner = np.full(a.n_gpus, -1, dtype=np.int64)
    owner[layout.gpus] = np.repeat(np.arange(n_st, dtype=np.int64), sizes)
    movable = movable_gpus(instance)
    # candidates: movable GPUs of the domains that hold a stage
    has_stage = np.zeros(a.n_domains, dtype=bool)
    has_stage[layout.domain] = True
    cand = np.flatnonzero(movable & has_stage[a.gpu_domain])
    if len(cand) == 0:
        return _ordered(instance, layout, owner)
    cls = _classes(instance, cand)
    trays = a.gpu_tray[cand]
    own = owner[cand]
    # groups whose trays all serve one owner (a stage or idle) are already packed
    mixed = _mixed_classes(cls, trays, own, len(a.tray_ids), n_st)
    order = np.lexsort((cand, cls))
    cand, cls, trays, own = cand[order], cls[order], trays[order], own[order]
    bounds = np.searchsorted(cls, np.arange(len(mixed) + 1))
    spare_ranks = instance.job.tp - layout.degree[layout.replica]
    new_owner = owner.copy()
    for c in np.flatnonzero(mixed).tolist():
        lo, hi = int(bounds[c]), int(bounds[c + 1])
        g, t, o = cand[lo:hi], trays[lo:hi], own[lo:hi]
        got = _repacked(g, t, o, sizes, spare_ranks)
        if got is not None and _score(t, got, n_st) <= _score(t, o, n_st):
            new_owner[g] = got
    return _ordered(instance, layout, new_owner)


def _mixed_classes(
    cls: np.ndarray, trays: np.ndarray, own: np.ndarray, n_trays: int, n_st: int
) -> np.ndarray:
    """Per class: whether one of its trays serves two owners (stages or idle)."""
    key = np.unique((cls * (n_trays + 1) + trays) * (n_st + 2) + (own + 1))
    tray_key = key // (n_st + 2)
    first = np.ones(len(tray_key), dtype=bool)
    first[1:] = tray_key[1:] != tray_key[:-1]
    counts = np.diff(np.append(np.flatnonzero(first), len(tray_key)))
    mixed = np.zeros(int(cls.max()) + 1, dtype=bool)
    mixed[tray_key[first][counts > 1] // (n_trays + 1)] = True
    return mixed


def _repacked(
    g: np.ndarray, t: np.ndarray, o: np.ndarray, sizes: np.ndarray, spare_ranks: np.ndarray
) -> np.ndarray | None:
    """The owners :func:`_fill` deals one class's GPUs ``g`` (trays ``t``, owners ``o``)
    out to, or ``None`` when the class holds no stage or its hosts are too small."""
    stages = np.unique(o[o >= 0])
    if len(stages) == 0:
        return None
    host_ids, host_of = np.unique(t, return_inverse=True)
    caps = np.bincount(host_of).tolist()
    needs = np.bincount(np.searchsorted(stages, o[o >= 0]), minlength=len(stages)).tolist()
    whole = [int(sizes[s]) == n for s, n in zip(stages.tolist(), needs, strict=True)]
    spares = [int(spare_ranks[s]) if w else 0 for s, w in zip(stages.tolist(), whole, strict=True)]
    try:
        fill = _fill(caps, needs, spares)
    except ValueError:
        return None
    members = [g[host_of == h] for h in range(len(host_ids))]  # index order per host
    got = np.full(len(g), -1, dtype=np.int64)
    pos = {int(x): i for i, x in enumerate(g.tolist())}
    for h, parts in enumerate(fill):
        k = 0
        for s, n in parts:
            for x in members[h][k : k + n].tolist():
                got[pos[x]] = stages[s]
            k += n
    return got


def _ordered(instance: Instance, layout: Layout, owner: np.ndarray) -> Layout:
    """``layout`` with the GPUs ``owner`` gives each stage, in launch order.

    A stage's GPUs are grouped by tray: trays with an idle healthy GPU last
    (the export puts a reduced stage's inactive ranks after its last active
    rank, on the same host when it has room), otherwise by tray index; by
    GPU index inside a tray. Returns ``layout`` itself when nothing changes.
    """
    a = instance.arrays
    used = np.flatnonzero(owner >= 0)
    idle = np.bincount(a.gpu_tray[a.healthy & (owner < 0)], minlength=len(a.tray_ids)) > 0
    tray = a.gpu_tray[used]
    gpus = used[np.lexsort((used, tray, idle[tray], owner[used]))]
    if np.array_equal(gpus, layout.gpus):
        return layout
    return Layout(
        replica=layout.replica,
        stage=layout.stage,
        domain=layout.domain,
        offsets=layout.offsets,
        gpus=gpus,
        power=layout.power,
        degree=layout.degree,
        batch=layout.batch,
        metrics=layout.metrics,
        instance=layout.instance,
    )


def pack_plan_hosts(instance: Instance, plan: Plan) -> Plan:
    """:func:`pack_hosts` on a plan (node ids in, node ids out; metrics kept).

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan for ``instance`` (one that breaks the model's GPU rules comes
        back unchanged, for the validator to report).

    Returns
    -------
    Plan
        ``plan`` itself when nothing moves, else the re-assigned plan.
    """
    if not plan.replicas:
        return plan
    layout = Layout.from_plan(instance, plan, strict=False)  # a bad plan: unchanged
    packed = pack_hosts(instance, layout)
    return plan if packed is layout else packed.to_plan(instance)
