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
  data_parallel_size`` sequences, a multiple of ``--micro-batch-size``
  (``job.micro_batch``; ``megatron-micro-batch``, checked with it).

Power multipliers are not a restriction: the runtime never sees them, the
site's power manager applies them as per-GPU power limits (``docs/export.md``).

:func:`megatron_compatible` lists the broken restrictions like
:func:`ntp_opt.rules.validate.validate` lists broken rules; :func:`megatron_order`
moves the reduced replicas first; :func:`launch_batch` is the one local batch
of ``n`` replicas; :func:`solve_megatron` is the exact planner behind
``solve(instance, "optimal-megatron")``, which plans under all of these.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.plan import Plan
from ntp_opt.planners.base import Limit, Outcome, RunOptions, stop_limit
from ntp_opt.planners.exact.search import solve_exact
from ntp_opt.planners.heuristics import ntp_pw
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
    "megatron-micro-batch": "the local batch is not a multiple of the job's micro_batch",
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
    :func:`ntp_opt.rules.validate.validate`'s job.

    Parameters
    ----------
    instance
        The instance (its ``job.tp`` is ``tp_base``).
    plan
        The plan.
    uniform_batch
        Also require every replica to take the same local batch, a multiple
        of ``job.micro_batch``.

    Returns
    -------
    list of Violation
        Empty when the plan is expressible; rules are keys of :data:`RULES`.
    """
    if not plan.replicas:
        return [Violation("megatron-empty", "the plan is the paused job: no replica to launch")]
    out = _degree_violations(instance, plan) + _order_violations(instance, plan)
    out += _slot_violations(instance, plan)
    if uniform_batch:
        out += _batch_violations(instance, plan)
    return out


def _degree_violations(instance: Instance, plan: Plan) -> list[Violation]:
    """``megatron-degrees``: more than one reduced degree."""
    big_t = instance.job.tp
    reduced = sorted({r.tp for r in plan.replicas if r.tp != big_t}, reverse=True)
    if len(reduced) <= 1:
        return []
    where = {t: [i for i, r in enumerate(plan.replicas) if r.tp == t][:3] for t in reduced[:4]}
    listed = ", ".join(f"TP{t} (replicas {where[t]})" for t in where)
    return [
        Violation(
            "megatron-degrees",
            f"reduced replicas run at {len(reduced)} TP degrees {reduced}: {listed}; "
            f"the runtime has one tp_spares, so one reduced degree below tp_base={big_t}",
        )
    ]


def _order_violations(instance: Instance, plan: Plan) -> list[Violation]:
    """``megatron-order``: the first reduced replica after a full-TP one."""
    big_t = instance.job.tp
    seen_full = None
    for i, r in enumerate(plan.replicas):
        if r.tp == big_t and seen_full is None:
            seen_full = i
        elif r.tp != big_t and seen_full is not None:
            return [
                Violation(
                    "megatron-order",
                    f"replica {i} (TP{r.tp}) comes after full-TP replica {seen_full}: "
                    "num_reduced_tp_dp_ranks takes the first DP ranks as the reduced ones "
                    "(export with --reorder; from Python, "
                    "ntp_opt.planners.megatron.megatron_order)",
                    replica=i,
                )
            ]
    return []


def _slot_violations(instance: Instance, plan: Plan) -> list[Violation]:
    """``megatron-slots``: a world larger than the cluster's GPUs."""
    big_t = instance.job.tp
    world = len(plan.replicas) * instance.job.pp * big_t
    n_gpus = instance.arrays.n_gpus
    if world <= n_gpus:
        return []
    return [
        Violation(
            "megatron-slots",
            f"the world has {len(plan.replicas)} x pp={instance.job.pp} x "
            f"tp_base={big_t} = {world} ranks but the cluster has {n_gpus} GPUs: every "
            "rank, inactive ones included, needs a GPU slot to be launched on (the "
            "export can add hosts outside the cluster: --placeholder-hosts)",
        )
    ]


def _batch_violations(instance: Instance, plan: Plan) -> list[Violation]:
    """``megatron-batch`` and ``megatron-micro-batch``: one local batch, of micro-batches."""
    out: list[Violation] = []
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
    mbs = instance.job.micro_batch
    off = [b for b in batches if b % mbs]
    if off:
        out.append(
            Violation(
                "megatron-micro-batch",
                f"local batch {off[0]} is not a multiple of the job's micro_batch {mbs}: "
                "Megatron-LM needs global_batch_size divisible by micro-batch size x DP",
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


def launch_batch(job: Job, n: int) -> int | None:
    """The one local batch Megatron-LM runs ``n`` replicas of ``job`` at, or ``None``.

    Megatron gives every DP rank ``global_batch_size / data_parallel_size``
    sequences, and that number must be a multiple of ``--micro-batch-size``
    (``job.micro_batch``). Under ``fixed`` it is ``B / n``, which must divide,
    fit in ``max_local_batch`` and be a multiple of the micro-batch; under
    ``elastic`` it is the largest multiple of the micro-batch not above
    ``min(max_local_batch, B // n)`` (the global batch closest to ``B``).

    Parameters
    ----------
    job
        The job.
    n
        Number of replicas (1 to ``dp_max``).

    Returns
    -------
    int or None
        The local batch, or ``None`` when ``n`` replicas cannot share one.
    """
    if not 1 <= n <= job.replicas_max:
        return None
    mbs = job.micro_batch
    if job.batch_policy == "fixed":
        b, rest = divmod(job.global_batch, n)
        return b if rest == 0 and b <= job.local_batch_max and b % mbs == 0 else None
    b = mbs * (min(job.local_batch_max, job.global_batch // n) // mbs)
    return b if b >= mbs else None


def launch_counts(job: Job) -> list[int]:
    """Every number of replicas that :func:`launch_batch` gives a local batch, ascending.

    Parameters
    ----------
    job
        The job.

    Returns
    -------
    list of int
        Under ``elastic`` ``1 .. min(dp_max, B // micro_batch)`` (none when the
        micro-batch exceeds ``max_local_batch``); under ``fixed`` the divisors
        ``n`` of ``B`` that :func:`launch_batch` accepts.
    """
    if job.batch_policy == "elastic":
        top = min(job.replicas_max, job.global_batch // job.micro_batch)
        return list(range(1, top + 1)) if job.micro_batch <= job.local_batch_max else []
    big_b = job.global_batch
    divisors = set()
    for i in range(1, math.isqrt(big_b) + 1):
        if big_b % i == 0:
            divisors |= {i, big_b // i}
    return sorted(n for n in divisors if launch_batch(job, n) is not None)


def _restricted(instance: Instance, degrees: tuple[int, ...]) -> Instance:
    """``instance`` whose job allows only ``degrees`` (compiled arrays shared)."""
    job = Job(**{**instance.job.model_dump(), "tp_allowed": degrees})
    return instance.with_job(job)


def _one_batch(instance: Instance, degrees: tuple[int, ...], n: int) -> Instance:
    """The derived instance of one local batch: ``degrees`` only, every batch 1.

    With one local batch ``b`` the step time is ``b / min_r v_r`` times the
    resharding factor, so goodput ``n min_r v_r / (1 + rho [...])`` does not
    depend on ``b``, and the power rules do not read batches at all: the best
    plan of ``n`` replicas at one batch is the best plan at batch 1. The
    derived job keeps ``fixed`` (exactly ``n`` replicas) or ``elastic`` (up
    to ``n``) with ``B = n`` and ``max_local_batch = 1``; ``dp``, ``c`` and so
    the goodput units are the instance's own.
    """
    job = Job(
        **{
            **instance.job.model_dump(),
            "tp_allowed": degrees,
            "global_batch": n,
            "max_local_batch": 1,
        }
    )
    return instance.with_job(job)


def _at_batch(plan: Plan, batch: int) -> Plan:
    """``plan`` with every local batch set to ``batch`` (metrics dropped)."""
    return Plan(
        plan.instance, tuple(dataclasses.replace(r, local_batch=batch) for r in plan.replicas)
    )


@dataclasses.dataclass
class _Sub:
    """One sub-search: its degrees, its derived instance and an upper bound on its goodput."""

    degrees: tuple[int, ...]
    instance: Instance
    count: int | None = None  # fixed, one batch: exactly this many replicas
    cap: float = math.inf  # no plan of this sub-search beats it

    def label(self) -> str:
        n = "" if self.count is None else f", {self.count} replicas"
        return f"degrees {list(self.degrees)}{n}"


def _fastest(instance: Instance, degrees: tuple[int, ...]) -> float:
    """Speed no replica of ``degrees`` exceeds: fastest GPU, largest boost, best degree."""
    a = instance.arrays
    job = instance.job
    top = float(a.speed[a.healthy].max()) if a.healthy.any() else 0.0
    f = max(job.tp_factor(t) for t in degrees)
    return f * top * (1.0 + job.max_boost) ** job.power_exponent / job.seq_time_s


def _subs(instance: Instance, one_batch: bool) -> tuple[list[_Sub], list[str]]:
    """The sub-searches of :func:`solve_megatron`, and log lines for the ones left out."""
    job = instance.job
    big_t = job.tp
    cands: list[tuple[int, ...]] = [(t, big_t) for t in reversed(job.allowed) if t < big_t]
    if not cands:
        cands = [(big_t,)]
    if not one_batch:
        return [_Sub(d, _restricted(instance, d)) for d in cands], []
    counts = launch_counts(job)
    if not counts:
        return [], ["no number of replicas takes one local batch: paused"]
    if job.batch_policy == "elastic":
        return [_Sub(d, _one_batch(instance, d, counts[-1])) for d in cands], []
    healthy = instance.arrays.healthy_in_domain()
    subs: list[_Sub] = []
    lines: list[str] = []
    for d in cands:
        # stages of degree >= min(d) a domain can hold: a count above this cannot fit
        fit = int((healthy // min(d)).sum()) // job.pp
        fast = _fastest(instance, d)
        for n in reversed(counts):
            if n > fit:
                lines.append(f"degrees {list(d)}, {n} replicas: at most {fit} fit, skipped")
                continue
            subs.append(_Sub(d, _one_batch(instance, d, n), n, n * fast))
    subs.sort(key=lambda sub: -sub.cap)  # stable: degrees largest first, then counts
    return subs, lines


def solve_megatron(
    instance: Instance,
    options: RunOptions = RunOptions(),
    *,
    backend: str = "cpsat",
    one_batch: bool = True,
) -> Outcome:
    """The best plan Megatron-LM's NTP runtime can run (exact, per reduced degree).

    Every plan the runtime can run has one reduced degree ``t < T``, its
    reduced replicas first and one local batch ``b`` for all replicas
    (:func:`launch_batch`: ``fixed`` ``n b = B``, ``elastic`` ``n b <= B``,
    ``b`` a multiple of ``job.micro_batch`` and at most ``max_local_batch``).
    With one ``b`` goodput is ``n min_r v_r / (1 + rho [...])`` whatever
    ``b`` is, and power does not read batches, so the exact search
    (:func:`ntp_opt.planners.exact.search.solve_exact`) runs on derived
    instances with ``tp_allowed = {t, T}`` and every batch 1, for every
    allowed ``t`` (largest first; each also covers the uniform plan):

    * ``elastic``: one search per ``t`` with up to ``N`` replicas, ``N`` the
      largest count :func:`launch_counts` allows;
    * ``fixed``: one search per ``t`` and admissible count ``n`` (exactly
      ``n`` replicas), largest upper bound ``n x`` (the fastest replica speed)
      first; counts whose bound does not beat the best plan are skipped, and
      so are counts needing more stages than the domains hold.

    The best plan gets ``b = launch_batch(job, n)`` and its reduced replicas
    first. The largest of the searches' bounds (goodput of the instance
    itself: the derived jobs keep ``dp`` and ``c``) is a proven bound, and the
    result is proven optimal when every search is. When no count is
    admissible the job pauses (the empty plan, proven). The
    ``megatron-slots`` restriction is not modelled; a plan breaking it would
    be reported by :func:`megatron_compatible` (it needs a world larger than
    the cluster, which no instance of the library comes near).

    Parameters
    ----------
    instance
        The instance (power boost as its job allows; ``solve`` passes a copy
        with ``max_boost = 0`` for ``optimal-megatron-nopower``).
    options
        ``time_limit``: seconds for all searches together (``None``: no
        limit), each search gets an equal share of what is left; ``threads``,
        ``seed``: passed to the backend; ``initial_plan``: warm start (its
        batches set to 1), used by the searches it fits; ``log``: keep the
        search logs; ``control``: progress reports and cancel token, passed
        to every search (once cancelled, the remaining searches are skipped).
    backend
        Integer-programming backend of the exact search.
    one_batch
        Plan under one local batch (the default). ``False``: the earlier
        planner, one search per reduced degree with free batches (plans may
        need ``--equal-batch`` to export); kept for comparison.

    Returns
    -------
    Outcome
        Its plan has the reduced replicas first; ``stats`` as in
        :func:`ntp_opt.planners.exact.search.solve_exact`.
    """
    start = time.perf_counter()
    subs, lines = _subs(instance, one_batch)
    found = _Found(lines)
    _search_subs(subs, options, backend, one_batch, start, found)
    return _megatron_outcome(instance, subs, found, one_batch)


@dataclasses.dataclass
class _Found:
    """What the sub-searches of :func:`solve_megatron` found so far."""

    lines: list[str]
    best: Outcome | None = None
    best_value: float = 0.0
    bounds: list[float | None] = dataclasses.field(default_factory=list)
    proven: bool = True
    hit: bool = False
    interrupted: bool = False
    evaluations: int = 0

    def record(self, sub: _Sub, out: Outcome) -> None:
        """Count the outcome ``out`` of the search of ``sub``; keep it if it is the best."""
        self.evaluations += int(out.stats["evaluations"])
        self.bounds.append(out.bound)
        self.proven = self.proven and out.proven
        self.hit = self.hit or out.time_limit_hit
        self.lines.append(
            f"{sub.label()}: goodput {out.stats['goodput']:.9g} bound {out.bound} "
            f"proven {out.proven}"
        )
        logger.info("optimal-megatron: %s", self.lines[-1])
        self.lines += [f"  {line}" for line in out.log]
        if self.best is None or out.stats["goodput"] > self.best.stats["goodput"]:
            self.best, self.best_value = out, float(out.stats["goodput"])


def _search_subs(
    subs: list[_Sub],
    options: RunOptions,
    backend: str,
    one_batch: bool,
    start: float,
    found: _Found,
) -> None:
    """Run the exact search of every sub-search in turn (time shared), into ``found``."""
    time_limit, threads, seed = options.time_limit, options.threads, options.seed
    initial_plan, log, control = options.initial_plan, options.log, options.control
    for i, sub in enumerate(subs):
        best, best_value = found.best, found.best_value
        if sub.cap <= best_value:  # no plan of this search beats the best one
            found.bounds.append(sub.cap)
            found.lines.append(f"{sub.label()}: bound {sub.cap:.9g} does not beat {best_value:.9g}")
            continue
        if control.cancelled and best is not None:
            found.interrupted, found.proven = True, False
            break
        share = None
        if time_limit is not None:
            left = time_limit - (time.perf_counter() - start)
            if left <= 0.05:
                found.hit, found.proven = True, False
                found.bounds.append(None)
                found.lines.append(f"{sub.label()}: skipped, time limit reached")
                continue
            share = left / sum(1 for s in subs[i:] if s.cap > best_value)
        out = solve_exact(
            sub.instance,
            RunOptions(
                time_limit=share,
                seed=seed,
                threads=threads,
                initial_plan=_warm(sub, initial_plan, best, one_batch),
                log=log,
                control=control,
            ),
            backend=backend,
            report_bounds=False,  # one search's bound is no bound for all of them
        )
        found.record(sub, out)
        if out.interrupted:
            found.interrupted, found.proven = True, False
            break


def _best_or_paused(instance: Instance, subs: list[_Sub], best: Outcome | None) -> Outcome:
    """``best``, else ``ntp-pw``'s plan (every search skipped), else the paused job."""
    if best is None and subs:  # every search skipped: the time limit was too short
        plan = ntp_pw(subs[0].instance).require_plan()
        if not evaluate(subs[0].instance, plan).feasible:
            plan = Plan(instance.name, ())
        best = Outcome(plan, limit=Limit.TIME, stats={"goodput": 0.0, "evaluations": 0})
    if best is None:  # nothing to search: no count takes one batch
        best = Outcome(Plan(instance.name, ()), stats={"goodput": 0.0, "evaluations": 0})
    return best


def _megatron_outcome(
    instance: Instance, subs: list[_Sub], found: _Found, one_batch: bool
) -> Outcome:
    """The best plan found, at its one batch, reduced replicas first, and the common bound."""
    best = _best_or_paused(instance, subs, found.best)
    bounds = found.bounds
    bound = None
    if all(b is not None for b in bounds) and len(bounds) == len(subs):
        bound = max([b for b in bounds if b is not None] + [best.stats["goodput"]])
    assert best.plan is not None  # every search returns a plan
    plan = best.plan
    if one_batch and plan.replicas:
        batch = launch_batch(instance.job, len(plan.replicas))
        assert batch is not None  # the derived job allows only admissible counts
        plan = _at_batch(plan, batch)
    plan = megatron_order(plan, instance.job.tp).with_metrics(policy="optimal-megatron")
    ev = evaluate(instance, plan)
    plan = plan.with_metrics(**ev.as_metrics())
    proven = found.proven and bound is not None and not math.isinf(bound)
    return Outcome(
        plan=plan,
        bound=bound,
        proven=proven,
        limit=stop_limit(interrupted=found.interrupted, timed_out=found.hit, proven=proven),
        log=tuple(found.lines),
        stats={"goodput": ev.goodput, "evaluations": found.evaluations},
    )


def _warm(sub: _Sub, initial: Plan | None, best: Outcome | None, one_batch: bool) -> Plan | None:
    """The first of ``initial`` and the best plan so far that fits ``sub`` (batches 1)."""
    job = sub.instance.job
    for p in (initial, best.plan if best is not None else None):
        if p is None or not p.replicas or any(r.tp not in sub.degrees for r in p.replicas):
            continue
        if not one_batch:
            return p
        if len(p.replicas) > job.global_batch:
            continue
        if sub.count is not None and len(p.replicas) != sub.count:
            continue
        return _at_batch(p, 1)
    return None
