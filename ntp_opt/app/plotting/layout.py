"""Where every GPU of a plan is (:func:`plan_layout`) and how racks split into domain parts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ntp_opt.app.plotting.style import FAILED, FAILED_COLOR, SPARE, USED, replica_color
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.rules.power import gpu_draw


@dataclass(frozen=True, eq=False)
class PlanLayout:
    """Per-GPU view of a plan on its instance (arrays in GPU order).

    Attributes
    ----------
    replica, stage
        Replica and stage index of every GPU; -1 when the plan does not use it.
    multiplier
        Power multiplier of the GPU's stage; 0 when unused.
    watts
        Power the GPU runs at: ``tdp_w * multiplier`` when used, the idle draw
        ``idle_power_fraction * tdp_w`` for a healthy spare, 0 when failed.
    state
        ``USED`` (0), ``SPARE`` (1) or ``FAILED`` (2).
    straggler
        ``speed < 1``.
    boosted
        Used with a multiplier above 1.
    moved
        Role changed against ``diff`` (all False without it).
    n_stages
        Stages of every replica.
    tp
        TP degree of every replica (in plan order: replica ``r`` is DP rank ``r``).
    tp_base
        The job's nominal degree ``job.tp``; a replica with ``tp < tp_base``
        is *reduced*.
    """

    replica: np.ndarray
    stage: np.ndarray
    multiplier: np.ndarray
    watts: np.ndarray
    state: np.ndarray
    straggler: np.ndarray
    boosted: np.ndarray
    moved: np.ndarray
    n_stages: tuple[int, ...]
    tp: tuple[int, ...] = ()
    tp_base: int = 0

    @property
    def reduced(self) -> np.ndarray:
        """Per GPU: used by a replica running below ``tp_base``."""
        tps = np.asarray((*self.tp, self.tp_base), dtype=np.int64)
        return (self.replica >= 0) & (tps[self.replica] < self.tp_base)

    def color(self, g: int) -> str:
        """Fill colour of GPU ``g``."""
        if self.state[g] == FAILED:
            return FAILED_COLOR
        r = int(self.replica[g])
        return replica_color(r, int(self.stage[g]), self.n_stages[r] if r >= 0 else 1)


def _assignment(instance: Instance, plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = instance.arrays
    replica = np.full(a.n_gpus, -1, dtype=np.int64)
    stage = np.full(a.n_gpus, -1, dtype=np.int64)
    mult = np.zeros(a.n_gpus, dtype=float)
    for r, rep in enumerate(plan.replicas):
        for s, st in enumerate(rep.stages):
            for gid in st.gpus:
                g = a.gpu_index.get(gid)
                if g is None:
                    raise ValueError(
                        f"replicas[{r}].stages[{s}].gpus: GPU {gid!r} is not in instance "
                        f"{instance.name!r}"
                    )
                replica[g], stage[g], mult[g] = r, s, float(st.power)
    return replica, stage, mult


def _moved(
    replica: np.ndarray, stage: np.ndarray, old_replica: np.ndarray, old_stage: np.ndarray
) -> np.ndarray:
    # Replicas are matched to the old replica sharing most GPUs with them, so a
    # renumbering alone moves nothing.
    match: dict[int, int] = {}
    used = replica >= 0
    for r in np.unique(replica[used]):
        olds = old_replica[(replica == r) & (old_replica >= 0)]
        match[int(r)] = int(np.bincount(olds).argmax()) if len(olds) else -2
    mapped = np.array([match.get(int(r), -1) if r >= 0 else -1 for r in replica], dtype=np.int64)
    return (mapped != old_replica) | (stage != old_stage)


def plan_layout(instance: Instance, plan: Plan, diff: Plan | None = None) -> PlanLayout:
    """Where every GPU is in ``plan``: replica, stage, power, state.

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan for it (every GPU it names must be in the instance).
    diff
        An earlier plan for the same cluster. A GPU has *moved* when it
        became used or unused, or its stage index or replica changed;
        replicas are matched to the earlier replica that shares most of
        their GPUs, so renumbering replicas moves nothing.

    Returns
    -------
    PlanLayout

    Raises
    ------
    ValueError
        A plan names a GPU that is not in the instance.
    """
    a = instance.arrays
    replica, stage, mult = _assignment(instance, plan)
    state = np.where(~a.healthy, FAILED, np.where(replica >= 0, USED, SPARE)).astype(np.int64)
    watts = gpu_draw(instance, np.where(replica >= 0, mult, 0.0))
    if diff is None:
        moved = np.zeros(a.n_gpus, dtype=bool)
    else:
        old_r, old_s, _ = _assignment(instance, diff)
        moved = _moved(replica, stage, old_r, old_s)
    return PlanLayout(
        replica=replica,
        stage=stage,
        multiplier=mult,
        watts=watts,
        state=state,
        straggler=a.speed < 1.0,
        boosted=(replica >= 0) & (mult > 1.0 + 1e-9),
        moved=moved,
        n_stages=tuple(len(rep.stages) for rep in plan.replicas),
        tp=tuple(int(rep.tp) for rep in plan.replicas),
        tp_base=int(instance.job.tp),
    )


def tp_summary(plan: Plan, tp_base: int) -> str:
    """The degree line of the headers: ``8 replicas (DP), TP 32, 3 reduced (TP 31 x 3)``.

    Parameters
    ----------
    plan
        The plan.
    tp_base
        The job's nominal degree ``job.tp``.

    Returns
    -------
    str
    """
    n = plan.n_replicas
    if n == 0:
        return "no replica (paused)"
    low = sorted((r.tp for r in plan.replicas if r.tp < tp_base), reverse=True)
    text = f"{n} replica{'s' if n != 1 else ''} (DP), TP {tp_base}"
    if not low:
        return text + ", none reduced"
    counts = ", ".join(f"TP {t} x {low.count(t)}" for t in sorted(set(low), reverse=True))
    return text + f", {len(low)} reduced ({counts})"


@dataclass(frozen=True)
class Part:
    """The GPUs of one domain inside one rack."""

    rack: int
    domain: int
    gpus: np.ndarray


def domain_parts(instance: Instance) -> list[list[Part]]:
    """Per rack (in rack order), its domain parts (in domain order)."""
    a = instance.arrays
    order = np.lexsort((np.arange(a.n_gpus), a.gpu_domain, a.gpu_rack))
    racks: list[list[Part]] = [[] for _ in a.rack_ids]
    key = a.gpu_rack[order] * (a.n_domains + 1) + a.gpu_domain[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(order) else np.array([])
    ends = np.r_[starts[1:], len(order)]
    for s, e in zip(starts, ends, strict=True):
        g = order[s:e]
        racks[int(a.gpu_rack[g[0]])].append(Part(int(a.gpu_rack[g[0]]), int(a.gpu_domain[g[0]]), g))
    return racks
