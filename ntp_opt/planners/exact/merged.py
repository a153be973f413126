"""A relaxation of the capacity program with multi-domain units merged into
classes (:func:`merged_capacity`): a smaller program whose optimum bounds
``C(theta)`` from above.

It is a relaxation of the capacity program. Take any solution of
:func:`~ntp_opt.planners.exact.capacity.build_capacity`. In every multi-domain
unit, replace each domain's configuration by a kept one that dominates it (one
exists: the dropped ones are dominated by a kept one, by transitivity of
domination); its draws are no larger, so the unit still fits its racks, and
its stage multiset, together with the unit's other domains, forms a listed
rack configuration (or one with the same stages and a smaller site draw);
count those per class. The site draw does not grow. Every stage was replaced
by a stage of the same degree and a level at least as high, or kept, so for
every ``(t, b)`` the stages of level ``>= b`` are at least as many as before,
where they were exactly ``pp n[t, >= b]``. ``n``, ``dp_max``, ``global_batch``
and the objective are unchanged. So the optimum here is at least ``C(theta)``.
(It is in fact equal: a stage may run a lower level at no more power, and
sorting stages by level matches the ``>= b`` rows; only the bound is used.)
"""

from __future__ import annotations

import itertools
import math

from ntp_opt.planners.exact.configs import domain_configs
from ntp_opt.planners.exact.model import Prepared, Unit, check_deadline, unit_fits, unit_key
from ntp_opt.planners.exact.program import IntProgram, Row
from ntp_opt.rules.power import ceil_mw

__all__ = ["MERGED_COMBOS", "MERGED_DOMAIN_CONFIGS", "merged_capacity"]

#: Largest number of rack combinations :func:`merged_capacity` tries per unit class.
MERGED_COMBOS = 200_000
#: Largest number of configurations of one domain :func:`merged_capacity` compares.
MERGED_DOMAIN_CONFIGS = 1_000


def _covers(big: tuple[tuple[int, int], ...], small: tuple[tuple[int, int], ...]) -> bool:
    """Whether every stage of ``small`` can be matched to its own stage of ``big``
    of the same degree and an equal or higher batch level (both sorted by
    decreasing ``(t, b)``: per degree, the i-th highest level of ``small`` is at
    most the i-th highest of ``big``)."""
    for t in {k[0] for k in small}:
        lo = [b for tt, b in small if tt == t]
        hi = [b for tt, b in big if tt == t]
        if len(hi) < len(lo) or any(x > y for x, y in zip(lo, hi, strict=False)):
            return False
    return True


_Option = tuple[tuple[tuple[int, int], ...], tuple[int, ...], int]  # stages, rack and site mW


def _dominates(a: _Option, b: _Option) -> bool:
    """``a`` draws no more than ``b`` in every rack and at the site, and covers its stages."""
    return (
        a[2] <= b[2]
        and all(x <= y for x, y in zip(a[1], b[1], strict=True))
        and _covers(a[0], b[0])
    )


def merged_capacity(
    prep: Prepared,
    theta: float,
    degrees: tuple[int, ...],
    deadline: float | None = None,
) -> IntProgram | None:
    """A smaller integer program whose optimum bounds ``C(theta)`` from above.

    :func:`~ntp_opt.planners.exact.capacity.build_capacity` keeps one binary per
    domain and configuration in units of several domains (NVL8: four DGX nodes
    per rack), so 100 identical racks are 100 copies of the same choice, and
    the branch and bound over them cannot close a gap of a few sequences (4,096 DGX GPUs: 15,568
    variables, open after 40 s). Here:

    * *interchangeable units are merged*: units with equal
      :func:`~ntp_opt.planners.exact.model.unit_key` form a class, a variable
      counts the units of a class that take one *rack configuration* (one
      configuration per domain, every rack within its budget, exactly the rack
      rows of :func:`~ntp_opt.planners.exact.capacity.build_capacity`), up to
      the class size;
    * *stages may serve a lower level*: the rows ``stages of (t, b) = pp n[t, b]``
      become, per degree ``t`` and level ``b``, ``stages of (t, >= b) >= pp
      n[t, >= b]``; a domain configuration whose stages are each matched
      (:func:`_covers`) by a stage of the same degree and an equal or higher
      level of another configuration of the same domain that draws no more in
      every rack and at the site is dropped; rack configurations with the
      same stages keep the smallest site draw. Replicas ``n[t, b]`` are
      listed for every level ``b`` up to the highest one of degree ``t``.

    It is a relaxation of the capacity program (the module docstring proves it).

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

    Returns
    -------
    IntProgram or None
        ``None`` when there is no multi-domain unit, a domain of one has more
        than :data:`MERGED_DOMAIN_CONFIGS` configurations, or a unit class has
        more than :data:`MERGED_COMBOS` rack combinations to try.

    Raises
    ------
    ModelTooLarge
        As :func:`~ntp_opt.planners.exact.configs.domain_configs`.
    """
    if not prep.multi:
        return None
    cols, sizes = _single_columns(prep, theta, degrees, deadline)
    by_key: dict[tuple[object, ...], list[int]] = {}
    for u in prep.multi:
        by_key.setdefault(unit_key(prep, u), []).append(u)
    for units in by_key.values():
        best = _rack_configurations(prep, prep.units[units[0]], theta, degrees, deadline)
        if best is None:
            return None
        for kinds, site in best.items():
            counts: dict[tuple[int, int], int] = {}
            for k in kinds:
                counts[k] = counts.get(k, 0) + 1
            cols.append((len(sizes), counts, site))
        sizes.append(len(units))
    return _merged_program(prep, cols, sizes)


_Column = tuple[int, dict[tuple[int, int], int], int]  # (owner row, stages per kind, site mW)


def _single_columns(
    prep: Prepared, theta: float, degrees: tuple[int, ...], deadline: float | None
) -> tuple[list[_Column], list[int]]:
    """The single-domain unit classes' columns, as in ``build_capacity``, and each
    class's size (one owner row per class)."""
    cols: list[_Column] = []
    sizes: list[int] = []
    for members in prep.classes:  # single-domain units: as in build_capacity
        unit = prep.units[members[0]]
        dom = prep.domains[unit.domains[0]]
        for cfg in domain_configs(prep, dom, len(unit.racks), theta, degrees, deadline)[1:]:
            if unit_fits(unit, cfg.extra_w):
                counts: dict[tuple[int, int], int] = {}
                for st in cfg.stages:
                    counts[(st.t, st.b)] = counts.get((st.t, st.b), 0) + 1
                cols.append((len(sizes), counts, ceil_mw(sum(cfg.extra_w))))
        sizes.append(len(members))
    return cols, sizes


def _kept_options(
    prep: Prepared,
    unit: Unit,
    d: int,
    theta: float,
    degrees: tuple[int, ...],
    deadline: float | None,
) -> list[_Option] | None:
    """Domain ``d``'s configurations that fit its unit, none dominated by another
    (``None``: too many to compare)."""
    kept: list[_Option] = []
    listed = domain_configs(prep, prep.domains[d], len(unit.racks), theta, degrees, deadline)
    if len(listed) > MERGED_DOMAIN_CONFIGS:
        return None  # the pairwise domination test would take too long
    for cfg in listed:
        if cfg.stages and not unit_fits(unit, cfg.extra_w):
            continue  # (an unused domain is always allowed, as in build_capacity)
        kinds = tuple(sorted(((st.t, st.b) for st in cfg.stages), reverse=True))
        draw = tuple(ceil_mw(x) for x in cfg.extra_w)
        opt: _Option = (kinds, draw, ceil_mw(sum(cfg.extra_w)))
        if any(_dominates(k, opt) for k in kept):
            continue
        kept = [k for k in kept if not _dominates(opt, k)] + [opt]
    return kept


def _rack_configurations(
    prep: Prepared,
    unit: Unit,
    theta: float,
    degrees: tuple[int, ...],
    deadline: float | None,
) -> dict[tuple[tuple[int, int], ...], int] | None:
    """A unit's rack configurations: per stage multiset, the smallest site draw of a
    combination of its domains' kept options that fits every rack (``None``: too
    many to try)."""
    rooms = [b - ceil_mw(i) for b, i in zip(unit.budget_mw, unit.idle_w, strict=True)]
    per_domain: list[list[_Option]] = []
    for d in unit.domains:
        kept = _kept_options(prep, unit, d, theta, degrees, deadline)
        if kept is None:
            return None
        per_domain.append(kept)
    if math.prod(len(p) for p in per_domain) > MERGED_COMBOS:
        return None
    best: dict[tuple[tuple[int, int], ...], int] = {}
    for n_combo, combo in enumerate(itertools.product(*per_domain)):
        if n_combo % 4096 == 0:
            check_deadline(deadline)
        if any(sum(o[1][r] for o in combo) > room for r, room in enumerate(rooms)):
            continue
        kinds = tuple(sorted((k for o in combo for k in o[0]), reverse=True))
        site = sum(o[2] for o in combo)
        if kinds and site < best.get(kinds, site + 1):
            best[kinds] = site
    return best


def _merged_program(prep: Prepared, cols: list[_Column], sizes: list[int]) -> IntProgram:
    """The program over the columns: owner rows, replica levels ``n[t, b]`` with their
    ``>= b`` rows, ``dp_max``, ``global_batch`` and the site budget."""
    job = prep.instance.job
    lb: list[int] = []
    ub: list[int] = []
    obj: list[int] = []
    names: list[str] = []
    rows: list[Row] = []
    owner_vars: dict[int, list[int]] = {}
    for j, (owner, _, _) in enumerate(cols):
        lb.append(0)
        ub.append(sizes[owner])
        obj.append(0)
        names.append(f"o{owner}c{j}")
        owner_vars.setdefault(owner, []).append(j)
    for owner, js in owner_vars.items():
        rows.append(Row(tuple(js), (1,) * len(js), None, sizes[owner], f"owner{owner}"))
    # a replica may carry less than its stages could (global_batch): every level
    # up to the highest listed one of its degree
    top: dict[int, int] = {}
    for _, c, _ in cols:
        for t, b in c:
            top[t] = max(top.get(t, 0), b)
    classes = [(t, b) for t in sorted(top, reverse=True) for b in range(top[t], 0, -1)]
    n_offset = len(lb)
    for t, b in classes:
        lb.append(0)
        ub.append(job.replicas_max)
        obj.append(b)
        names.append(f"n[{t},{b}]")
    for t, b in classes:
        rows.append(_level_row(cols, classes, n_offset, t, b, job.pp))
    n_vars = tuple(range(n_offset, n_offset + len(classes)))
    if classes:
        rows.append(Row(n_vars, (1,) * len(classes), None, job.replicas_max, "dp_max"))
        rows.append(
            Row(n_vars, tuple(b for _, b in classes), None, job.global_batch, "global_batch")
        )
    site_terms = [(j, s) for j, (_, _, s) in enumerate(cols) if s]
    if site_terms:
        room = prep.site_budget_mw - ceil_mw(prep.site_idle_w)
        rows.append(
            Row(
                tuple(j for j, _ in site_terms), tuple(s for _, s in site_terms), None, room, "site"
            )
        )
    return IntProgram.from_lists(lb, ub, obj, rows, names)


def _level_row(
    cols: list[_Column],
    classes: list[tuple[int, int]],
    n_offset: int,
    t: int,
    b: int,
    pp: int,
) -> Row:
    """``stages of (t, >= b) >= pp n[t, >= b]``."""
    terms = [
        (j, sum(k for (tt, bb), k in c.items() if tt == t and bb >= b))
        for j, (_, c, _) in enumerate(cols)
    ]
    terms = [(j, k) for j, k in terms if k]
    n_terms = [n_offset + i for i, (tt, bb) in enumerate(classes) if tt == t and bb >= b]
    return Row(
        (*(j for j, _ in terms), *n_terms),
        (*(k for _, k in terms), *(-pp for _ in n_terms)),
        0,
        None,
        f"stages{(t, b)}+",
    )
