"""What Megatron-LM's nonuniform TP runtime can run, and the best plan it can run.

Megatron-LM's NTP runtime (``megatron/core/distributed/nonuniform_tp.py``,
``NonuniformTPConfig``) is configured by ``tp_base``, one ``tp_spares``,
``num_reduced_tp_dp_ranks`` and ``non_active_ranks_per_dp``. A plan is
*expressible* in it when

* every reduced replica runs at the same degree ``tp_base - tp_spares``
  (``megatron-degrees``),
* the reduced replicas come first in DP order: the runtime treats DP ranks
  ``0 .. num_reduced_tp_dp_ranks - 1`` as the reduced ones
  (``megatron-order``),
* the launcher can give each of the ``dp x pp x tp_base`` ranks of its world
  a GPU slot of its own: every TP group is launched with ``tp_base`` ranks and
  the inactive ones exit after the process groups are built; the slots are
  the healthy GPUs of the cluster (the plan's and the idle ones, on any host)
  and the named placeholder hosts (``megatron-slots`` compares the world with
  the cluster's GPUs; the export counts the slots, ``megatron-placeholders``),
* and every replica takes the same local batch (``megatron-batch``; checked
  when ``uniform_batch=True``, which the export always asks for): Megatron's
  micro-batch calculator gives every DP rank ``global_batch_size /
  data_parallel_size`` sequences.

Power multipliers are not a restriction: the runtime never sees them, the
site's power manager applies them as per-GPU power limits (``docs/export.md``).

:func:`megatron_compatible` lists the broken restrictions like
:func:`ntp_opt.validate.validate` lists broken rules; :func:`megatron_order`
moves the reduced replicas first; :func:`solve_megatron` is the exact planner
behind ``solve(instance, "optimal-megatron")``.
"""

from __future__ import annotations

import logging
import math
import time

from ntp_opt.model.control import Control
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.plan import Plan
from ntp_opt.planners.base import Limit, Outcome
from ntp_opt.planners.exact.search import solve_exact
from ntp_opt.rules.validate import Violation, evaluate

logger = logging.getLogger(__name__)

#: Restriction codes of the Megatron-LM NTP runtime and what each one forbids.
RULES: dict[str, str] = {
    "megatron-empty": "the plan has no replicas: there is nothing to launch",
    "megatron-degrees": "reduced replicas run at more than one TP degree (one tp_spares)",
    "megatron-order": "a reduced replica comes after a full-TP one (reduced DP ranks come first)",
    "megatron-slots": (
        "the dp x pp x tp_base ranks of the world outnumber the cluster's GPUs (the export "
        "counts the slots exactly: healthy GPUs of any host, then named placeholder hosts)"
    ),
    "megatron-batch": "local batches differ: Megatron gives every DP rank the same local batch",
    "megatron-placeholders": (
        "the inactive ranks find too few GPU slots: healthy GPUs no active rank uses "
        "(on any host) plus the named placeholder hosts"
    ),
    "megatron-hosts": "a host name or device index cannot be written to a launcher file",
    "megatron-ids": "a node id cannot be written to the rank file",
}


class MegatronError(ValueError):
    """A plan cannot be run by Megatron-LM's NTP runtime; ``violations`` says why."""

    def __init__(self, violations: list[Violation]):
        self.violations = violations
        head = "; ".join(str(v) for v in violations[:5])
        more = f" (and {len(violations) - 5} more)" if len(violations) > 5 else ""
        super().__init__(f"plan not expressible in Megatron-LM NTP: {head}{more}")


def megatron_compatible(
    instance: Instance, plan: Plan, *, uniform_batch: bool = False
) -> list[Violation]:
    """The restrictions of Megatron-LM's NTP runtime that ``plan`` breaks.

    Only the runtime's restrictions are checked; the model's rules are
    :func:`ntp_opt.validate.validate`'s job.

    Parameters
    ----------
    instance
        The instance (its ``job.tp`` is ``tp_base``).
    plan
        The plan.
    uniform_batch
        Also require every replica to take the same local batch.

    Returns
    -------
    list of Violation
        Empty when the plan is expressible; rules are keys of :data:`RULES`.
    """
    big_t = instance.job.tp
    out: list[Violation] = []
    if not plan.replicas:
        return [Violation("megatron-empty", "the plan is the paused job: no replica to launch")]
    reduced = sorted({r.tp for r in plan.replicas if r.tp != big_t}, reverse=True)
    if len(reduced) > 1:
        where = {t: [i for i, r in enumerate(plan.replicas) if r.tp == t][:3] for t in reduced[:4]}
        listed = ", ".join(f"TP{t} (replicas {where[t]})" for t in where)
        out.append(
            Violation(
                "megatron-degrees",
                f"reduced replicas run at {len(reduced)} TP degrees {reduced}: {listed}; "
                f"the runtime has one tp_spares, so one reduced degree below tp_base={big_t}",
            )
        )
    seen_full = None
    for i, r in enumerate(plan.replicas):
        if r.tp == big_t and seen_full is None:
            seen_full = i
        elif r.tp != big_t and seen_full is not None:
            out.append(
                Violation(
                    "megatron-order",
                    f"replica {i} (TP{r.tp}) comes after full-TP replica {seen_full}: "
                    "num_reduced_tp_dp_ranks takes the first DP ranks as the reduced ones "
                    "(export with --reorder; from Python, ntp_opt.megatron.megatron_order)",
                    replica=i,
                )
            )
            break
    world = len(plan.replicas) * instance.job.pp * big_t
    n_gpus = instance.arrays.n_gpus
    if world > n_gpus:
        out.append(
            Violation(
                "megatron-slots",
                f"the world has {len(plan.replicas)} x pp={instance.job.pp} x "
                f"tp_base={big_t} = {world} ranks but the cluster has {n_gpus} GPUs: every "
                "rank, inactive ones included, needs a GPU slot to be launched on (the "
                "export can add hosts outside the cluster: --placeholder-hosts)",
            )
        )
    if uniform_batch:
        batches = sorted({r.local_batch for r in plan.replicas})
        if len(batches) > 1:
            out.append(
                Violation(
                    "megatron-batch",
                    f"local batches differ ({batches[:4]}): Megatron-LM's micro-batch "
                    "calculator gives every DP rank global_batch_size / data_parallel_size "
                    "sequences (--equal-batch: one local batch for all, power re-balanced)",
                )
            )
    return out


def megatron_order(plan: Plan, tp_base: int) -> Plan:
    """The same plan with its reduced replicas first (stable otherwise).

    Parameters
    ----------
    plan
        The plan.
    tp_base
        The nominal degree ``job.tp``.

    Returns
    -------
    Plan
        Same replicas and metrics, reduced ones (``tp < tp_base``) first.
    """
    replicas = tuple(
        sorted(plan.replicas, key=lambda r: r.tp == tp_base)  # False (reduced) sorts first
    )
    return Plan(plan.instance, replicas, dict(plan.metrics))


def _restricted(instance: Instance, degrees: tuple[int, ...]) -> Instance:
    """``instance`` whose job allows only ``degrees`` (compiled arrays shared)."""
    job = Job(**{**instance.job.model_dump(), "tp_allowed": degrees})
    return instance.with_job(job)


def solve_megatron(
    instance: Instance,
    backend: str = "cpsat",
    *,
    time_limit: float | None = None,
    threads: int = 1,
    seed: int = 0,
    initial_plan: Plan | None = None,
    log: bool = False,
    control: Control | None = None,
) -> Outcome:
    """The best plan Megatron-LM's NTP runtime can run (exact, per reduced degree).

    For every allowed reduced degree ``t < T`` (largest first) the exact
    search (:func:`ntp_opt.milp.search.solve_exact`) runs on the instance
    with ``tp_allowed = {t, T}``; each search also covers the uniform plan
    (degree ``T`` only). The best plan over all ``t`` is returned with its
    reduced replicas first. Any plan the runtime can run has one reduced
    degree, so it is a candidate of one of these searches: the largest of
    their bounds bounds it, and the result is proven optimal when every search
    is. The ``megatron-slots`` restriction is not modelled; a plan breaking it
    would be reported by :func:`megatron_compatible` (it needs a world larger
    than the cluster, which no instance of the library comes near).

    Parameters
    ----------
    instance
        The instance (power boost as its job allows; ``solve`` passes a copy
        with ``max_boost = 0`` for ``optimal-megatron-nopower``).
    backend
        Integer-programming backend of the exact search.
    time_limit
        Seconds for all searches together (``None``: no limit); each search
        gets an equal share of what is left.
    threads, seed
        Passed to the backend.
    initial_plan
        Warm start; used by the searches whose degrees it fits.
    log
        Keep the search logs.
    control
        Progress reports and cancel token, passed to every search; once
        cancelled, the remaining degrees are skipped.

    Returns
    -------
    Outcome
        Its plan has the reduced replicas first; ``stats`` as in
        :func:`ntp_opt.planners.exact.search.solve_exact`.
    """
    start = time.perf_counter()
    job = instance.job
    big_t = job.tp
    cands: list[tuple[int, ...]] = [(t, big_t) for t in reversed(job.allowed) if t < big_t]
    if not cands:
        cands = [(big_t,)]
    best: Outcome | None = None
    bounds: list[float | None] = []
    proven = True
    hit = interrupted = False
    evaluations = 0
    lines: list[str] = []
    for i, degrees in enumerate(cands):
        if control is not None and control.cancelled and best is not None:
            interrupted, proven = True, False
            break
        share = None
        if time_limit is not None:
            left = time_limit - (time.perf_counter() - start)
            if left <= 0.05:
                hit, proven = True, False
                bounds.append(None)
                lines.append(f"degrees {list(degrees)}: skipped, time limit reached")
                continue
            share = left / (len(cands) - i)
        sub = _restricted(instance, degrees)
        warm = [
            p
            for p in (initial_plan, best.plan if best is not None else None)
            if p is not None and p.replicas and all(r.tp in degrees for r in p.replicas)
        ]
        out = solve_exact(
            sub,
            backend,
            time_limit=share,
            threads=threads,
            seed=seed,
            initial_plan=warm[0] if warm else None,
            log=log,
            control=control,
            report_bounds=False,  # one degree's bound is no bound for all of them
        )
        evaluations += int(out.stats["evaluations"])
        bounds.append(out.bound)
        proven = proven and out.proven
        hit = hit or out.time_limit_hit
        lines.append(
            f"degrees {list(degrees)}: goodput {out.stats['goodput']:.9g} bound {out.bound} "
            f"proven {out.proven}"
        )
        logger.info("optimal-megatron: %s", lines[-1])
        lines += [f"  {line}" for line in out.log]
        if best is None or out.stats["goodput"] > best.stats["goodput"]:
            best = out
        if out.interrupted:
            interrupted, proven = True, False
            break
    if best is None:  # every search skipped: the time limit was too short
        from ntp_opt.planners.heuristics import ntp_pw

        plan = ntp_pw(_restricted(instance, cands[0]))
        ev = evaluate(instance, plan)
        best = Outcome(plan, limit=Limit.TIME, stats={"goodput": ev.goodput, "evaluations": 0})
    bound = None
    if bounds and all(b is not None for b in bounds) and len(bounds) == len(cands):
        bound = max(max(b for b in bounds if b is not None), best.stats["goodput"])
    assert best.plan is not None  # every search returns a plan
    plan = megatron_order(best.plan, big_t).with_metrics(policy="optimal-megatron")
    ev = evaluate(instance, plan)
    plan = plan.with_metrics(**ev.as_metrics())
    return Outcome(
        plan=plan,
        bound=bound,
        proven=proven and bound is not None and not math.isinf(bound),
        limit=Limit.INTERRUPTED if interrupted else Limit.TIME if hit else Limit.NONE,
        log=tuple(lines),
        stats={"goodput": ev.goodput, "evaluations": evaluations},
    )
