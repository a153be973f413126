"""Pricing for column generation over a domain whose GPUs are chosen exactly.

:class:`~ntp_opt.planners.exact.colgen_pricing.Pricing` searches configurations on
consecutive blocks of a domain's GPUs in fastest-first order; for a domain
chosen exactly (:mod:`ntp_opt.planners.exact.choice`: across racks, mixed
TDP, board limits that disagree with speeds) that misses configurations. This
pricing lists the domain's configurations with the exact choice
(:func:`~ntp_opt.planners.exact.configs.domain_configs`, one per multiset of
stage kinds for a domain alone in its unit, the Pareto-minimal rack draws
otherwise) and prices every one of them: the price of a configuration falls
with each of its draws, so a dropped split never prices higher than a kept
one, and the largest price over the listing is the largest over all
configurations. The pricing stays exact, and so does the column generation's
bound.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ntp_opt.planners.exact.configs import domain_configs, max_level
from ntp_opt.planners.exact.model import MAX_CONFIGS, Config, ModelTooLarge, Prepared, unit_fits
from ntp_opt.rules.power import ceil_mw

__all__ = ["ListedPricing"]


class _Owner(Protocol):
    @property
    def units(self) -> tuple[int, ...]: ...

    @property
    def pos(self) -> int: ...


class ListedPricing:
    """Every configuration of one chosen domain at one step time, priced by a scan.

    The same interface as :class:`~ntp_opt.planners.exact.colgen_pricing.Pricing`
    (``options``, ``n_racks``, :meth:`build`, :meth:`price`, :meth:`enumerate`).

    Parameters
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.
    owner
        The column owner (:class:`~ntp_opt.planners.exact.colgen_pricing.Owner`).
    theta
        Step time before the resharding factor.
    degrees
        TP degrees replicas may use.

    Raises
    ------
    ModelTooLarge
        The domain has more than :data:`~ntp_opt.planners.exact.model.MAX_CONFIGS`
        configurations.
    """

    def __init__(
        self,
        prep: Prepared,
        owner: _Owner,
        theta: float,
        degrees: tuple[int, ...],
        deadline: float | None = None,
    ) -> None:
        self.prep = prep
        self.owner = owner
        self.theta = theta
        self.unit = prep.units[owner.units[0]]
        self.dom = prep.domains[self.unit.domains[owner.pos]]
        self.n_racks = len(self.unit.racks)
        self.h = len(self.dom.gpus)
        listed = domain_configs(prep, self.dom, self.n_racks, theta, degrees, deadline)[1:]
        self.configs = [cfg for cfg in listed if self.fits(cfg.extra_w)]
        job = prep.instance.job
        # the stage kinds domain_configs tries, in its order (as colgen_pricing.stage_options)
        kinds = [
            (t, b)
            for t in degrees
            if 0 < t <= self.h
            for b in range(1, max_level(prep, t, float(self.dom.speed[t - 1]), theta) + 1)
        ]
        self.options = sorted(kinds, key=lambda k: (-k[1] / job.tp_factor(k[0]), -k[0], -k[1]))
        self.index = {kind: j for j, kind in enumerate(self.options)}
        self.by_kinds: dict[tuple[tuple[int, int], ...], Config] = {}
        counts = np.zeros((len(self.configs), len(self.options)))
        for i, cfg in enumerate(self.configs):
            key = tuple((st.t, st.b) for st in cfg.stages)
            self.by_kinds.setdefault(key, cfg)
            for kind in key:
                counts[i, self.index[kind]] += 1
        self.counts = counts
        self.site_mw = np.array([float(ceil_mw(sum(cfg.extra_w))) for cfg in self.configs])
        self.rack_mw = np.array(
            [[float(ceil_mw(x)) if x else 0.0 for x in cfg.extra_w] for cfg in self.configs]
        ).reshape(len(self.configs), self.n_racks)

    def fits(self, extra: tuple[float, ...]) -> bool:
        """Whether a configuration with this extra draw per rack fits the unit's racks."""
        return unit_fits(self.unit, extra)

    def build(self, kinds: tuple[tuple[int, int], ...]) -> Config | None:
        """The listed configuration holding exactly these stage kinds (in listing order),
        or ``None``."""
        return self.by_kinds.get(tuple(kinds))

    def enumerate(self, limit: int = MAX_CONFIGS) -> list[Config]:
        """Every listed configuration."""
        if len(self.configs) > limit:
            raise ModelTooLarge("too many configurations to enumerate")
        return list(self.configs)

    def price(
        self,
        duals: dict[tuple[int, int], float],
        sigma_mw: float,
        rho_mw: tuple[float, ...],
        threshold: float,
        keep: int | None = 4,
        deadline: float | None = None,
        limit: int = MAX_CONFIGS,
    ) -> tuple[float, list[tuple[float, Config]]]:
        """The largest price of any configuration, and the best ones above ``threshold``
        (as :meth:`ntp_opt.planners.exact.colgen_pricing.Pricing.price`)."""
        if not self.configs:
            return 0.0, []
        lam = np.array([duals.get(kind, 0.0) for kind in self.options])
        score = self.counts @ lam
        if sigma_mw > 0:
            score = score - sigma_mw * self.site_mw
        rho = np.array([max(0.0, r) for r in rho_mw])
        if rho.any():
            score = score - self.rack_mw @ rho
        best = max(float(score.max()), 0.0)
        floor = threshold if keep is None else max(threshold, 0.0)
        above = np.flatnonzero(score > floor)
        above = above[np.argsort(-score[above], kind="stable")]
        if keep is None:
            if len(above) > limit:
                raise ModelTooLarge(f"more than {limit} configurations priced above the threshold")
        else:
            above = above[:keep]
        return best, [(float(score[i]), self.configs[i]) for i in above.tolist()]
