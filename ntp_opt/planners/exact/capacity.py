"""The capacity program ``C(theta)`` (:func:`build_capacity`): maximise the total
batch at a fixed step time over the domains' configurations
(:func:`~ntp_opt.planners.exact.configs.domain_configs`); and the stages of a
solution (:func:`iter_stages`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ntp_opt.planners.exact.configs import domain_configs
from ntp_opt.planners.exact.model import (
    MAX_CONFIGS,
    WHOLE_UNIT,
    Config,
    ModelTooLarge,
    Prepared,
    StagePick,
    unit_domain,
    unit_fits,
)
from ntp_opt.planners.exact.program import IntProgram, Row
from ntp_opt.rules.power import ceil_mw

__all__ = ["Capacity", "CapacityBuilder", "build_capacity", "iter_stages", "level_floor"]


@dataclass(frozen=True)
class Capacity:
    """The capacity program at one step time and how to read its solution."""

    theta: float
    degrees: tuple[int, ...]
    program: IntProgram
    # variable blocks: (unit indices sharing the variable, domain position in unit, config)
    columns: tuple[tuple[tuple[int, ...], int, Config], ...]
    classes: tuple[tuple[int, int], ...]  # replica class (t, b) of each n variable
    n_offset: int


class CapacityBuilder:
    """Columns and rows of a capacity program, then its common tail.

    Callers add the configuration columns (:meth:`add_column`) and their own
    rows (``rows``: one per domain class or owner, rack budgets); :meth:`finish`
    adds the replica-class variables ``n[t, b]`` with their rows
    (``sum of stages of class (t, b) = pp * n[t, b]``), ``dp_max``,
    ``global_batch`` and the site budget, in that order.

    Parameters
    ----------
    prep
        From :func:`prepare`.
    limit
        Largest number of columns (:class:`ModelTooLarge` beyond), or ``None``.
    """

    def __init__(self, prep: Prepared, limit: int | None = None) -> None:
        self.prep = prep
        self.limit = limit
        self.lb: list[int] = []
        self.ub: list[int] = []
        self.obj: list[int] = []
        self.names: list[str] = []
        self.columns: list[tuple[tuple[int, ...], int, Config]] = []
        self.rows: list[Row] = []
        self.class_terms: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.site_var: list[int] = []
        self.site_coef: list[int] = []

    def add_column(self, units: tuple[int, ...], pos: int, cfg: Config, upper: int) -> int:
        """Add a variable ``0..upper`` counting ``cfg`` on domain ``pos`` of ``units``."""
        j = len(self.lb)
        if self.limit is not None and j >= self.limit:
            raise ModelTooLarge(f"more than {self.limit} domain configurations in all")
        self.lb.append(0)
        self.ub.append(upper)
        self.obj.append(0)
        self.names.append(f"u{units[0]}d{pos}c{j}")
        self.columns.append((units, pos, cfg))
        counts: dict[tuple[int, int], int] = {}
        for st in cfg.stages:
            counts[(st.t, st.b)] = counts.get((st.t, st.b), 0) + 1
        for key, k in counts.items():
            self.class_terms.setdefault(key, []).append((j, k))
        extra = ceil_mw(sum(cfg.extra_w))
        if extra:
            self.site_var.append(j)
            self.site_coef.append(extra)
        return j

    def finish(self, theta: float, degrees: tuple[int, ...]) -> Capacity:
        """The program, with the replica classes, ``dp_max``, ``global_batch`` and site rows."""
        job = self.prep.instance.job
        lb, ub, obj, names, rows = self.lb, self.ub, self.obj, self.names, self.rows
        n_offset = len(lb)
        classes = tuple(sorted(self.class_terms, key=lambda k: (-k[0], -k[1])))
        for t, b in classes:
            lb.append(0)
            ub.append(job.replicas_max)
            obj.append(b)
            names.append(f"n[{t},{b}]")
        for i, key in enumerate(classes):
            column_counts = self.class_terms[key]
            rows.append(
                Row(
                    (*(j for j, _ in column_counts), n_offset + i),
                    (*(k for _, k in column_counts), -job.pp),
                    0,
                    0,
                    f"stages{key}",
                )
            )
        n_vars = tuple(range(n_offset, n_offset + len(classes)))
        if classes:
            rows.append(Row(n_vars, (1,) * len(classes), None, job.replicas_max, "dp_max"))
            rows.append(
                Row(n_vars, tuple(b for _, b in classes), None, job.global_batch, "global_batch")
            )
        if self.site_var:
            room = self.prep.site_budget_mw - ceil_mw(self.prep.site_idle_w)
            rows.append(Row(tuple(self.site_var), tuple(self.site_coef), None, room, "site"))
        program = IntProgram.from_lists(lb, ub, obj, rows, names)
        return Capacity(theta, degrees, program, tuple(self.columns), classes, n_offset)


def level_floor(prep: Prepared, target: int) -> int:
    """The smallest batch level a replica of any plan carrying ``target`` can have.

    A plan with at most ``dp_max`` replicas, each carrying at most
    ``min(M, B)``, whose batches add up to ``target`` or more, has every batch
    at least ``target - (dp_max - 1) min(M, B)``: the others carry the rest.
    So whether ``C(theta) >= target`` is decided by the configurations with
    levels from there on (:func:`build_capacity` with ``min_batch``). At least 1.
    """
    job = prep.instance.job
    cap = min(job.local_batch_max, job.global_batch)
    return max(1, target - (job.replicas_max - 1) * cap)


def build_capacity(
    prep: Prepared,
    theta: float,
    degrees: tuple[int, ...],
    deadline: float | None = None,
    min_batch: int = 1,
) -> Capacity:
    """The integer program ``C(theta)``: maximise ``sum b`` at step time ``theta``.

    With ``min_batch`` (:func:`level_floor`) only replicas carrying at least
    that many sequences are in it: its optimum reaches a target exactly when
    ``C(theta)`` does, and is a lower bound on ``C(theta)`` otherwise.

    Parameters
    ----------
    prep
        From :func:`prepare`.
    theta
        Step time before the resharding overhead factor, in seconds.
    degrees
        TP degrees replicas may use.
    deadline
        :func:`time.perf_counter` value after which :class:`DeadlineReached` is raised.
    min_batch
        The smallest batch level listed.

    Returns
    -------
    Capacity
    """
    out = CapacityBuilder(prep, MAX_CONFIGS)
    rows = out.rows
    for members in prep.classes:
        unit = prep.units[members[0]]
        dom = prep.domains[unit.domains[0]]
        vars_here = []
        for cfg in domain_configs(prep, dom, len(unit.racks), theta, degrees, deadline, min_batch)[
            1:
        ]:
            if unit_fits(unit, cfg.extra_w):
                vars_here.append(out.add_column(members, 0, cfg, len(members)))
        if vars_here:
            rows.append(
                Row(
                    tuple(vars_here),
                    (1,) * len(vars_here),
                    None,
                    len(members),
                    f"class{members[0]}",
                )
            )
    for u in prep.multi:
        unit = prep.units[u]
        rack_terms: list[dict[int, int]] = [dict() for _ in unit.racks]
        for pos, d in enumerate(unit.domains):
            dom = prep.domains[d]
            vars_here = []
            for cfg in domain_configs(
                prep, dom, len(unit.racks), theta, degrees, deadline, min_batch
            )[1:]:
                if not unit_fits(unit, cfg.extra_w):
                    continue
                j = out.add_column((u,), pos, cfg, 1)
                vars_here.append(j)
                for r, x in enumerate(cfg.extra_w):
                    if x:
                        rack_terms[r][j] = ceil_mw(x)
            if vars_here:
                rows.append(Row(tuple(vars_here), (1,) * len(vars_here), None, 1, f"dom{d}"))
        for r, terms in enumerate(rack_terms):
            room = unit.budget_mw[r] - ceil_mw(unit.idle_w[r])
            if terms:
                rows.append(Row(tuple(terms), tuple(terms.values()), None, room, f"rack{r}@{u}"))
    return out.finish(theta, degrees)


def iter_stages(prep: Prepared, cap: Capacity, x: np.ndarray) -> Iterator[StagePick]:
    """Stages of a solution, in domain order (then GPU order)."""
    used_units: dict[tuple[int, int], int] = {}  # (class, domain position) -> units used
    out: list[StagePick] = []
    for j, (units, pos, cfg) in enumerate(cap.columns):
        count = int(x[j])
        for _ in range(count):
            k = used_units.get((units[0], pos), 0)
            used_units[(units[0], pos)] = k + 1
            unit = prep.units[units[k]]
            if pos == WHOLE_UNIT:
                whole = unit_domain(prep, units[k])
                assert whole.domain_of is not None
                for st in cfg.stages:
                    gpus = tuple(int(g) for g in whole.gpus[st.start : st.start + st.t])
                    d = int(whole.domain_of[st.start])
                    out.append(StagePick(st.t, st.b, d, gpus, st.power))
                continue
            dom = prep.domains[unit.domains[pos]]
            for st in cfg.stages:
                block = list(st.pos) if st.pos else slice(st.start, st.start + st.t)
                gpus = tuple(int(g) for g in dom.gpus[block])
                out.append(StagePick(st.t, st.b, dom.index, gpus, st.power))
    out.sort(key=lambda s: (s.domain, s.gpus))
    yield from out
