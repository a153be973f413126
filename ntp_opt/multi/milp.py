"""The multi-workload planner: an integer program over domain classes.

The training job's pre-overhead step time ``theta'`` is fixed by an outer
enumeration, as in :mod:`ntp_opt.planners.exact.search` (no power boost here, so every
step time where the training capacity can change is one of the finitely many
breakpoints ``b c / (f(t) s)``). At a fixed ``theta'`` every stage of degree
``t`` on a block of GPUs whose slowest has speed ``s`` carries at most
``beta = min(max_local_batch, floor(theta' f(t) s / c))`` sequences, and the
rest is linear:

* every domain class (domains with the same healthy-GPU speed profile) picks,
  for each of its domains, a *configuration*: a multiset of training stage
  degrees, on the domain's fastest GPUs; the GPUs left over form a *bin* for
  serving replicas (``x[c, j]`` counts domains of class ``c`` in config ``j``);
* training replicas ``n[t, b]`` of degree ``t`` and batch ``b`` need ``pp``
  stages of degree ``t`` and capability ``>= b`` each; since capabilities are
  nested this is exactly ``pp * sum_{b >= beta} n[t, b] <= #stages(t, >= beta)``
  for every level ``beta`` (Hall's condition);
* serving replicas ``M[i, t, g]`` of fleet ``i``, degree ``t``, in bins of
  speed group ``g``: when all serving degrees form a divisibility chain
  (1, 2, 4, 8, ...), replicas fit into bins of sizes ``L_k`` exactly when for
  every degree ``s`` of the chain
  ``sum_{t >= s} t M[., t, g] <= sum_k s floor(L_k / s)`` (placing the largest
  first always succeeds), so bins need no individual variables;
* objective: ``w_T (c / R) Y / (theta' (1 + rho [reduced])) + sum_i w_i U_i``
  with ``Y <= sum b n`` the training batch (``Y = B z`` under ``fixed``) and
  ``U_i = min(1, X_i / D_i)``.

Where GPU speeds differ inside a domain (stragglers) these programs restrict
where stages and replicas go, so each step time also gets an *optimistic*
program that admits every plan (:func:`_build`); its bound is the one
reported. ``docs/workloads.md`` states what is exact and what is not.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.multi.validate import MultiEvaluation, check_multi, evaluate_multi
from ntp_opt.multi.workloads import MultiInstance, MultiPlan, ServingReplica
from ntp_opt.planners.base import Status
from ntp_opt.planners.exact.backends import available_backends, solve_program
from ntp_opt.planners.exact.program import IntProgram, Row
from ntp_opt.rules.goodput import replica_speed, split_batch
from ntp_opt.rules.power import exceeds, gpu_draw
from ntp_opt.rules.tolerances import (
    ABS_NOISE,
    BOUND_ABS_SLACK,
    BUDGET_SLACK,
    FLOAT_NOISE,
    REL_TOL,
)

#: Units of a fleet's normalised throughput (1 = its whole demand): each replica's share
#: is rounded down to 1e-8 of the demand.
UNITS = 10**8
#: Largest coefficient of a serving row: HiGHS's integrality tolerance is set from the
#: largest row coefficient, and at its floor (1e-10, coefficients near 1e8) HiGHS's
#: presolve returned a wrong optimum on a small program. A fleet whose replica would
#: count for more than this many units is counted in units 10 or 100 times coarser.
MAX_ROW_COEF = 10**6
#: Scale of weights in the integer objective.
WEIGHT_SCALE = 10**3
#: Largest number of training configurations of one domain class.
MAX_CONFIGS = 5_000


#: What is known about the returned plan: the single-job :class:`Status`
#: (:mod:`ntp_opt.planners.base`), under its old name.
MultiStatus = Status


@dataclass(frozen=True)
class MultiResult:
    """Outcome of :func:`solve_multi`.

    Attributes
    ----------
    status
        :class:`MultiStatus`.
    time_limit_hit
        The time limit stopped the search.
    plan
        The validated plan, or ``None``.
    objective
        Its weighted goodput, recomputed by the validator.
    bound
        Upper bound on the weighted goodput of any plan of this model (see
        ``docs/workloads.md``), or ``None``.
    runtime_s
        Wall-clock seconds.
    programs
        Integer programs solved.
    evaluation
        The validator's :class:`~ntp_opt.multi.validate.MultiEvaluation`.
    reason
        Why there is no plan, or why the result is not proven optimal.
    log
        One line per program solved.
    """

    status: MultiStatus
    time_limit_hit: bool
    plan: MultiPlan | None
    objective: float | None
    bound: float | None
    runtime_s: float
    programs: int
    evaluation: MultiEvaluation | None = None
    reason: str | None = None
    log: tuple[str, ...] = ()

    @property
    def gap(self) -> float | None:
        """Relative gap ``(bound - objective) / bound``, or ``None``."""
        if self.bound is None or self.objective is None:
            return None
        if self.bound <= 0:
            return 0.0
        return max(0.0, (self.bound - self.objective) / self.bound)


@dataclass(frozen=True)
class _Config:
    """Training stages of one domain: ``(degree, capability, first position)``, and
    the positions ``[lo, hi)`` they leave free for serving."""

    stages: tuple[tuple[int, int, int], ...]
    used: int
    free: tuple[int, int]
    #: optimistic configurations: per stage, the slowest speed that still gives its
    #: capability (its GPUs are at least that fast)
    needs: tuple[float, ...] = ()


@dataclass(frozen=True)
class _Class:
    """Domains whose healthy GPUs have the same speeds (each: GPU indices, fastest first)."""

    domains: tuple[int, ...]
    gpus: tuple[np.ndarray, ...]
    speed: np.ndarray


def _classes(multi: MultiInstance) -> list[_Class]:
    a = multi.instance.arrays
    groups: dict[tuple[float, ...], list[tuple[int, np.ndarray]]] = {}
    for d, members in enumerate(a.domain_gpus):
        ok = members[a.healthy[members]]
        if len(ok) == 0:
            continue
        ok = ok[np.argsort(-a.speed[ok], kind="stable")]
        groups.setdefault(tuple(a.speed[ok].tolist()), []).append((d, ok))
    return [
        _Class(tuple(d for d, _ in ms), tuple(g for _, g in ms), np.array(key))
        for key, ms in groups.items()
    ]


def _capability(multi: MultiInstance, t: int, slowest: float, theta: float) -> int:
    job = multi.instance.job
    cap = min(job.local_batch_max, job.global_batch)
    b = math.floor(theta * job.tp_factor(t) * slowest / job.seq_time_s * (1 + FLOAT_NOISE))
    return min(cap, b)


def _configs(
    multi: MultiInstance,
    speed: np.ndarray,
    degrees: tuple[int, ...],
    theta: float,
    optimistic: bool = False,
) -> list[_Config]:
    """Every multiset of training stage degrees the domain holds (empty first).

    Stages sit on the domain's fastest GPUs, largest first; when speeds differ
    inside the domain, each multiset is also listed on its slowest GPUs (the
    fast ones left to serving). ``optimistic`` gives every stage of degree ``t``
    the capability of the domain's ``t`` fastest GPUs (an upper bound on where
    any plan can put it), and lists it with every lower capability the
    domain's speeds give too, each needing GPUs at least as fast as the slowest
    speed giving it (:attr:`_Config.needs`).
    """
    h = len(speed)
    out = [_Config((), 0, (0, h))]
    desc = sorted(degrees, reverse=True)

    def extend(start: int, first: int, stages: list[tuple[int, int, int]]) -> None:
        for k in range(first, len(desc)):
            t = desc[k]
            if start + t > h:
                continue
            slowest = speed[t - 1] if optimistic else speed[start + t - 1]
            b = _capability(multi, t, float(slowest), theta)
            if b < 1:
                continue
            new = [*stages, (t, b, start)]
            out.append(_Config(tuple(new), start + t, (start + t, h)))
            if len(out) > MAX_CONFIGS:
                raise ValueError(
                    f"more than {MAX_CONFIGS} training configurations per domain: "
                    "job.tp_allowed is too fine for the domain size"
                )
            extend(start + t, k, new)

    if degrees:
        extend(0, 0, [])
    if speed[0] == speed[h - 1]:
        return out
    if optimistic:
        return [out[0], *_capability_variants(multi, speed, out[1:], theta)]
    for cfg in out[1:]:
        shift = h - cfg.used
        back = [
            (t, _capability(multi, t, float(speed[first + shift + t - 1]), theta), first + shift)
            for t, _, first in cfg.stages
        ]
        if all(b >= 1 for _, b, _ in back):
            out.append(_Config(tuple(back), cfg.used, (0, shift)))
    return out


def _capability_variants(
    multi: MultiInstance, speed: np.ndarray, configs: list[_Config], theta: float
) -> list[_Config]:
    """Optimistic configurations: each stage at any capability the domain's speeds
    give (up to that of its ``t`` fastest GPUs), with the speeds it needs, as long as
    the domain has enough GPUs at least as fast for all stages together."""
    levels = sorted({float(v) for v in speed})
    at_least = {v: int(np.sum(speed >= v)) for v in levels}
    out: list[_Config] = []
    seen: set[tuple[tuple[int, int, float], ...]] = set()
    for cfg in configs:
        choices = []
        for t, _, _ in cfg.stages:
            caps: dict[int, float] = {}
            for v in levels:  # ascending: the first speed giving a capability is its need
                if v <= speed[t - 1]:
                    b = _capability(multi, t, v, theta)
                    if b >= 1:
                        caps.setdefault(b, v)
            choices.append([(t, b, v) for b, v in caps.items()])
        for pick in itertools.product(*choices):
            key = tuple(sorted(pick))
            if key in seen:
                continue
            if any(sum(t for t, _, v in pick if v >= lv) > at_least[lv] for lv in levels):
                continue
            seen.add(key)
            stages = tuple((t, b, 0) for t, b, _ in key)
            out.append(_Config(stages, cfg.used, cfg.free, tuple(v for _, _, v in key)))
    return out


#: Largest number of speed drops in a domain's leftover GPUs for which the planner
#: tries cutting the leftover into sub-bins of their own speed (more: one bin).
MAX_CUT_RUNS = 4


def _sub_bins(
    speed: np.ndarray, start: int, end: int, chain: tuple[int, ...]
) -> list[tuple[tuple[int, int, float], ...]]:
    """Ways to cut a domain's leftover GPUs ``speed[start:end]`` (fastest first) into
    serving bins ``(first position, size, speed)``, each valued at its slowest GPU.

    One bin valued at the slowest leftover GPU is always a way. Where the
    leftover's speed drops, it may be cut at the drop or a little before it
    (at a multiple of a serving degree from the previous cut), so that replicas
    on the faster GPUs keep their speed (a latency target may depend on it).
    """
    h = end
    if start >= h:
        return [()]
    drops = [e for e in range(start + 1, h) if speed[e] < speed[e - 1]]
    if not drops or len(drops) > MAX_CUT_RUNS:
        return [((start, h - start, float(speed[h - 1])),)]
    out: list[tuple[tuple[int, int, float], ...]] = []

    def cut(k: int, c: int, bins: tuple[tuple[int, int, float], ...]) -> None:
        if k == len(drops):
            out.append((*bins, (c, h - c, float(speed[h - 1]))) if c < h else bins)
            return
        e = drops[k]
        if e <= c:
            cut(k + 1, c, bins)
            return
        for p in sorted({c, e, *(c + s * ((e - c) // s) for s in chain)}):
            cut(k + 1, p, (*bins, (c, p - c, float(speed[p - 1]))) if p > c else bins)

    cut(0, start, ())
    return out


def _check_supported(multi: MultiInstance) -> None:
    """Raise ``ValueError`` on inputs the planner does not model (see the docs)."""
    chain = multi.workloads.serving_degrees
    for lo, hi in itertools.pairwise(chain):
        if hi % lo:
            raise ValueError(
                f"workloads.serving: TP degrees {list(chain)} must form a divisibility chain "
                "(each divides the next, e.g. 1, 2, 4, 8) for the multi-workload planner"
            )
    a = multi.instance.arrays
    full = gpu_draw(multi.instance, a.healthy.astype(float))  # every healthy GPU at TDP
    rack_full = np.bincount(a.gpu_rack, weights=full, minlength=len(a.rack_ids))
    if np.any(exceeds(rack_full, a.rack_budget, tol=BUDGET_SLACK, slack=0.0)) or exceeds(
        full.sum(), a.site_budget, tol=BUDGET_SLACK, slack=0.0
    ):
        raise ValueError(
            "power budgets: the multi-workload planner needs rack and site budgets that "
            "admit every healthy GPU at TDP (the default); it plans without power boost"
        )


#: A column of a domain class: ``(variable, configuration, serving bins)``, every bin
#: ``(first position, size, speed)`` in the class's fastest-first GPU order.
_Column = tuple[int, _Config, tuple[tuple[int, int, float], ...]]


@dataclass
class _Built:
    program: IntProgram
    cls_cols: list[list[_Column]]
    n_vars: dict[tuple[int, int], int]
    m_vars: dict[tuple[int, int, float], int]
    z_var: int | None
    value_scale: float  # program objective units per unit of weighted goodput
    slack: float  # rounding: true optimum of this program's model <= bound + slack


def _build(
    multi: MultiInstance,
    classes: list[_Class],
    degrees: tuple[int, ...],
    theta: float,
    factor: float,
    share_domains: bool,
    optimistic: bool = False,
) -> _Built | None:
    """The program at step time ``theta`` (``degrees`` empty: training off).

    ``optimistic``: the relaxation whose optimum bounds every plan when GPU
    speeds differ inside a domain: every stage of degree ``t`` carries what the
    domain's ``t`` fastest GPUs carry (:func:`_configs`), and the serving rows are
    nested by speed: replicas at speed ``>= v`` fit, in every domain, into
    ``min(#GPUs at speed >= v, GPUs training leaves)`` (each domain's share of the
    row for chain degree ``s`` rounded down to a multiple of ``s``). Every plan
    meets these rows, with its own stages and replicas at their real speeds.
    """
    inst = multi.instance
    job = inst.job
    wl = multi.workloads
    lb: list[int] = []
    ub: list[int] = []
    obj: list[int] = []
    names: list[str] = []
    rows: list[Row] = []

    def var(lo: int, hi: int, c: int, name: str) -> int:
        lb.append(lo)
        ub.append(hi)
        obj.append(c)
        names.append(name)
        return len(lb) - 1

    stage_terms: dict[tuple[int, int], dict[int, int]] = {}  # (t, level) -> {x var: count}
    bin_terms: dict[tuple[float, int], dict[int, int]] = {}  # (speed, s) -> {x var: cap}
    chain = wl.serving_degrees
    cls_cols: list[list[_Column]] = []
    speed_levels = sorted({float(v) for k in classes for v in k.speed})
    for c, klass in enumerate(classes):
        cols: list[_Column] = []
        n = len(klass.domains)
        h = len(klass.speed)
        for j, cfg in enumerate(_configs(multi, klass.speed, degrees, theta, optimistic)):
            lo, hi = cfg.free if (share_domains or not cfg.stages) else (h, h)
            seen: set[tuple[tuple[float, int, int], ...]] = set()
            cuts = [()] if optimistic else _sub_bins(klass.speed, lo, hi, chain)
            for q, bins in enumerate(cuts):
                if optimistic:
                    at_least = [
                        max(
                            0,
                            min(
                                hi - lo,
                                int(np.sum(klass.speed >= v))
                                - sum(
                                    t
                                    for (t, _, _), need in zip(
                                        cfg.stages,
                                        cfg.needs or (0.0,) * len(cfg.stages),
                                        strict=True,
                                    )
                                    if need >= v
                                ),
                            ),
                        )
                        for v in speed_levels
                    ]
                    caps = tuple(
                        (v, s, s * (n // s))
                        for v, n in zip(speed_levels, at_least, strict=True)
                        for s in chain
                    )
                else:
                    caps = tuple(
                        sorted((sp, s, s * (size // s)) for _, size, sp in bins for s in chain)
                    )
                if caps in seen:
                    continue  # the same serving room as another cut
                seen.add(caps)
                v = var(0, n, 0, f"x[{c},{j},{q}]")
                cols.append((v, cfg, bins))
                for t, b, _ in cfg.stages:
                    stage_terms.setdefault((t, b), {})
                    stage_terms[(t, b)][v] = stage_terms[(t, b)].get(v, 0) + 1
                for sp, s, k in caps:
                    if k:
                        terms = bin_terms.setdefault((sp, s), {})
                        terms[v] = terms.get(v, 0) + k
        rows.append(Row(tuple(v for v, *_ in cols), (1,) * len(cols), n, n, f"class{c}"))
        cls_cols.append(cols)
    # training: replicas n[t, b]; Hall's condition per degree and capability level
    levels: dict[int, list[int]] = {}
    for t, b in stage_terms:
        levels.setdefault(t, []).append(b)
    n_vars: dict[tuple[int, int], int] = {}
    for t in sorted(levels):
        for b in sorted(levels[t]):
            n_vars[(t, b)] = var(0, job.replicas_max, 0, f"n[{t},{b}]")
        for beta in levels[t]:
            cap: dict[int, int] = {}
            for b2 in levels[t]:
                if b2 >= beta:
                    for v, k in stage_terms[(t, b2)].items():
                        cap[v] = cap.get(v, 0) + k
            reps = [n_vars[(t, b2)] for b2 in levels[t] if b2 >= beta]
            rows.append(
                Row(
                    (*reps, *cap),
                    (job.pp,) * len(reps) + tuple(-k for k in cap.values()),
                    None,
                    0,
                    f"hall[{t},{beta}]",
                )
            )
    z_var = None
    big_b = job.global_batch
    need = wl.training_min_relative_goodput
    slack = 0.0
    if n_vars:
        nv = tuple(n_vars.values())
        rows.append(Row(nv, (1,) * len(nv), None, job.replicas_max, "dp_max"))
        per_seq = wl.training_weight * job.seq_time_s / (job.dp * theta * factor)
        coef = round(per_seq * WEIGHT_SCALE * UNITS)
        slack += abs(coef - per_seq * WEIGHT_SCALE * UNITS) * big_b / (WEIGHT_SCALE * UNITS)
        y_lo = 0
        if need > 0:
            y_lo = math.ceil(need * job.dp * theta * factor / job.seq_time_s * (1 - FLOAT_NOISE))
            if y_lo > big_b:
                return None
        y = var(y_lo, big_b, coef, "Y")
        rows.append(Row((y, *nv), (1, *(-b for _, b in n_vars)), None, 0, "Y <= sum b n"))
        if job.batch_policy == "fixed":
            z_var = var(1 if need > 0 else 0, 1, 0, "z")
            rows.append(Row((y, z_var), (1, -big_b), 0, 0, "Y = B z"))
    elif need > 0:
        return None
    # serving
    m_vars: dict[tuple[int, int, float], int] = {}
    speeds = sorted({sp for (sp, _) in bin_terms})
    total_gpus = inst.arrays.n_gpus
    for i, fleet in enumerate(wl.serving):
        mine: list[int] = []
        units: list[int] = []
        # a replica type counts only if its degree holds the model and it meets the
        # latency target at its bins' speed (types that do not are not formed)
        kinds = [(t, sp) for t in fleet.fitting_degrees for sp in speeds if fleet.usable(t, sp)]
        # more replicas than this reach the demand with any degree and speed:
        # a plan never needs them (dropping the excess keeps its value)
        slowest = min((fleet.rate(t, sp) for t, sp in kinds), default=1.0)
        count_cap = max(fleet.min_replicas, math.ceil(fleet.demand / slowest))
        if fleet.max_replicas is not None:
            count_cap = min(count_cap, fleet.max_replicas)
        # rounded down (FLOAT_NOISE forgives float noise, well inside the validator's
        # SHARE_TOL); one replica never counts for more than the demand
        shares = [fleet.rate(t, sp) / fleet.demand * (1 + FLOAT_NOISE) for t, sp in kinds]
        coarse = 1  # this fleet's unit: 1 / (UNITS / coarse) of its demand
        while coarse < UNITS and min(1.0, max(shares, default=0.0)) * UNITS > (
            MAX_ROW_COEF * coarse
        ):
            coarse *= 10
        fleet_units = UNITS // coarse
        for (t, sp), share in zip(kinds, shares, strict=True):
            v = var(0, min(count_cap, total_gpus // t), 0, f"M[{fleet.name},{t},{sp}]")
            m_vars[(i, t, sp)] = v
            mine.append(v)
            units.append(min(fleet_units, math.floor(share * fleet_units)))
        w_int = round(fleet.weight * WEIGHT_SCALE)
        u = var(0, fleet_units, w_int * coarse, f"U[{fleet.name}]")
        # floor of each replica's units, and the weight's rounding
        slack += fleet.weight * count_cap / fleet_units + abs(w_int / WEIGHT_SCALE - fleet.weight)
        rows.append(Row((u, *mine), (1, *(-k for k in units)), None, 0, f"U<=X[{fleet.name}]"))
        lo_units = math.ceil(fleet.min_fraction * fleet_units)
        if mine:
            rows.append(
                Row(
                    tuple(mine),
                    (1,) * len(mine),
                    fleet.min_replicas or None,
                    count_cap,
                    f"count[{fleet.name}]",
                )
            )
            if lo_units:
                rows.append(Row(tuple(mine), tuple(units), lo_units, None, f"min[{fleet.name}]"))
        elif fleet.min_replicas or lo_units:
            return None
    for sp in speeds:
        for s in chain:
            use = {
                m_vars[(i, t, g)]: t
                for (i, t, g) in m_vars
                if (g >= sp if optimistic else g == sp) and t >= s
            }
            room = bin_terms.get((sp, s), {})
            if use:
                rows.append(
                    Row(
                        (*use, *room),
                        (*use.values(), *(-k for k in room.values())),
                        None,
                        0,
                        f"bins[{sp},{s}]",
                    )
                )
    program = IntProgram.from_lists(lb, ub, obj, rows, names)
    return _Built(program, cls_cols, n_vars, m_vars, z_var, float(WEIGHT_SCALE * UNITS), slack)


def _expand(multi: MultiInstance, classes: list[_Class], built: _Built, x: np.ndarray) -> MultiPlan:
    """Turn a program solution into a plan (GPU ids, replicas, exact batch split)."""
    inst = multi.instance
    a = inst.arrays
    job = inst.job
    stages: dict[int, list[tuple[int, int, np.ndarray]]] = {}  # t -> (cap, domain, gpus)
    bins: dict[float, list[tuple[int, list[int]]]] = {}
    for klass, cols in zip(classes, built.cls_cols, strict=True):
        pos = 0
        for v, cfg, cut in cols:
            for _ in range(int(x[v])):
                d, gpus = klass.domains[pos], klass.gpus[pos]
                pos += 1
                for t, b, start in cfg.stages:
                    stages.setdefault(t, []).append((b, d, gpus[start : start + t]))
                for first, size, sp in cut:
                    bins.setdefault(sp, []).append(
                        (d, [int(g) for g in gpus[first : first + size]])
                    )
    replicas: list[tuple[int, list[Stage]]] = []
    training_on = built.z_var is None or int(x[built.z_var]) == 1
    if training_on:
        for t in sorted(stages, reverse=True):
            pool = sorted(stages[t], key=lambda s: -s[0])
            k = 0
            wanted = sorted(
                ((b, v) for (t2, b), v in built.n_vars.items() if t2 == t), reverse=True
            )
            for b, v in wanted:
                for _ in range(int(x[v])):
                    members = pool[k : k + job.pp]
                    k += job.pp
                    if len(members) < job.pp or min(m[0] for m in members) < b:
                        raise RuntimeError("training stages do not cover the replicas (bug)")
                    replicas.append(
                        (
                            t,
                            [
                                Stage(a.domain_ids[d], tuple(a.gpu_ids[g] for g in gs), 1.0)
                                for _, d, gs in members
                            ],
                        )
                    )
    speeds = [
        replica_speed(
            job,
            t,
            [min(float(a.speed[a.gpu_index[g]]) for g in st.gpus) for st in sts],
            [1.0] * len(sts),
        )
        for t, sts in replicas
    ]
    split = split_batch(job, speeds, [t for t, _ in replicas])
    if split is None or not replicas:
        training = Plan(inst.name, (), {"policy": "multi"})
    else:
        training = Plan(
            inst.name,
            tuple(
                Replica(t, int(b), tuple(sts))
                for (t, sts), b in zip(replicas, split.batches, strict=True)
            ),
            {"policy": "multi"},
        )
    serving: list[ServingReplica] = []
    fleets = multi.workloads.serving
    for sp, group in bins.items():
        wanted_s = sorted(
            ((t, i, int(x[v])) for (i, t, g), v in built.m_vars.items() if g == sp),
            key=lambda r: (-r[0], r[1]),
        )
        for t, i, count in wanted_s:
            for _ in range(count):
                for d, free in group:
                    if len(free) >= t:
                        gs, free[:] = free[:t], free[t:]
                        serving.append(
                            ServingReplica(
                                fleets[i].name,
                                t,
                                a.domain_ids[d],
                                tuple(a.gpu_ids[g] for g in gs),
                            )
                        )
                        break
                else:
                    raise RuntimeError("serving replicas do not fit their bins (bug)")
    return MultiPlan(training, tuple(serving), {"policy": "multi-milp"})


def _candidates(multi: MultiInstance, degrees: tuple[int, ...]) -> list[tuple[int, float]]:
    """Step times where the training capacity can change: ``(priority, theta')``.

    Priority 0 for those a stage on the fastest GPUs reaches (searched first:
    they are the likely optimum), 1 for those only slower GPUs reach.
    """
    job = multi.instance.job
    a = multi.instance.arrays
    cap = min(job.local_batch_max, job.global_batch)
    speeds = sorted({float(s) for s in a.speed[a.healthy].tolist()}, reverse=True)
    if not speeds or not degrees:
        return []
    lo = 0.0
    if job.batch_policy == "fixed":
        # some replica carries at least ceil(B / dp_max) sequences
        need = math.ceil(job.global_batch / max(1, job.replicas_max))
        lo = need * job.seq_time_s / (max(job.tp_factor(t) for t in degrees) * speeds[0])
    out: dict[float, int] = {}
    for rank, sp in enumerate(speeds):
        for t in degrees:
            for b in range(1, cap + 1):
                theta = b * job.seq_time_s / (job.tp_factor(t) * sp)
                if theta >= lo * (1 - FLOAT_NOISE) and theta not in out:
                    out[theta] = min(rank, 1)
    return sorted((p, th) for th, p in out.items())


def solve_multi(
    multi: MultiInstance,
    *,
    time_limit: float | None = 60.0,
    seed: int = 0,
    threads: int = 1,
    backend: str = "highs",
    share_domains: bool = True,
) -> MultiResult:
    """Plan every workload together, maximising weighted goodput.

    Parameters
    ----------
    multi
        The instance and its workloads.
    time_limit
        Seconds for the whole search (``None``: none; tests always set one).
    seed, threads
        Passed to the backend (one thread: deterministic).
    backend
        Integer-programming backend: ``"highs"`` (default), ``"cpsat"`` or
        ``"cbc"``. CP-SAT finds good solutions but can stall proving them
        optimal on the serving-throughput rows, whose coefficients are large
        (``docs/workloads.md``); HiGHS's LP bound closes them at once.
    share_domains
        Let serving replicas use the GPUs that training leaves idle inside its
        domains (default). ``False`` splits whole domains only (an ablation).

    Returns
    -------
    MultiResult
        Its plan, if any, has passed :func:`~ntp_opt.multi.validate.check_multi`.

    Raises
    ------
    ValueError
        On inputs the planner does not model: serving degrees that are not a
        divisibility chain, or power budgets below the healthy GPUs' TDP.
    """
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be positive, got {time_limit!r}")
    _check_supported(multi)
    start = time.perf_counter()
    deadline = None if time_limit is None else start + time_limit
    classes = _classes(multi)
    a = multi.instance.arrays
    exact = len({float(s) for s in a.speed[a.healthy].tolist()}) <= 1
    log: list[str] = []
    found = _search(multi, classes, deadline, seed, threads, backend, share_domains, log, exact)
    best = found.best
    if best is None:
        if found.infeasible_all and not found.timed_out:
            status, why = MultiStatus.INFEASIBLE, "minimum shares cannot all be met"
        elif found.timed_out:
            status, why = MultiStatus.NO_SOLUTION, "time limit"
        else:
            status = MultiStatus.NO_SOLUTION
            why = "stragglers: no plan found where the programs place stages and replicas"
        return MultiResult(
            status,
            found.timed_out,
            None,
            None,
            None,
            time.perf_counter() - start,
            found.programs,
            reason=why,
            log=tuple(log),
        )
    plan, _ = best
    ev = check_multi(multi, plan)  # never trust the planner
    value = ev.weighted_goodput
    bound, timed_out = found.bound, found.timed_out
    # optimal up to the model's rounding (serving throughput in 1e-8 of demand)
    proven = (
        (not timed_out)
        and (not found.unproven)
        and bound <= value * (1 + REL_TOL) + found.resolution + BOUND_ABS_SLACK
    )
    reason: str | None = None
    if not exact and not proven:
        reason = "stragglers: bound from the optimistic programs (docs/workloads.md)"
    if timed_out:
        reason = "time limit"
    final_bound = None if math.isinf(bound) else max(bound, value)
    plan = plan.with_metrics(
        **ev.as_metrics(), **({"bound": final_bound} if final_bound is not None else {})
    )
    return MultiResult(
        MultiStatus.OPTIMAL if proven else MultiStatus.FEASIBLE,
        timed_out,
        plan,
        value,
        final_bound,
        time.perf_counter() - start,
        found.programs,
        evaluation=ev,
        reason=reason,
        log=tuple(log),
    )


def _training_cap(
    multi: MultiInstance, classes: list[_Class], degrees: tuple[int, ...], theta: float
) -> int:
    """An upper bound on the training sequences any plan carries at step time ``theta``.

    A replica carrying ``b`` sequences has ``pp`` stages of capability ``>= b``
    each, so ``Y = sum_beta #{replicas carrying >= beta}`` and that count is at most
    ``dp_max`` and ``S(beta) / pp``, ``S(beta)`` the stages of capability ``>= beta``
    the domains can hold: a domain of ``h`` healthy GPUs holds at most ``h // t``
    stages of degree ``t``, none faster than its ``t`` fastest GPUs.
    """
    job = multi.instance.job
    top = min(job.local_batch_max, job.global_batch)
    most = np.zeros(top + 2, dtype=np.int64)
    for klass in classes:
        h = len(klass.speed)
        per = np.zeros(top + 2, dtype=np.int64)
        for t in degrees:
            if t <= h:
                b = _capability(multi, t, float(klass.speed[t - 1]), theta)
                if b >= 1:
                    per[1 : b + 1] = np.maximum(per[1 : b + 1], h // t)
        most += per * len(klass.domains)
    levels = np.minimum(job.replicas_max, most[1 : top + 1] // job.pp)
    return int(levels.sum())


@dataclass
class _Search:
    """What one walk over the step times found."""

    best: tuple[MultiPlan, MultiEvaluation] | None = None
    bound: float = 0.0  # on every plan (pruned step times: on the incumbent)
    timed_out: bool = False
    infeasible_all: bool = True  # every bounding program was infeasible
    unproven: bool = False  # some bounding program stopped without a proof
    programs: int = 0
    resolution: float = 0.0  # largest rounding slack of a program solved


def _search(
    multi: MultiInstance,
    classes: list[_Class],
    deadline: float | None,
    seed: int,
    threads: int,
    backend: str,
    share_domains: bool,
    log: list[str],
    exact: bool,
) -> _Search:
    """Solve the programs at every candidate step time, best first, skipping those
    whose bound cannot beat the best plan.

    ``exact`` (every healthy GPU at one speed): the programs' bounds hold for every
    plan. Otherwise a step time's program finds plans only, and its optimistic
    program (see :func:`_build`), whose bound holds for every plan, is solved after
    it unless a plan already reaches the step time's upper bound.
    """
    job = multi.instance.job
    wl = multi.workloads
    out = _Search()

    def run(
        degrees: tuple[int, ...], theta: float, factor: float, optimistic: bool
    ) -> float | None:
        """Solve one program; return its bound in weighted-goodput units (None: timed out)."""
        bounding = optimistic or exact
        built = _build(multi, classes, degrees, theta, factor, share_domains, optimistic)
        if built is None:
            return 0.0
        out.resolution = max(out.resolution, built.slack)
        remaining = None
        if deadline is not None:
            remaining = deadline - time.perf_counter()
            if remaining <= 0.01:
                out.timed_out = True
                return None
        try:
            sol = solve_program(
                built.program, backend, time_limit=remaining, threads=threads, seed=seed
            )
        except RuntimeError as err:  # the solver's own failure on a sound program
            other = next((b for b in available_backends() if b != backend), None)
            if other is None:
                raise
            log.append(f"{backend} failed ({err}): solved by {other}")
            sol = solve_program(
                built.program, other, time_limit=remaining, threads=threads, seed=seed
            )
        out.programs += 1
        log.append(
            f"{'optimistic ' if optimistic else ''}degrees={list(degrees)} theta'={theta:.9g} "
            f"vars={built.program.n_vars} status={sol.status} obj={sol.objective} "
            f"{sol.runtime_s:.3f}s"
        )
        if sol.status == "infeasible":
            return 0.0
        if bounding:
            out.infeasible_all = False
        if sol.x is not None and not optimistic:
            plan = _expand(multi, classes, built, sol.x)
            ev = evaluate_multi(multi, plan)
            if not ev.feasible:
                raise RuntimeError(f"multi-workload plan broke rules (bug): {ev.violations[:3]}")
            if out.best is None or ev.weighted_goodput > out.best[1].weighted_goodput:
                out.best = (plan, ev)
        if sol.status != "optimal":
            if bounding:
                out.unproven = True
            if sol.time_limit_hit:
                out.timed_out = True
        if sol.bound is None:
            return math.inf
        return sol.bound / built.value_scale + built.slack

    def incumbent() -> float:
        return out.best[1].weighted_goodput if out.best is not None else -math.inf

    def reached(ub: float) -> bool:
        """Whether the best plan is within the tolerance of ``ub``."""
        return ub <= incumbent() * (1 + REL_TOL) + ABS_NOISE

    # training off: serving alone; it bounds the serving part of every program, and so
    # does serving every fleet's whole demand
    serving_max = sum(f.weight for f in wl.serving)
    serving_alone = run((), 1.0, 1.0, False)
    if not exact and not out.timed_out:
        serving_alone = serving_max if reached(serving_max) else run((), 1.0, 1.0, True)
    if serving_alone is not None:
        serving_alone = min(serving_alone, serving_max)
        out.bound = max(out.bound, serving_alone)
    cases: list[tuple[tuple[int, ...], float]] = [((job.tp,), 1.0)]
    if len(job.allowed) > 1:
        cases.append((job.allowed, 1.0 + job.reshard_overhead))
    cap_b = min(job.global_batch, job.replicas_max * job.local_batch_max)
    todo = sorted(
        (prio, theta, degrees, factor)
        for degrees, factor in cases
        for prio, theta in _candidates(multi, degrees)
    )
    rest = serving_alone if serving_alone is not None else math.inf
    per_seq = wl.training_weight * job.seq_time_s / job.dp
    for _, theta, degrees, factor in todo:
        if reached(per_seq * cap_b / (theta * factor) + rest):
            continue  # cannot beat the best plan: the serving part is at most serving_alone
        seqs = min(cap_b, _training_cap(multi, classes, degrees, theta))
        if job.batch_policy == "fixed" and seqs < job.global_batch:
            continue  # training cannot run: every plan here is one of serving alone
        ub_here = per_seq * seqs / (theta * factor) + rest
        if reached(ub_here):
            continue
        got = None if out.timed_out else run(degrees, theta, factor, False)
        if not exact and got is not None:
            # that program's bound holds for its placements only; the optimistic
            # program's holds for every plan (not needed once a plan reaches ub_here)
            got = None if out.timed_out else ub_here
            if not reached(ub_here) and not out.timed_out:
                got = run(degrees, theta, factor, True)
        # a program not solved is bounded by ub_here
        out.bound = max(out.bound, ub_here if got is None else min(got, ub_here))
    return out


def gpus_by_owner(plan: MultiPlan) -> dict[str, int]:
    """GPUs used per workload (``"training"`` and every fleet with replicas)."""
    out: dict[str, int] = {"training": sum(1 for _ in plan.training.used_gpus())}
    for rep in plan.serving:
        out[rep.workload] = out.get(rep.workload, 0) + len(rep.gpus)
    return out
