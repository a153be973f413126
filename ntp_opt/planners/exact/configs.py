"""A domain's configurations at a step time (:func:`domain_configs`): the stages it
can host, each with its TP degree, batch level and power multiplier
(:func:`stage_power`), and its extra draw per rack.

Stages take consecutive blocks of the domain's stage order (fastest first,
:func:`prepare`), or, where that may miss the
optimum, an exact GPU choice (:mod:`ntp_opt.planners.exact.choice`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from ntp_opt.planners.exact.choice import ChoiceDomain, ChoiceTooLarge, choice_configs
from ntp_opt.planners.exact.model import (
    MAX_CONFIGS,
    Config,
    Domain,
    ModelTooLarge,
    Prepared,
    StageChoice,
    check_deadline,
)
from ntp_opt.rules.power import extra_draw
from ntp_opt.rules.tolerances import BUDGET_SLACK, EDGE_SLACK, FLOAT_NOISE

__all__ = ["MAX_BUILT", "domain_configs", "max_level", "stage_power"]

#: Configurations of a chosen domain kept built (:attr:`ChoiceDomain.built`) before the
#: store is emptied.
MAX_BUILT = 50_000


def stage_power(
    prep: Prepared,
    t: int,
    b: int,
    slowest: float,
    theta: float,
    hi: float | None = None,
    factor: float | None = None,
) -> float | None:
    """Smallest power multiplier for a degree-``t`` stage to carry batch ``b`` at ``theta``.

    ``hi`` is the stage's cap (default ``1 + max_boost``: no board limit below
    it). ``factor`` is ``job.tp_factor(t)`` when the caller has it. Returns
    ``None`` when even ``hi`` is not enough.
    """
    job = prep.instance.job
    if factor is None:
        factor = job.tp_factor(t)
    speed_needed = b * job.seq_time_s / (theta * factor * slowest)
    if speed_needed <= 1.0 * (1 + FLOAT_NOISE):
        return 1.0
    alpha = job.power_exponent
    if hi is None:
        hi = 1.0 + job.max_boost
    if alpha <= 0 or job.max_boost <= 0 or hi <= 1.0:
        return None
    pi = speed_needed ** (1.0 / alpha)
    if pi > hi * (1 + BUDGET_SLACK):
        return None
    return min(pi, hi)


def max_level(prep: Prepared, t: int, slowest: float, theta: float) -> int:
    """Largest batch level a degree-``t`` stage whose slowest GPU has speed
    ``slowest`` can carry at ``theta`` (at most ``min(M, B)``; may be 0).

    One above the exact value at most (float slack): :func:`stage_power`
    decides each level.
    """
    job = prep.instance.job
    cap = min(job.local_batch_max, job.global_batch)
    boost = 1.0
    if job.power_exponent > 0 and job.max_boost > 0:
        boost = (1.0 + job.max_boost) ** job.power_exponent
    top = theta * job.tp_factor(t) * slowest * boost / job.seq_time_s
    if not math.isfinite(top) or top >= cap:
        return cap
    return min(cap, math.floor(top * (1 + EDGE_SLACK)) + 1)


def domain_configs(
    prep: Prepared,
    dom: Domain,
    n_racks: int,
    theta: float,
    degrees: tuple[int, ...],
    deadline: float | None = None,
    min_batch: int = 1,
) -> list[Config]:
    """Every configuration of one domain at step time ``theta`` (the empty one first).

    Stages are listed with non-increasing speed requirement ``b / f(t)``, so
    that the most demanding stage takes the fastest block and no multiset of
    stages appears twice. Only the batch levels a stage on the domain's
    fastest block can carry are listed (:func:`max_level`), so the work grows
    with the configurations, not with ``max_local_batch``; and none below
    ``min_batch`` (:func:`level_floor`: a question ``C >= target`` needs no lower one).

    Raises
    ------
    ModelTooLarge
        More than :data:`MAX_CONFIGS` configurations (checked before listing
        them when the single-stage ones alone are too many).
    DeadlineReached
        ``deadline`` (a :func:`time.perf_counter` value) passed.
    """
    options = _level_options(prep, dom, theta, degrees, min_batch)
    grouped = prep.choice.get(dom.index)
    if grouped is not None:  # fastest-first may miss the optimum: exact GPU choice
        return _chosen_configs(prep, dom, grouped, theta, degrees, options, deadline)
    h = len(dom.gpus)
    job = prep.instance.job
    listing = _FastestFirst(
        prep,
        dom,
        n_racks,
        theta,
        options,
        deadline,
        {t: job.tp_factor(t) for t in degrees},
        min((t for t in degrees), default=h + 1),
        [Config((), (0.0,) * n_racks)],
    )
    check_deadline(deadline)
    listing.extend(0, 0, [], np.zeros(n_racks))
    return listing.configs


def _too_many(prep: Prepared, dom: Domain) -> ModelTooLarge:
    """The error for a domain with more than :data:`MAX_CONFIGS` configurations."""
    return ModelTooLarge(
        f"domain {prep.instance.arrays.domain_ids[dom.index]!r} has more than "
        f"{MAX_CONFIGS} stage configurations at this step time"
    )


def _level_options(
    prep: Prepared, dom: Domain, theta: float, degrees: tuple[int, ...], min_batch: int
) -> list[tuple[float, int, int]]:
    """The stage kinds ``(requirement, t, b)`` the domain's fastest block can carry,
    by non-increasing requirement ``b / f(t)`` (then degree, then level)."""
    job = prep.instance.job
    h = len(dom.gpus)
    options: list[tuple[float, int, int]] = []  # (requirement, t, b)
    for t in degrees:
        if t > h or h == 0:
            continue
        top = max_level(prep, t, float(dom.speed[t - 1]), theta)
        if top > MAX_CONFIGS + 1 or len(options) + top > MAX_CONFIGS + len(degrees):
            # each level below the top is a single-stage configuration on the fastest block
            raise _too_many(prep, dom)
        for b in range(max(1, min_batch), top + 1):
            options.append((b / job.tp_factor(t), t, b))
    options.sort(key=lambda o: (-o[0], -o[1], -o[2]))
    return options


def _chosen_configs(
    prep: Prepared,
    dom: Domain,
    grouped: ChoiceDomain,
    theta: float,
    degrees: tuple[int, ...],
    options: list[tuple[float, int, int]],
    deadline: float | None,
) -> list[Config]:
    """The configurations of a domain with an exact GPU choice (choice.py)."""
    unit = next(u for u in prep.units if dom.index in u.domains)
    try:
        listed = choice_configs(
            prep.instance.job,
            grouped,
            unit.idle_w,
            unit.budget_mw,
            theta,
            degrees,
            [(t, b) for _, t, b in options],
            functools.partial(check_deadline, deadline),
            str(prep.instance.arrays.domain_ids[dom.index]),
            MAX_CONFIGS,
        )
    except ChoiceTooLarge as err:
        raise ModelTooLarge(str(err)) from None
    # the same configurations come back at most step times: built once
    built = grouped.built
    if len(built) > MAX_BUILT:
        built.clear()
    out: list[Config] = []
    for item in listed:
        cfg = built.get(item)
        if not isinstance(cfg, Config):
            stages, extra = item
            cfg = Config(
                tuple(StageChoice(t, b, min(pos), pi, pos) for t, b, pi, pos in stages), extra
            )
            built[item] = cfg
        out.append(cfg)
    return out


@dataclass
class _FastestFirst:
    """The configurations of a domain whose stages take consecutive blocks of its
    stage order, listed depth first (:meth:`extend`)."""

    prep: Prepared
    dom: Domain
    n_racks: int
    theta: float
    options: list[tuple[float, int, int]]
    deadline: float | None
    factors: dict[int, float]
    min_t: int
    configs: list[Config]
    # per block (start, t): its cap, its slowest GPU's speed, racks and TDPs
    blocks: dict[tuple[int, int], tuple[float, float, np.ndarray, np.ndarray]] = field(
        default_factory=dict
    )

    def block(self, start: int, t: int) -> tuple[float, float, np.ndarray, np.ndarray]:
        """The block of ``t`` GPUs from ``start``: its cap, slowest speed, racks and TDPs."""
        block = self.blocks.get((start, t))
        if block is None:
            dom = self.dom
            span = slice(start, start + t)
            block = self.blocks[(start, t)] = (
                float(dom.cap[span].min()),
                float(dom.speed[start + t - 1]),
                dom.rack_pos[span],
                dom.tdp[span],
            )
        return block

    def extend(
        self, start: int, first_opt: int, stages: list[StageChoice], extra: np.ndarray
    ) -> None:
        """Every configuration that adds stages from GPU ``start`` on, of option
        ``first_opt`` or a later one, to ``stages`` (drawing ``extra`` per rack)."""
        h = len(self.dom.gpus)
        if start + self.min_t > h:
            return
        idle_frac = self.prep.instance.job.idle_power_fraction
        configs = self.configs
        for oi in range(first_opt, len(self.options)):
            _, t, b = self.options[oi]
            if start + t > h:
                continue
            hi, slowest, racks, tdps = self.block(start, t)
            pi = stage_power(self.prep, t, b, slowest, self.theta, hi, self.factors[t])
            if pi is None:
                continue
            # in GPU order, as np.add.at would add them
            add = np.bincount(
                racks, weights=extra_draw(tdps, pi, idle_frac), minlength=self.n_racks
            )
            new_extra = extra + add
            new_stages = [*stages, StageChoice(t, b, start, pi)]
            configs.append(Config(tuple(new_stages), tuple(new_extra.tolist())))
            if len(configs) % 512 == 0:
                check_deadline(self.deadline)
            if len(configs) > MAX_CONFIGS:
                raise _too_many(self.prep, self.dom)
            self.extend(start + t, oi, new_stages, new_extra)
