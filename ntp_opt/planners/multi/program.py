"""The multi-workload integer program at one step time, and its solution as a plan.

:func:`build_program` writes the program of :mod:`ntp_opt.planners.multi.milp`'s
module doc at a fixed pre-overhead step time ``theta'`` (columns: domains of a
class in a configuration with a way to cut the leftover into serving bins;
training replicas ``n[t, b]`` under Hall's condition; serving replicas
``M[i, t, g]`` packed into bins by the divisibility-chain rows);
:func:`expand` turns a solution into a :class:`~ntp_opt.model.workloads.MultiPlan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.model.workloads import MultiInstance, MultiPlan, ServingReplica, ServingWorkload
from ntp_opt.planners.exact.program import IntProgram, Row
from ntp_opt.planners.multi.configs import Bin, Config, DomainClass, configs, sub_bins
from ntp_opt.rules.goodput import replica_speed, split_batch
from ntp_opt.rules.multi import usable
from ntp_opt.rules.tolerances import FLOAT_NOISE

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

#: A column of a domain class: ``(variable, configuration, serving bins)``, every bin
#: ``(first position, size, speed)`` in the class's fastest-first GPU order.
Column = tuple[int, Config, tuple[Bin, ...]]


@dataclass
class Built:
    """A program and what :func:`expand` needs to read its solution.

    Attributes
    ----------
    program
        The integer program.
    cls_cols
        Per domain class, its columns.
    n_vars
        Training replicas: ``(degree, batch) -> variable``.
    m_vars
        Serving replicas: ``(fleet, degree, speed) -> variable``.
    z_var
        Training on (``fixed`` batch policy), or ``None``.
    value_scale
        Program objective units per unit of weighted goodput.
    slack
        Rounding: the true optimum of this program's model is at most bound + slack.
    """

    program: IntProgram
    cls_cols: list[list[Column]]
    n_vars: dict[tuple[int, int], int]
    m_vars: dict[tuple[int, int, float], int]
    z_var: int | None
    value_scale: float
    slack: float


@dataclass
class _Writer:
    """The program being written: variables, rows, and the terms rows collect."""

    lb: list[int] = field(default_factory=list)
    ub: list[int] = field(default_factory=list)
    obj: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    #: (t, level) -> {x var: count}
    stage_terms: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)
    #: (speed, s) -> {x var: cap}
    bin_terms: dict[tuple[float, int], dict[int, int]] = field(default_factory=dict)

    def var(self, lo: int, hi: int, c: int, name: str) -> int:
        """A new variable in ``[lo, hi]`` with objective coefficient ``c``."""
        self.lb.append(lo)
        self.ub.append(hi)
        self.obj.append(c)
        self.names.append(name)
        return len(self.lb) - 1


@dataclass(frozen=True)
class _Setting:
    """The step time and options one program is written for."""

    multi: MultiInstance
    degrees: tuple[int, ...]
    theta: float
    factor: float
    share_domains: bool
    optimistic: bool
    chain: tuple[int, ...]
    speed_levels: list[float]


def _optimistic_caps(
    st: _Setting, klass: DomainClass, cfg: Config, lo: int, hi: int
) -> tuple[tuple[float, int, int], ...]:
    """Serving room nested by speed: at speed ``>= v``, ``min(#GPUs at speed >= v,
    GPUs training leaves)``, per chain degree ``s`` rounded down to a multiple of ``s``."""
    at_least = [
        max(
            0,
            min(
                hi - lo,
                int(np.sum(klass.speed >= v))
                - sum(
                    t
                    for (t, _, _), need in zip(
                        cfg.stages, cfg.needs or (0.0,) * len(cfg.stages), strict=True
                    )
                    if need >= v
                ),
            ),
        )
        for v in st.speed_levels
    ]
    return tuple(
        (v, s, s * (n // s))
        for v, n in zip(st.speed_levels, at_least, strict=True)
        for s in st.chain
    )


def _class_columns(st: _Setting, w: _Writer, c: int, klass: DomainClass) -> list[Column]:
    """The columns of domain class ``c`` and its row (every domain in one column)."""
    cols: list[Column] = []
    n = len(klass.domains)
    h = len(klass.speed)
    for j, cfg in enumerate(configs(st.multi, klass.speed, st.degrees, st.theta, st.optimistic)):
        lo, hi = cfg.free if (st.share_domains or not cfg.stages) else (h, h)
        seen: set[tuple[tuple[float, int, int], ...]] = set()
        cuts: list[tuple[Bin, ...]] = (
            [()] if st.optimistic else sub_bins(klass.speed, lo, hi, st.chain)
        )
        for q, bins in enumerate(cuts):
            if st.optimistic:
                caps = _optimistic_caps(st, klass, cfg, lo, hi)
            else:
                caps = tuple(
                    sorted((sp, s, s * (size // s)) for _, size, sp in bins for s in st.chain)
                )
            if caps in seen:
                continue  # the same serving room as another cut
            seen.add(caps)
            v = w.var(0, n, 0, f"x[{c},{j},{q}]")
            cols.append((v, cfg, bins))
            for t, b, _ in cfg.stages:
                w.stage_terms.setdefault((t, b), {})
                w.stage_terms[(t, b)][v] = w.stage_terms[(t, b)].get(v, 0) + 1
            for sp, s, k in caps:
                if k:
                    terms = w.bin_terms.setdefault((sp, s), {})
                    terms[v] = terms.get(v, 0) + k
    w.rows.append(Row(tuple(v for v, *_ in cols), (1,) * len(cols), n, n, f"class{c}"))
    return cols


def _replica_rows(multi: MultiInstance, w: _Writer) -> dict[tuple[int, int], int]:
    """Training replicas ``n[t, b]``; Hall's condition per degree and capability level."""
    job = multi.instance.job
    levels: dict[int, list[int]] = {}
    for t, b in w.stage_terms:
        levels.setdefault(t, []).append(b)
    n_vars: dict[tuple[int, int], int] = {}
    for t in sorted(levels):
        for b in sorted(levels[t]):
            n_vars[(t, b)] = w.var(0, job.replicas_max, 0, f"n[{t},{b}]")
        for beta in levels[t]:
            cap: dict[int, int] = {}
            for b2 in levels[t]:
                if b2 >= beta:
                    for v, k in w.stage_terms[(t, b2)].items():
                        cap[v] = cap.get(v, 0) + k
            reps = [n_vars[(t, b2)] for b2 in levels[t] if b2 >= beta]
            w.rows.append(
                Row(
                    (*reps, *cap),
                    (job.pp,) * len(reps) + tuple(-k for k in cap.values()),
                    None,
                    0,
                    f"hall[{t},{beta}]",
                )
            )
    return n_vars


def _batch_rows(
    st: _Setting, w: _Writer, n_vars: dict[tuple[int, int], int]
) -> tuple[int | None, float] | None:
    """The training batch ``Y`` and its objective; ``(z var, rounding slack)``, or ``None``
    when training's minimum share cannot be met."""
    job = st.multi.instance.job
    wl = st.multi.workloads
    big_b = job.global_batch
    need = wl.training_min_relative_goodput
    if not n_vars:
        return None if need > 0 else (None, 0.0)
    nv = tuple(n_vars.values())
    w.rows.append(Row(nv, (1,) * len(nv), None, job.replicas_max, "dp_max"))
    per_seq = wl.training_weight * job.seq_time_s / (job.dp * st.theta * st.factor)
    coef = round(per_seq * WEIGHT_SCALE * UNITS)
    slack = abs(coef - per_seq * WEIGHT_SCALE * UNITS) * big_b / (WEIGHT_SCALE * UNITS)
    y_lo = 0
    if need > 0:
        y_lo = math.ceil(need * job.dp * st.theta * st.factor / job.seq_time_s * (1 - FLOAT_NOISE))
        if y_lo > big_b:
            return None
    y = w.var(y_lo, big_b, coef, "Y")
    w.rows.append(Row((y, *nv), (1, *(-b for _, b in n_vars)), None, 0, "Y <= sum b n"))
    z_var = None
    if job.batch_policy == "fixed":
        z_var = w.var(1 if need > 0 else 0, 1, 0, "z")
        w.rows.append(Row((y, z_var), (1, -big_b), 0, 0, "Y = B z"))
    return z_var, slack


def _fleet_rows(
    st: _Setting,
    w: _Writer,
    i: int,
    fleet: ServingWorkload,
    speeds: list[float],
    m_vars: dict[tuple[int, int, float], int],
) -> float | None:
    """Fleet ``i``'s replicas ``M[i, t, g]`` and served share ``U_i``; the rounding slack,
    or ``None`` when its minimum share cannot be met."""
    total_gpus = st.multi.instance.arrays.n_gpus
    mine: list[int] = []
    units: list[int] = []
    # a replica type counts only if its degree holds the model and it meets the
    # latency target at its bins' speed (types that do not are not formed)
    kinds = [(t, sp) for t in fleet.fitting_degrees for sp in speeds if usable(fleet, t, sp)]
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
    while coarse < UNITS and min(1.0, max(shares, default=0.0)) * UNITS > (MAX_ROW_COEF * coarse):
        coarse *= 10
    fleet_units = UNITS // coarse
    for (t, sp), share in zip(kinds, shares, strict=True):
        v = w.var(0, min(count_cap, total_gpus // t), 0, f"M[{fleet.name},{t},{sp}]")
        m_vars[(i, t, sp)] = v
        mine.append(v)
        units.append(min(fleet_units, math.floor(share * fleet_units)))
    w_int = round(fleet.weight * WEIGHT_SCALE)
    u = w.var(0, fleet_units, w_int * coarse, f"U[{fleet.name}]")
    # floor of each replica's units, and the weight's rounding
    slack = fleet.weight * count_cap / fleet_units + abs(w_int / WEIGHT_SCALE - fleet.weight)
    w.rows.append(Row((u, *mine), (1, *(-k for k in units)), None, 0, f"U<=X[{fleet.name}]"))
    lo_units = math.ceil(fleet.min_fraction * fleet_units)
    if mine:
        w.rows.append(
            Row(
                tuple(mine),
                (1,) * len(mine),
                fleet.min_replicas or None,
                count_cap,
                f"count[{fleet.name}]",
            )
        )
        if lo_units:
            w.rows.append(Row(tuple(mine), tuple(units), lo_units, None, f"min[{fleet.name}]"))
    elif fleet.min_replicas or lo_units:
        return None
    return slack


def _bin_rows(
    st: _Setting, w: _Writer, speeds: list[float], m_vars: dict[tuple[int, int, float], int]
) -> None:
    """Serving replicas of degree ``>= s`` fit the bins' room for chain degree ``s``."""
    for sp in speeds:
        for s in st.chain:
            use = {
                m_vars[(i, t, g)]: t
                for (i, t, g) in m_vars
                if (g >= sp if st.optimistic else g == sp) and t >= s
            }
            room = w.bin_terms.get((sp, s), {})
            if use:
                w.rows.append(
                    Row(
                        (*use, *room),
                        (*use.values(), *(-k for k in room.values())),
                        None,
                        0,
                        f"bins[{sp},{s}]",
                    )
                )


def build_program(
    multi: MultiInstance,
    classes: list[DomainClass],
    degrees: tuple[int, ...],
    theta: float,
    factor: float,
    share_domains: bool,
    optimistic: bool = False,
) -> Built | None:
    """The program at step time ``theta``.

    Parameters
    ----------
    multi
        The instance and its workloads.
    classes
        Its domain classes (:func:`~ntp_opt.planners.multi.configs.domain_classes`).
    degrees
        The training stage degrees (empty: training off).
    theta
        The pre-overhead step time.
    factor
        The step-time factor of these degrees (``1 + reshard_overhead`` when mixed).
    share_domains
        Serving may use the GPUs training leaves inside its domains.
    optimistic
        The relaxation whose optimum bounds every plan when GPU speeds differ
        inside a domain: every stage of degree ``t`` carries what the domain's
        ``t`` fastest GPUs carry (:func:`~ntp_opt.planners.multi.configs.configs`),
        and the serving rows are nested by speed: replicas at speed ``>= v`` fit,
        in every domain, into ``min(#GPUs at speed >= v, GPUs training leaves)``
        (each domain's share of the row for chain degree ``s`` rounded down to a
        multiple of ``s``). Every plan meets these rows, with its own stages and
        replicas at their real speeds.

    Returns
    -------
    Built or None
        ``None`` when a minimum share cannot be met at this step time.
    """
    speed_levels = sorted({float(v) for k in classes for v in k.speed})
    st = _Setting(
        multi,
        degrees,
        theta,
        factor,
        share_domains,
        optimistic,
        multi.workloads.serving_degrees,
        speed_levels,
    )
    w = _Writer()
    cls_cols = [_class_columns(st, w, c, klass) for c, klass in enumerate(classes)]
    n_vars = _replica_rows(multi, w)
    batch = _batch_rows(st, w, n_vars)
    if batch is None:
        return None
    z_var, slack = batch
    m_vars: dict[tuple[int, int, float], int] = {}
    speeds = sorted({sp for (sp, _) in w.bin_terms})
    for i, fleet in enumerate(multi.workloads.serving):
        got = _fleet_rows(st, w, i, fleet, speeds, m_vars)
        if got is None:
            return None
        slack += got
    _bin_rows(st, w, speeds, m_vars)
    program = IntProgram.from_lists(w.lb, w.ub, w.obj, w.rows, w.names)
    return Built(program, cls_cols, n_vars, m_vars, z_var, float(WEIGHT_SCALE * UNITS), slack)


#: Per degree, the training stages the columns placed: ``(capability, domain, GPU indices)``.
_Stages = dict[int, list[tuple[int, int, np.ndarray]]]
#: Per speed, the serving bins the columns placed: ``(domain, free GPU indices)``.
_Bins = dict[float, list[tuple[int, list[int]]]]


def _placed(classes: list[DomainClass], built: Built, x: np.ndarray) -> tuple[_Stages, _Bins]:
    """Give each class's domains, in order, the columns the solution picks."""
    stages: _Stages = {}
    bins: _Bins = {}
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
    return stages, bins


def _training_replicas(
    multi: MultiInstance, stages: _Stages, built: Built, x: np.ndarray
) -> list[tuple[int, list[Stage]]]:
    """The training replicas ``n[t, b]``, each from ``pp`` stages of capability ``>= b``
    (the most capable first)."""
    a = multi.instance.arrays
    job = multi.instance.job
    replicas: list[tuple[int, list[Stage]]] = []
    for t in sorted(stages, reverse=True):
        pool = sorted(stages[t], key=lambda s: -s[0])
        k = 0
        wanted = sorted(((b, v) for (t2, b), v in built.n_vars.items() if t2 == t), reverse=True)
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
    return replicas


def _training_plan(multi: MultiInstance, replicas: list[tuple[int, list[Stage]]]) -> Plan:
    """The training plan of ``replicas``, with the exact batch split."""
    inst = multi.instance
    a = inst.arrays
    job = inst.job
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
        return Plan(inst.name, (), {"policy": "multi"})
    return Plan(
        inst.name,
        tuple(
            Replica(t, int(b), tuple(sts))
            for (t, sts), b in zip(replicas, split.batches, strict=True)
        ),
        {"policy": "multi"},
    )


def _serving_replicas(
    multi: MultiInstance, bins: _Bins, built: Built, x: np.ndarray
) -> list[ServingReplica]:
    """The serving replicas ``M[i, t, g]``, largest first, each in the first bin of its
    speed group with room."""
    a = multi.instance.arrays
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
    return serving


def expand(
    multi: MultiInstance, classes: list[DomainClass], built: Built, x: np.ndarray
) -> MultiPlan:
    """Turn a program solution into a plan (GPU ids, replicas, exact batch split).

    Parameters
    ----------
    multi
        The instance and its workloads.
    classes
        The domain classes the program was built on.
    built
        The program (:func:`build_program`).
    x
        A solution: a value per variable.

    Returns
    -------
    MultiPlan
        Not validated.
    """
    stages, bins = _placed(classes, built, x)
    replicas: list[tuple[int, list[Stage]]] = []
    training_on = built.z_var is None or int(x[built.z_var]) == 1
    if training_on:
        replicas = _training_replicas(multi, stages, built, x)
    training = _training_plan(multi, replicas)
    serving = _serving_replicas(multi, bins, built, x)
    return MultiPlan(training, tuple(serving), {"policy": "multi-milp"})
