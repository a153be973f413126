"""What re-planning starts from and what it returns.

:class:`PlanState` is a running plan with what was checked about it (its
layout, the validator's figures, the bound's multipliers, the chain's memo):
a :class:`~ntp_opt.workflows.replan.Replanner` keeps it from one event to the
next. :class:`Replanned` is the outcome of one re-plan.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan
from ntp_opt.planners.bounds import DomainRows, DualPoints, FixedSpeeds
from ntp_opt.rules.validate import Evaluation, check

__all__ = ["PlanState", "Replanned"]


@dataclass(frozen=True, eq=False)
class PlanState:
    """A running plan and what was checked about it: what re-planning starts from.

    Attributes
    ----------
    instance
        The instance the plan runs on.
    plan
        The plan (feasible for ``instance``).
    layout
        The plan's layout (index space): recourse, re-boosting and the
        re-check of the next event work on it, never on node ids.
    evaluation
        The validator's figures of ``plan`` (feasible).
    points
        The multipliers of the last bound computed in full
        (:func:`ntp_opt.planners.bounds.stage.stage_bound_point`), from which
        the next events' bounds are updated; ``None`` before the first.
    rows
        ``domain_rows(instance)`` (:mod:`ntp_opt.planners.bounds.rows`),
        kept with ``points``: an event recomputes the rows of the domains it
        touches only.
    fixed
        For a ``fixed`` job, the speed bounds of the bound's ``fixed``
        refinement (:data:`~ntp_opt.planners.bounds.stage.FixedSpeeds`), kept
        with ``points``: the incremental bound re-checks them instead of
        searching them; ``None``: the incremental bound leaves the
        refinement out.
    base
        What the next events are applied to: ``instance`` itself, or, when
        its graph is built, a twin sharing its arrays whose graph is built
        only when read (:meth:`~ntp_opt.model.instance.Instance.from_arrays`):
        an event then copies two arrays, not the graph's node table. ``None``:
        ``instance``.
    trays
        Tray id -> index (``instance.arrays.tray_ids``), so that a tray event
        never reads the graph; ``None``: built when needed.
    memo
        What re-boosting keeps from one event to the next (the slow
        replicas' needs, :func:`ntp_opt.rules.boost.boost_stages`; the
        stages' caps and groups, :func:`~ntp_opt.rules.boost.boost_floor_stages`):
        shared by the states of one chain, never changing a result.
    placed
        :attr:`assignment`, when the event that made this state counted its
        moves with it already; ``None``: computed when first read.
    """

    instance: Instance
    plan: Plan
    layout: Layout
    evaluation: Evaluation
    points: DualPoints | None = None
    rows: DomainRows | None = None
    fixed: FixedSpeeds | None = None
    base: Instance | None = None
    trays: Mapping[Hashable, int] | None = None
    memo: dict[Any, Any] | None = None
    placed: np.ndarray | None = None

    @cached_property
    def assignment(self) -> np.ndarray:
        """Per GPU, the plan's ``replica * 65536 + stage`` or -1 (:func:`assignment`),
        computed once: every event re-planned from this state counts moves against it."""
        if self.placed is not None:
            return self.placed
        return self.layout.assignment(self.instance.arrays.n_gpus)

    @classmethod
    def checked(cls, instance: Instance, plan: Plan) -> PlanState:
        """The state of a plan from outside: checked in full by the validator.

        Raises
        ------
        PlanError
            The plan breaks a rule of ``instance``.
        """
        ev = check(instance, plan)
        trays = {t: i for i, t in enumerate(instance.arrays.tray_ids)}
        layout = Layout.from_plan(instance, plan)
        return cls(instance, plan, layout, ev, base=_unbuilt(instance), trays=trays, memo={})


def _unbuilt(instance: Instance) -> Instance:
    """``instance``, or its twin with the graph left unbuilt (``PlanState.base``)."""
    if "cluster" not in vars(instance):
        return instance
    twin = Instance.from_arrays(
        instance.name, instance.arrays, instance.job, instance.meta, lambda: instance.cluster
    )
    vars(twin)["max_multiplier"] = instance.max_multiplier  # the same boards and job
    return twin


@dataclass(frozen=True)
class Replanned:
    """Outcome of :func:`replan`.

    Attributes
    ----------
    instance
        The instance after the events.
    plan
        The new plan (validated against ``instance``).
    choice
        ``"local"``, ``"swap"`` or ``"global"``: which plan was kept.
    moved
        GPUs that migrate (see :func:`migration`).
    goodput, relative_goodput
        Of ``plan``, recomputed by the validator.
    bound
        Proven upper bound on the goodput of any plan for ``instance``:
        :func:`ntp_opt.planners.bounds.stage.stage_bound` (``bound_kind``
        is ``"computed"``), or, re-planning from a :class:`PlanState` that
        carries the multipliers of an earlier full bound, the dual at them
        (:func:`~ntp_opt.planners.bounds.stage.stage_bound_at`:
        ``"incremental"``; valid, used only when it settles the choice,
        which makes it at most ``1 / (1 - tolerance)`` times the full bound,
        and the choice the full bound's up to the bisection's resolution);
        ``inf`` (the
        trivial bound, ``"skipped"``) when it was not computed
        (``bound=False``, or a :class:`Replanner` in ``"local"`` mode).
    local_goodput, global_goodput
        The two candidates (``global_goodput`` is ``None`` when it was not
        needed).
    global_moved
        Migration of the global plan, when computed.
    runtime_s
        Wall-clock seconds, events applied included.
    details
        Goodput and migration of every plan tried, by name.
    bound_kind
        ``"computed"``, ``"incremental"`` or ``"skipped"`` (see ``bound``).
    state
        The new plan's :class:`PlanState` (to re-plan the next event
        without re-checking it: :class:`Replanner`).
    """

    instance: Instance
    plan: Plan
    choice: str
    moved: int
    goodput: float
    relative_goodput: float
    bound: float
    local_goodput: float
    global_goodput: float | None
    global_moved: int | None
    runtime_s: float
    details: dict[str, Any] = field(default_factory=dict)
    bound_kind: str = "computed"
    state: PlanState | None = field(default=None, compare=False, repr=False)

    @property
    def gap(self) -> float:
        """``(bound - goodput) / bound`` (0 when the bound is 0 or was not computed)."""
        if self.bound <= 0 or not math.isfinite(self.bound):
            return 0.0
        return max(0.0, (self.bound - self.goodput) / self.bound)
