"""The independent validator: every rule of docs/model.md, spec section 3, and goodput.

:func:`validate` lists every violated rule with a message that names the
replica, stage, GPU or rack; :func:`evaluate` recomputes goodput from the
instance and the plan alone. Planners never bypass them: every plan that
leaves the package went through :func:`check`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan, Replica
from ntp_opt.rules import goodput as gp
from ntp_opt.rules.power import board_over, over_budget, rack_and_site_draw, redraw
from ntp_opt.rules.tolerances import METRIC_ABS_TOL, METRIC_TOL, POWER_TOL

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


class PlanError(ValueError):
    """A plan broke rules of the model; ``violations`` lists them all."""

    def __init__(self, violations: list[Violation]):
        self.violations = violations
        head = "; ".join(str(v) for v in violations[:5])
        more = f" (and {len(violations) - 5} more)" if len(violations) > 5 else ""
        super().__init__(f"infeasible plan: {head}{more}")


@dataclass(frozen=True)
class Evaluation:
    """Figures of a plan, recomputed from the instance and the plan alone.

    Attributes
    ----------
    feasible
        No rule is broken.
    violations
        The broken rules.
    goodput
        Sequences per second (the formula's value even for an infeasible
        plan: check ``feasible``).
    relative_goodput
        ``goodput * c / R``: 1.0 for the same job with no failures.
    step_time
        ``theta`` in seconds (``inf`` for an empty plan).
    total_batch
        ``sum_r b_r``.
    replica_speeds
        ``v_r`` for every replica, sequences per second.
    n_replicas, n_reduced
        Replicas, and replicas below the nominal TP degree.
    gpus_used
        GPUs in some stage.
    site_power_w
        Site draw in watts; ``rack_power_w`` per rack, in rack order.
    """

    feasible: bool
    violations: tuple[Violation, ...]
    goodput: float
    relative_goodput: float
    step_time: float
    total_batch: int
    replica_speeds: tuple[float, ...]
    n_replicas: int
    n_reduced: int
    gpus_used: int
    site_power_w: float
    rack_power_w: tuple[float, ...]

    def as_metrics(self) -> dict[str, float | int]:
        """The figures a plan file stores under ``metrics``."""
        return {
            "goodput": self.goodput,
            "relative_goodput": self.relative_goodput,
            "step_time_s": self.step_time if math.isfinite(self.step_time) else -1.0,
            "replicas": self.n_replicas,
            "reduced_replicas": self.n_reduced,
            "gpus_used": self.gpus_used,
            "site_power_w": self.site_power_w,
        }


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
    a = instance.arrays
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


def _check_batch_sum(instance: Instance, plan: Plan) -> list[Violation]:
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


def _check(
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
    out += _check_batch_sum(instance, plan)
    return out, speeds, power_of, lay, first


def _board_power(
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


def evaluate(instance: Instance, plan: Plan) -> Evaluation:
    """Recompute a plan's figures and check every rule.

    Parameters
    ----------
    instance
        The instance.
    plan
        The plan to evaluate; its ``metrics`` are checked, never used.

    Returns
    -------
    Evaluation
    """
    job = instance.job
    a = instance.arrays
    violations, speeds, power_of, lay, first = _check(instance, plan)
    violations += _board_power(instance, lay, first, power_of)
    rack_w, site_w = rack_and_site_draw(instance, power_of)
    racks_over, site_over = over_budget(instance, rack_w, site_w)
    for i in np.flatnonzero(racks_over):
        violations.append(
            Violation(
                "rack-power",
                f"rack {a.rack_ids[i]!r} draws {_fmt(rack_w[i])} W, budget "
                f"{_fmt(a.rack_budget[i])} W",
                node=a.rack_ids[i],
            )
        )
    if site_over:
        violations.append(
            Violation(
                "site-power",
                f"site draws {_fmt(site_w)} W, budget {_fmt(a.site_budget)} W",
            )
        )
    tps = [rep.tp for rep in plan.replicas]
    batches = [int(rep.local_batch) for rep in plan.replicas]
    theta = gp.step_time(job, tps, batches, speeds)
    value = gp.goodput_at(batches, theta)
    claimed = plan.metrics.get("goodput")
    if isinstance(claimed, int | float) and not math.isclose(
        float(claimed), value, rel_tol=METRIC_TOL, abs_tol=METRIC_ABS_TOL
    ):
        violations.append(
            Violation(
                "metrics",
                f"plan reports goodput {_fmt(float(claimed))}, recomputed {_fmt(value)}",
            )
        )
    return Evaluation(
        feasible=not violations,
        violations=tuple(violations),
        goodput=value,
        relative_goodput=gp.relative_goodput(job, value),
        step_time=theta,
        total_batch=sum(batches),
        replica_speeds=tuple(speeds),
        n_replicas=len(plan.replicas),
        n_reduced=sum(1 for t in tps if t < job.tp),
        gpus_used=int((power_of > 0).sum()),
        site_power_w=site_w,
        rack_power_w=tuple(rack_w.tolist()),
    )


def stage_slowest(
    instance: Instance, layout: Layout, memo: dict[Any, Any] | None = None
) -> np.ndarray:
    """Per stage of a strict layout, the speed of its slowest GPU.

    Parameters
    ----------
    instance, layout
        The instance and the layout (every stage has a GPU).
    memo
        A dict kept by the caller (a re-planning chain's): the last result is
        kept in it with the speed, GPU and offset arrays it was read from, and
        returned again while the same three arrays (the same objects, which
        re-planning never changes in place) are asked for. The same result
        without it.
    """
    speed, gpus, offsets = instance.arrays.speed, layout.gpus, layout.offsets
    kept = None if memo is None else memo.get("slowest")
    if kept is not None and kept[0] is speed and kept[1] is gpus and kept[2] is offsets:
        out: np.ndarray = kept[3]
        return out
    out = np.minimum.reduceat(speed[gpus], offsets[:-1])
    if memo is not None:
        memo["slowest"] = (speed, gpus, offsets, out)
    return out


def layout_speeds(
    instance: Instance,
    layout: Layout,
    *,
    powers: np.ndarray | None = None,
    slowest: np.ndarray | None = None,
    memo: dict[Any, Any] | None = None,
) -> np.ndarray:
    """Per replica of a strict layout, :func:`ntp_opt.rules.goodput.replica_speed`, vectorised.

    Bit for bit the per-replica function: the same products ``pi ** alpha *
    slowest`` (numpy's power is the C library's, as Python's), the exact
    minimum per replica, then ``f(t) * slowest / c``. Every stage must have a
    GPU and every replica a stage.

    Parameters
    ----------
    instance, layout
        The instance and the layout.
    powers
        Multiplier per stage instead of ``layout.power`` (re-boosting tries
        several on the same stages).
    slowest
        Per stage, the speed of its slowest GPU, when known (the same for
        every ``powers``).
    memo
        Where :func:`stage_slowest` keeps its last result, when ``slowest``
        is not given.
    """
    job = instance.job
    if layout.n_replicas == 0:
        return np.zeros(0)
    if slowest is None:
        slowest = stage_slowest(instance, layout, memo)
    pw = layout.power if powers is None else powers
    per_stage = pw**job.power_exponent * slowest
    first = np.searchsorted(layout.replica, np.arange(layout.n_replicas))
    low = np.minimum.reduceat(per_stage, first)
    factors = {t: job.tp_factor(t) for t in set(layout.degree.tolist())}
    factor = np.array([factors[t] for t in layout.degree.tolist()], dtype=float)
    out: np.ndarray = factor * low / job.seq_time_s
    return out


def evaluate_layout(
    instance: Instance, plan: Plan, layout: Layout, memo: dict[Any, Any] | None = None
) -> Evaluation:
    """:func:`evaluate` of ``plan`` from its strict layout, on index arrays only.

    The re-planning path: ``layout`` is ``Layout.from_plan(instance, plan)``
    (or the layout the plan was written from), so node ids are never looked
    up. Every rule is checked at once on the arrays (degrees, batches, stage
    counts and sizes, power ranges and boards, failed, foreign and reused
    GPUs, the batch sum, every rack and the site); only when one is broken
    does the full :func:`evaluate` run, for its messages. The figures are
    bit for bit :func:`evaluate`'s (tests compare them).

    Parameters
    ----------
    instance
        The instance.
    plan
        The plan (its ``metrics`` are checked; its stages are read only on
        the fall-back).
    layout
        The plan's strict layout.
    memo
        A re-planning chain's memo: the stages' slowest speeds are read
        from it when the same arrays were read before
        (:func:`stage_slowest`), and the power draw of the last check that
        passed is kept in it: the next check draws again only the GPUs
        whose multiplier or health changed, and checks health and boards
        there only (:func:`ntp_opt.rules.power.redraw`; elsewhere a GPU
        runs as in a check that passed). The same figures and violations
        without it.

    Returns
    -------
    Evaluation
    """
    job = instance.job
    a = instance.arrays
    lay = layout
    n_rep = lay.n_replicas
    if (
        plan.instance != instance.name
        or n_rep != len(plan.replicas)
        or n_rep > job.replicas_max
        or not all(type(rep.local_batch) is int for rep in plan.replicas)
    ):
        return evaluate(instance, plan)
    deg, batch = lay.degree, lay.batch
    sizes = np.diff(lay.offsets)
    hi_power = 1.0 + job.max_boost
    pw = lay.power
    g = lay.gpus
    with np.errstate(invalid="ignore"):
        fine = (
            bool(np.isin(deg, job.allowed).all())
            and bool(((batch >= 1) & (batch <= job.local_batch_max)).all())
            and bool((np.bincount(lay.replica, minlength=n_rep) == job.pp).all())
            and bool((sizes == deg[lay.replica]).all())
            and bool(
                (
                    np.isfinite(pw) & (pw >= 1.0 - POWER_TOL) & (pw <= hi_power * (1 + POWER_TOL))
                ).all()
            )
        )
    power_of = np.zeros(a.n_gpus, dtype=float)
    if fine and g.size:
        fine = int(g.min()) >= 0 and int(g.max()) < a.n_gpus
        if fine:
            power_of[g] = np.repeat(pw, sizes)
            # every multiplier is > 0 (checked above): fewer GPUs drawing than
            # listed means a GPU is in two stages
            fine = int(np.count_nonzero(power_of)) == g.size and bool(
                (a.gpu_domain[g] == np.repeat(lay.domain, sizes)).all()
            )
    if not fine:
        return evaluate(instance, plan)
    last = None if memo is None else memo.get("drawn")
    drawn, changed = redraw(instance, power_of, last)
    # where a GPU's multiplier and health are those of the last check, which
    # passed, it is healthy if used and within its board's limit
    at = None if changed is None else changed[power_of[changed] > 0]
    if not (a.healthy[g] if at is None else a.healthy[at]).all() or _check_batch_sum(
        instance, plan
    ):
        return evaluate(instance, plan)
    rack_w, site_w = drawn.rack, drawn.site
    racks_over, site_over = over_budget(instance, rack_w, site_w)
    if racks_over.any() or site_over or board_over(instance, power_of, at=at).any():
        return evaluate(instance, plan)
    speeds = layout_speeds(instance, lay, memo=memo).tolist()
    tps = deg.tolist()
    batches = batch.tolist()
    theta = gp.step_time(job, tps, batches, speeds)
    value = gp.goodput_at(batches, theta)
    claimed = plan.metrics.get("goodput")
    if isinstance(claimed, int | float) and not math.isclose(
        float(claimed), value, rel_tol=METRIC_TOL, abs_tol=METRIC_ABS_TOL
    ):
        return evaluate(instance, plan)
    if memo is not None:
        memo["drawn"] = drawn  # passed: the next check starts from it
    return Evaluation(
        feasible=True,
        violations=(),
        goodput=value,
        relative_goodput=gp.relative_goodput(job, value),
        step_time=theta,
        total_batch=sum(batches),
        replica_speeds=tuple(speeds),
        n_replicas=n_rep,
        n_reduced=sum(1 for t in tps if t < job.tp),
        gpus_used=int(g.size),  # each listed once, at a multiplier > 0
        site_power_w=site_w,
        rack_power_w=tuple(rack_w.tolist()),
    )


def validate(instance: Instance, plan: Plan) -> list[Violation]:
    """Every rule of docs/model.md, spec section 3 that ``plan`` breaks (empty if feasible).

    Parameters
    ----------
    instance
        The instance.
    plan
        The plan.

    Returns
    -------
    list of Violation
    """
    return list(evaluate(instance, plan).violations)


class Judgement(Protocol):
    """What an evaluation offers :func:`checked`: feasibility, violations, metrics."""

    @property
    def feasible(self) -> bool:
        """No rule is broken."""

    @property
    def violations(self) -> tuple[Violation, ...]:
        """The broken rules."""

    def as_metrics(self) -> dict[str, float | int]:
        """The figures a plan stores under ``metrics``."""


class Certifiable(Protocol):
    """A plan that can take the validator's figures as its metrics."""

    def with_metrics(self: _P, **metrics: Any) -> _P:
        """A copy with ``metrics`` merged into the existing ones."""


_I = TypeVar("_I")
_P = TypeVar("_P", bound=Certifiable)
_E = TypeVar("_E", bound=Judgement)


def checked(evaluator: Callable[[_I, _P], _E], instance: _I, plan: _P) -> _E:
    """``evaluator(instance, plan)``, raising :class:`PlanError` if it breaks any rule.

    The one check behind :func:`check` and the multi-workload
    ``check_multi``.

    Parameters
    ----------
    evaluator
        Recomputes the plan's figures and lists its violations
        (:func:`evaluate`, ``evaluate_multi``).
    instance, plan
        Passed to ``evaluator``.

    Returns
    -------
    The evaluation, feasible.

    Raises
    ------
    PlanError
        Listing every violation.
    """
    ev = evaluator(instance, plan)
    if not ev.feasible:
        raise PlanError(list(ev.violations))
    return ev


def certify(evaluator: Callable[[_I, _P], _E], instance: _I, plan: _P) -> _P:
    """``plan`` checked by :func:`checked`, with the evaluation's figures as its metrics.

    The one certification behind :func:`certified` and ``certified_multi``.

    Parameters
    ----------
    evaluator, instance, plan
        As for :func:`checked`.

    Returns
    -------
    The plan with the recomputed figures merged into its ``metrics``.
    """
    return plan.with_metrics(**checked(evaluator, instance, plan).as_metrics())


def check(instance: Instance, plan: Plan) -> Evaluation:
    """Evaluate ``plan`` and raise :class:`PlanError` if it breaks any rule."""
    return checked(evaluate, instance, plan)


def certified(instance: Instance, plan: Plan) -> Plan:
    """``plan`` checked by :func:`check`, with the validator's figures as its metrics."""
    return certify(evaluate, instance, plan)


def infeasibility(instance: Instance) -> str | None:
    """Why no plan at all is feasible, or ``None`` when the paused job is.

    The paused job (no replicas) breaks a rule only when the idle draw of the
    healthy GPUs alone exceeds a rack or site power budget.
    """
    ev = evaluate(instance, Plan(instance.name, ()))
    if ev.feasible:
        return None
    return "no feasible plan, not even the paused job: " + "; ".join(
        v.message for v in ev.violations
    )


def pause_reason(instance: Instance, proven: bool) -> str:
    """Why a planner returned the paused job (no replicas), for :class:`Result`."""
    job = instance.job
    a = instance.arrays
    healthy = a.healthy_in_domain()
    stages = int(sum(int(h) // job.min_tp for h in healthy))
    if stages < job.pp:
        why = (
            f"the healthy GPUs of the domains hold only {stages} stage(s) of degree "
            f">= tp_min={job.min_tp}; a replica needs pp={job.pp}"
        )
    elif job.batch_policy == "fixed" and job.replicas_max * job.local_batch_max < (
        job.global_batch
    ):
        why = (
            f"dp_max={job.replicas_max} replicas of at most {job.local_batch_max} sequences "
            f"cannot carry global_batch={job.global_batch}"
        )
    elif job.batch_policy == "fixed":
        why = (
            f"no set of replicas that fits the cluster and the power budgets carries "
            f"global_batch={job.global_batch} (fixed policy)"
        )
    else:
        why = "no replica fits the cluster and the power budgets"
    return f"paused: {why}" + (" (proven)" if proven else "")
