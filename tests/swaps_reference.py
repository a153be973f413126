"""The stage-swap search of :mod:`ntp_opt.planners.swaps` as it was before issue 30.

A reference for ``tests/workflows/test_replan_swaps.py``: slots read from the plan's node
ids and sorted one at a time, candidate moves scored one slot at a time. The
module's :func:`~ntp_opt.planners.swaps.improve` must return the same plan. Do
not optimise this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.rules.goodput import split_batch
from ntp_opt.rules.tolerances import ABS_NOISE, IMPROVE_TOL


@dataclass
class _Slot:
    domain: int
    gpus: np.ndarray  # GPU indices, fastest first
    speeds: np.ndarray  # their speeds, descending


def _slots(instance: Instance, plan: Plan) -> tuple[list[list[_Slot]], list[_Slot]]:
    """Slots of every replica's stages, and one slot per unused domain."""
    a = instance.arrays
    index = a.gpu_index
    used = np.zeros(a.n_gpus, dtype=bool)
    stages_in: dict[int, int] = {}
    for rep in plan.replicas:
        for st in rep.stages:
            d = a.domain_index[st.domain]
            stages_in[d] = stages_in.get(d, 0) + 1
            used[[index[g] for g in st.gpus]] = True
    free = a.healthy & ~used

    def make(d: int, own: np.ndarray) -> _Slot:
        g = own
        if stages_in.get(d, 0) <= 1:
            members = a.domain_gpus[d]
            g = np.concatenate([own, members[free[members]]])
        g = g[np.argsort(-a.speed[g], kind="stable")]
        return _Slot(d, g, a.speed[g])

    reps = [
        [
            make(a.domain_index[st.domain], np.array([index[x] for x in st.gpus], dtype=np.int64))
            for st in rep.stages
        ]
        for rep in plan.replicas
    ]
    spare = [
        make(d, np.empty(0, dtype=np.int64))
        for d in range(a.n_domains)
        if d not in stages_in and free[a.domain_gpus[d]].any()
    ]
    return reps, spare


def _exclusive_min(t: np.ndarray) -> np.ndarray:
    """``out[r, k] = min over stages j != k of t[r, j]`` (+inf for one stage)."""
    n = t.shape[1]
    inf = np.full_like(t[:, :1], np.inf)
    pre = np.concatenate([inf, np.minimum.accumulate(t, axis=1)[:, : n - 1]], axis=1)
    suf = np.concatenate([np.minimum.accumulate(t[:, ::-1], axis=1)[:, ::-1][:, 1:], inf], axis=1)
    return np.minimum(pre, suf)


class _Search:
    def __init__(self, instance: Instance, reps: list[list[_Slot]], spare: list[_Slot]):
        job = instance.job
        self.job = job
        self.degrees = np.array(job.allowed, dtype=np.int64)
        self.factor = np.array([job.tp_factor(int(t)) for t in self.degrees])
        self.reps = reps
        self.spare = spare

    def table(self, slot: _Slot) -> np.ndarray:
        """``f(t) * s(t)`` per allowed degree (-inf where the slot is too small)."""
        n = len(slot.speeds)
        out = np.full(len(self.degrees), -np.inf)
        ok = self.degrees <= n
        out[ok] = slot.speeds[self.degrees[ok] - 1]
        return out

    def best(self, tables: np.ndarray) -> tuple[int, float]:
        """Degree and power-1 speed (``f(t) * min s``) of a replica from its slot tables."""
        worst = tables.min(axis=0) * self.factor
        worst = np.where(np.isfinite(worst), worst, -np.inf)
        k = len(worst) - 1 - int(np.argmax(worst[::-1]))  # larger degree on ties
        if not np.isfinite(worst[k]):
            return 0, 0.0
        return int(self.degrees[k]), float(worst[k])

    def goodput(self, tps: list[int], speeds: list[float]) -> float:
        keep = [i for i, t in enumerate(tps) if t > 0]
        c = self.job.seq_time_s
        split = split_batch(self.job, [speeds[i] / c for i in keep], [tps[i] for i in keep])
        return 0.0 if split is None else split.goodput


def improve(
    instance: Instance, plan: Plan, focus: set[int], *, rounds: int = 3, top: int = 6
) -> Plan | None:
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

    Returns
    -------
    Plan or None
        The improved plan at power 1 (not yet validated; local batches from
        the exact split), or ``None`` when no move improves goodput at power 1.
    """
    if not plan.replicas or not focus:
        return None
    reps, spare = _slots(instance, plan)
    s = _Search(instance, reps, spare)
    tables = [np.array([s.table(x) for x in r]) for r in reps]
    spare_tab = [s.table(x) for x in spare]
    cur = [s.best(t) for t in tables]
    tps = [t for t, _ in cur]
    speeds = [v for _, v in cur]
    value = s.goodput(tps, speeds)
    start_value = value
    focus = {f for f in focus if 0 <= f < len(reps)}
    changed = False
    for _ in range(rounds):
        cands: list[tuple[float, str, int, int, int, int]] = []  # (-gain, kind, A, i, B, j)
        big = np.stack(tables)  # (replicas, pp, degrees)
        ex = _exclusive_min(big)  # min over the other stages of the replica
        cur_v = np.array(speeds)
        f = s.factor
        sp_tab = np.array(spare_tab) if spare_tab else np.zeros((0, len(f)))
        for a_i in sorted(focus):
            for i in range(big.shape[1]):
                rest_a = ex[a_i, i]  # (degrees,)
                va = (np.minimum(rest_a, big) * f).max(axis=2)  # A gets slot (b, j)
                vb = (np.minimum(ex, big[a_i, i]) * f).max(axis=2)  # b gets A's slot i
                gain = va + vb - cur_v[a_i] - cur_v[:, None]
                gain[a_i, :] = -np.inf
                for b_i, j in zip(*np.nonzero(gain > ABS_NOISE), strict=True):
                    cands.append((-float(gain[b_i, j]), "swap", a_i, i, int(b_i), int(j)))
                if len(sp_tab):
                    vs = (np.minimum(rest_a, sp_tab) * f).max(axis=1) - cur_v[a_i]
                    for j in np.nonzero(vs > ABS_NOISE)[0]:
                        cands.append((-float(vs[j]), "spare", a_i, i, -1, int(j)))
        cands.sort()
        best_move = None
        for _, kind, a_i, i, b_i, j in cands[:top]:
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
            g = s.goodput(new_t, new_v)
            if g > value * (1 + IMPROVE_TOL) and (best_move is None or g > best_move[0]):
                best_move = (g, kind, a_i, i, b_i, j, new_t, new_v)
        if best_move is None:
            break
        value, kind, a_i, i, b_i, j, tps, speeds = best_move
        if kind == "swap":
            reps[a_i][i], reps[b_i][j] = reps[b_i][j], reps[a_i][i]
            tables[a_i][i], tables[b_i][j] = tables[b_i][j].copy(), tables[a_i][i].copy()
            focus.add(b_i)
        else:
            reps[a_i][i], spare[j] = spare[j], reps[a_i][i]
            tables[a_i][i], spare_tab[j] = spare_tab[j].copy(), tables[a_i][i].copy()
        changed = True
    # re-degree alone (e.g. after a repair) is covered by recomputing every
    # replica's best degree from its slots above
    if not changed and value <= start_value * (1 + IMPROVE_TOL):
        # the slots' best degrees may still differ from the plan's (repairs)
        if all(t == rep.tp for t, rep in zip(tps, plan.replicas, strict=True)):
            return None
    return _plan(instance, plan, reps, tps, speeds)


def _plan(
    instance: Instance,
    plan: Plan,
    reps: list[list[_Slot]],
    tps: list[int],
    speeds: list[float],
) -> Plan | None:
    a = instance.arrays
    job = instance.job
    keep = [r for r, t in enumerate(tps) if t > 0]
    split = split_batch(job, [speeds[r] / job.seq_time_s for r in keep], [tps[r] for r in keep])
    if split is None:
        return None
    replicas = []
    for r, b in zip(keep, split.batches, strict=True):
        if b <= 0:
            continue
        t = tps[r]
        replicas.append(
            Replica(
                tp=t,
                local_batch=int(b),
                stages=tuple(
                    Stage(a.domain_ids[x.domain], tuple(a.gpu_ids[g] for g in x.gpus[:t]), 1.0)
                    for x in reps[r]
                ),
            )
        )
    return Plan(plan.instance, tuple(replicas), {"policy": "swaps"})
