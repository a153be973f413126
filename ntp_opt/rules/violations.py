"""The rules of docs/model.md, spec section 3, checked plan by plan, each broken one a
:class:`Violation` whose message names the replica, stage, GPU or rack.

:func:`ntp_opt.rules.validate.evaluate` runs these checks and recomputes the
plan's figures; :data:`RULES` lists the rule codes.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.model.workloads import MultiPlan
from ntp_opt.rules import goodput as gp
from ntp_opt.rules.power import board_over, over_budget
from ntp_opt.rules.tolerances import METRIC_ABS_TOL, METRIC_TOL, POWER_TOL

__all__ = [
    "RULES",
    "Violation",
    "batch_sum_violations",
    "board_violations",
    "budget_violations",
    "metrics_violations",
    "plan_violations",
]

#: Rule codes and what each one forbids.
RULES: dict[str, str] = {
    "instance": "the plan names another instance",
    "replica-count": "more replicas than job.dp_max",
    "tp-allowed": "a replica's TP degree is not in job.tp_allowed",
    "batch-range": "a local batch is not an integer in [1, job.max_local_batch]",
    "stage-count": "a replica does not have exactly job.pp stages",
    "domain-unknown": "a stage names a node that is not a domain",
    "power-range": "a stage's power multiplier is outside [1, 1 + job.max_boost]",
    "board-power": "a stage's power multiplier times a GPU's tdp_w exceeds its max_power_w",
    "stage-size": "a stage does not have exactly its replica's TP degree of GPUs",
    "gpu-unknown": "a stage names a node that is not a GPU",
    "gpu-failed": "a stage uses a failed GPU",
    "gpu-outside-domain": "a stage uses a GPU of another domain",
    "gpu-reused": "a GPU is used more than once",
    "batch-sum": "fixed policy: local batches do not sum to B; elastic: they exceed B",
    "rack-power": "a rack draws more than its power budget",
    "site-power": "the site draws more than its power budget",
    "metrics": "the plan's reported goodput differs from the recomputed one",
}


@dataclass(frozen=True)
class Violation:
    """One broken rule.

    Attributes
    ----------
    rule
        A key of :data:`RULES`.
    message
        Human-readable, naming the replica, stage, GPU or rack.
    replica, stage
        Indices (0-based) where the rule is broken, if it is local.
    node
        Node id (GPU, domain or rack) involved, if any.
    """

    rule: str
    message: str
    replica: int | None = None
    stage: int | None = None
    node: Hashable | None = None

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _check_plan(instance: Instance, plan: Plan) -> list[Violation]:
    """The plan's instance name and replica count."""
    job = instance.job
    out: list[Violation] = []
    if plan.instance != instance.name:
        out.append(
            Violation("instance", f"plan is for instance {plan.instance!r}, not {instance.name!r}")
        )
    if len(plan.replicas) > job.replicas_max:
        out.append(
            Violation(
                "replica-count",
                f"{len(plan.replicas)} replicas exceed dp_max={job.replicas_max}",
            )
        )
    return out


def _check_replica(instance: Instance, r: int, rep: Replica) -> list[Violation]:
    """Replica ``r``'s degree, local batch and stage count."""
    job = instance.job
    cap = job.local_batch_max
    where = f"replica {r}"
    out: list[Violation] = []
    if rep.tp not in set(job.allowed):
        out.append(
            Violation(
                "tp-allowed",
                f"{where}: TP degree {rep.tp} not in tp_allowed {list(job.allowed)}",
                replica=r,
            )
        )
    b = rep.local_batch
    if isinstance(b, bool) or not isinstance(b, int | np.integer) or not 1 <= b <= cap:
        out.append(
            Violation(
                "batch-range",
                f"{where}: local batch {b!r} is not an integer in [1, {cap}]",
                replica=r,
            )
        )
    if len(rep.stages) != job.pp:
        out.append(
            Violation(
                "stage-count",
                f"{where}: {len(rep.stages)} stages, job.pp={job.pp}",
                replica=r,
            )
        )
    return out


def _stage_problems(
    instance: Instance, plan: Plan, lay: Layout, first: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-stage checks on the layout's arrays.

    Returns each stage's power multiplier clipped into range (as the rules use
    it), a per-stage flag "some rule is broken here" and per GPU entry of
    ``lay.gpus`` a code: 0 fine, 1 unknown, else a bit set of 2 failed, 4 in
    another domain, 8 reused (``first``: per GPU, the entry using it first).
    """
    a = instance.arrays
    hi_power = 1.0 + instance.job.max_boost
    n = lay.n_stages
    pw = lay.power
    typed = np.fromiter(
        (isinstance(st.power, int | float) for rep in plan.replicas for st in rep.stages),
        bool,
        n,
    )
    finite = np.isfinite(pw)
    with np.errstate(invalid="ignore"):
        power_ok = typed & finite & (pw >= 1.0 - POWER_TOL) & (pw <= hi_power * (1 + POWER_TOL))
    clipped = np.where(power_ok, pw, np.where(finite, np.clip(pw, 1.0, hi_power), 1.0))
    sizes = np.diff(lay.offsets)
    bad = ~power_ok | (lay.domain < 0) | (sizes != lay.degree[lay.replica])
    g = lay.gpus
    known = g >= 0
    safe = np.where(known, g, 0)
    ent_stage = np.repeat(np.arange(n, dtype=np.int64), sizes)
    dom = lay.domain[ent_stage]
    code = np.where(known, 0, 1)
    code |= np.where(known & ~a.healthy[safe], 2, 0)
    code |= np.where(known & (dom >= 0) & (a.gpu_domain[safe] != dom), 4, 0)
    code |= np.where(known & (first[safe] != np.arange(len(g))), 8, 0)
    bad[ent_stage[code > 0]] = True
    return clipped, bad, code


def _first_use(lay: Layout, n_gpus: int) -> np.ndarray:
    """Per GPU index: the entry of ``lay.gpus`` that uses it first, or -1."""
    g = lay.gpus
    entries = np.flatnonzero(g >= 0)
    gk = g[entries]
    first = np.full(n_gpus, -1, dtype=np.int64)
    if gk.size and np.bincount(gk, minlength=n_gpus).max() > 1:
        uniq, pos = np.unique(gk, return_index=True)
        first[uniq] = entries[pos]
    else:
        first[gk] = entries
    return first


def _stage_violations(
    instance: Instance, plan: Plan, lay: Layout, s: int, code: np.ndarray, first: np.ndarray
) -> list[Violation]:
    """Every rule stage ``s`` (flat index) of the layout breaks, in the plan's order."""
    hi_power = 1.0 + instance.job.max_boost
    r, k = int(lay.replica[s]), int(lay.stage[s])
    rep = plan.replicas[r]
    st = rep.stages[k]
    sw = f"replica {r} stage {k}"
    out: list[Violation] = []
    d = int(lay.domain[s])
    if d < 0:
        out.append(
            Violation(
                "domain-unknown",
                f"{sw}: {st.domain!r} is not a domain of the cluster",
                replica=r,
                stage=k,
                node=st.domain,
            )
        )
    pw = st.power
    if not (isinstance(pw, int | float) and math.isfinite(pw)) or not (
        1.0 - POWER_TOL <= pw <= hi_power * (1 + POWER_TOL)
    ):
        out.append(
            Violation(
                "power-range",
                f"{sw}: power multiplier {pw!r} outside [1, {_fmt(hi_power)}]",
                replica=r,
                stage=k,
            )
        )
    if len(st.gpus) != rep.tp:
        out.append(
            Violation(
                "stage-size",
                f"{sw}: {len(st.gpus)} GPUs for TP degree {rep.tp}",
                replica=r,
                stage=k,
            )
        )
    return out + _gpu_violations(instance, lay, s, st, code, first)


def _gpu_violations(
    instance: Instance,
    lay: Layout,
    s: int,
    st: Stage,
    code: np.ndarray,
    first: np.ndarray,
) -> list[Violation]:
    """The GPU rules stage ``s`` (the plan's ``st``) breaks: unknown, failed, foreign
    and reused GPUs, GPU by GPU (``code``: :func:`_stage_problems`' codes)."""
    a = instance.arrays
    r, k = int(lay.replica[s]), int(lay.stage[s])
    sw = f"replica {r} stage {k}"
    out: list[Violation] = []
    lo = int(lay.offsets[s])
    for j, gid in enumerate(st.gpus):
        c = int(code[lo + j])
        if c == 0:
            continue
        if c == 1:
            out.append(
                Violation(
                    "gpu-unknown",
                    f"{sw}: {gid!r} is not a GPU of the cluster",
                    replica=r,
                    stage=k,
                    node=gid,
                )
            )
            continue
        i = int(lay.gpus[lo + j])
        if c & 2:
            out.append(
                Violation(
                    "gpu-failed", f"{sw}: GPU {gid!r} has failed", replica=r, stage=k, node=gid
                )
            )
        if c & 4:
            out.append(
                Violation(
                    "gpu-outside-domain",
                    f"{sw}: GPU {gid!r} belongs to domain "
                    f"{a.domain_ids[a.gpu_domain[i]]!r}, not {st.domain!r}",
                    replica=r,
                    stage=k,
                    node=gid,
                )
            )
        if c & 8:
            s0 = int(np.searchsorted(lay.offsets, first[i], side="right")) - 1
            r0, k0 = int(lay.replica[s0]), int(lay.stage[s0])
            out.append(
                Violation(
                    "gpu-reused",
                    f"{sw}: GPU {gid!r} is already used by replica {r0} stage {k0}",
                    replica=r,
                    stage=k,
                    node=gid,
                )
            )
    return out


def batch_sum_violations(instance: Instance, plan: Plan) -> list[Violation]:
    """The local batches' sum under the job's batch policy."""
    job = instance.job
    total = sum(int(rep.local_batch) for rep in plan.replicas)
    if not plan.replicas:
        return []
    if job.batch_policy == "fixed" and total != job.global_batch:
        return [
            Violation(
                "batch-sum",
                f"local batches sum to {total}, fixed policy needs global_batch={job.global_batch}",
            )
        ]
    if job.batch_policy == "elastic" and total > job.global_batch:
        return [
            Violation(
                "batch-sum",
                f"local batches sum to {total} > global_batch={job.global_batch}",
            )
        ]
    return []


def plan_violations(
    instance: Instance, plan: Plan
) -> tuple[list[Violation], list[float], np.ndarray, Layout, np.ndarray]:
    """Check every rule; return violations, replica speeds, per-GPU power use,
    the plan's (lenient) layout and per GPU its first entry in ``layout.gpus``."""
    job = instance.job
    a = instance.arrays
    lay = Layout.from_plan(instance, plan, strict=False)
    out = _check_plan(instance, plan)
    first = _first_use(lay, a.n_gpus)
    clipped, bad, code = _stage_problems(instance, plan, lay, first)
    # power multiplier of every used GPU (0 = unused); first use wins
    power_of = np.zeros(a.n_gpus, dtype=float)
    used = np.flatnonzero(first >= 0)
    sizes = np.diff(lay.offsets)
    ent_stage = np.repeat(np.arange(lay.n_stages, dtype=np.int64), sizes)
    power_of[used] = clipped[ent_stage[first[used]]]
    # slowest known GPU of every stage (0 when it has none)
    g = lay.gpus
    speed = np.where(g >= 0, a.speed[np.where(g >= 0, g, 0)], np.inf)
    slowest = np.full(lay.n_stages, np.inf)
    full = np.flatnonzero(sizes > 0)
    if full.size:
        slowest[full] = np.minimum.reduceat(speed, lay.offsets[full])
    slowest[~np.isfinite(slowest)] = 0.0
    slow_l, clip_l = slowest.tolist(), clipped.tolist()
    flagged = set(np.flatnonzero(bad).tolist())
    speeds: list[float] = []
    s = 0
    for r, rep in enumerate(plan.replicas):
        out += _check_replica(instance, r, rep)
        m = len(rep.stages)
        for t in range(s, s + m):
            if t in flagged:
                out += _stage_violations(instance, plan, lay, t, code, first)
        speeds.append(gp.replica_speed(job, rep.tp, slow_l[s : s + m], clip_l[s : s + m]))
        s += m
    out += batch_sum_violations(instance, plan)
    return out, speeds, power_of, lay, first


def board_violations(
    instance: Instance, lay: Layout, first: np.ndarray, power_of: np.ndarray
) -> list[Violation]:
    """GPUs asked for more than the power limit their board accepts (v1.1)."""
    a = instance.arrays
    over = np.flatnonzero(board_over(instance, power_of))
    if not over.size:
        return []
    out = []
    for i in over.tolist():
        s = int(np.searchsorted(lay.offsets, first[i], side="right")) - 1
        r, k = int(lay.replica[s]), int(lay.stage[s])
        g = a.gpu_ids[i]
        out.append(
            Violation(
                "board-power",
                f"replica {r} stage {k}: GPU {g!r} at power multiplier {_fmt(power_of[i])} "
                f"asks for {_fmt(power_of[i] * a.tdp[i])} W, above its max_power_w "
                f"{_fmt(a.max_power[i])} W",
                replica=r,
                stage=k,
                node=g,
            )
        )
    return out


def budget_violations(instance: Instance, rack_w: np.ndarray, site_w: float) -> list[Violation]:
    """The racks, then the site, drawing more than their budget (:func:`over_budget`)."""
    a = instance.arrays
    racks_over, site_over = over_budget(instance, rack_w, site_w)
    out = [
        Violation(
            "rack-power",
            f"rack {a.rack_ids[i]!r} draws {_fmt(rack_w[i])} W, budget {_fmt(a.rack_budget[i])} W",
            node=a.rack_ids[i],
        )
        for i in np.flatnonzero(racks_over)
    ]
    if site_over:
        out.append(
            Violation(
                "site-power",
                f"site draws {_fmt(site_w)} W, budget {_fmt(a.site_budget)} W",
            )
        )
    return out


def metrics_violations(
    plan: Plan | MultiPlan, value: float, key: str = "goodput"
) -> list[Violation]:
    """The plan's reported ``key`` (``goodput``; a multi-workload plan's
    ``weighted_goodput``), when it differs from the recomputed ``value``."""
    claimed = plan.metrics.get(key)
    if isinstance(claimed, int | float) and not math.isclose(
        float(claimed), value, rel_tol=METRIC_TOL, abs_tol=METRIC_ABS_TOL
    ):
        what = key.replace("_", " ")
        return [
            Violation(
                "metrics",
                f"plan reports {what} {_fmt(float(claimed))}, recomputed {_fmt(value)}",
            )
        ]
    return []
