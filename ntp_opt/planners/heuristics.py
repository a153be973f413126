"""Baseline planners of docs/model.md, spec section 5: ``dp-drop``, ``ntp`` and ``ntp-pw``.

All three cut every domain into *slots* (candidate stages), pack the slots
into replicas and split the batch exactly (the packing core is
:mod:`ntp_opt.planners.packing`):

* a domain with ``h`` healthy GPUs gives ``h // T`` full slots of its fastest
  GPUs; ``ntp`` and ``ntp-pw`` add one reduced slot of the largest allowed
  degree that the remaining healthy GPUs can run (``dp-drop`` leaves them idle);
* slots are sorted by degree, then speed, and grouped ``pp`` at a time into
  at most ``dp_max`` replicas: partially failed domains end up packed into as
  few replicas as possible and the worst slots become spares, which is the
  paper's "swap in spare domains" and "pack failed domains together";
* a replica runs at the smallest degree among its slots, on the fastest GPUs;
* ``ntp-pw`` then boosts the power of slow replicas' stages, cheapest first,
  as far as rack and site budgets allow (targeting nominal speed, or the best
  speed of a stage that cannot reach it), instead of relying on a smaller
  local batch; after the batch split, every stage is lowered back to what the
  split uses (:func:`~ntp_opt.planners.packing.trim_packed`: the same goodput,
  less power);
* local batches come from :func:`ntp_opt.rules.goodput.split_batch` (exact). Under
  the ``fixed`` policy a plan that cannot carry ``B`` pauses (no replicas).

Stragglers are not avoided on purpose: the paper's heuristic ignores them.
Each is a planner (``(instance, options) -> Outcome``, the plan not yet
checked: :func:`ntp_opt.solve.solve` checks it, or call
:func:`ntp_opt.rules.validate.certified`); the options are not read (the
baselines run to the end, deterministically).
"""

from __future__ import annotations

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Replica
from ntp_opt.planners.base import Outcome, RunOptions
from ntp_opt.planners.packing import (
    boost_slowest_packed,
    domain_slot_table,
    fit_packing,
    pack,
    packing_replicas,
    split_packing,
    trim_packed,
)


def _plan(instance: Instance, policy: str, reduced: bool, boost: bool) -> Outcome:
    """Cut, pack, fit the budgets, (boost,) split the batch: the plan, unchecked."""
    packed = pack(instance, domain_slot_table(instance, reduced))
    packed = fit_packing(instance, packed)
    shape = packed.members.shape
    powers = boost_slowest_packed(instance, packed) if boost else np.ones(shape)
    split = split_packing(instance, packed, powers)
    replicas: tuple[Replica, ...] = ()
    if split is not None:
        powers = trim_packed(instance, packed, powers, split)
        replicas = packing_replicas(instance, packed, powers, split.batches)
    return Outcome(Plan(instance.name, replicas, {"policy": policy, "paused": not replicas}))


def dp_drop(instance: Instance, options: RunOptions = RunOptions()) -> Outcome:
    """Uniform TP: only full-degree stages; spare domains swapped in.

    Parameters
    ----------
    instance
        The instance.
    options
        Not read (the planner runs to the end).

    Returns
    -------
    Outcome
        Its plan (empty when the job pauses), not yet checked.
    """
    return _plan(instance, "dp-drop", reduced=False, boost=False)


def ntp(instance: Instance, options: RunOptions = RunOptions()) -> Outcome:
    """The paper's NTP: reduced-degree replicas with a smaller local batch.

    Parameters and result as :func:`dp_drop`.
    """
    return _plan(instance, "ntp", reduced=True, boost=False)


def ntp_pw(instance: Instance, options: RunOptions = RunOptions()) -> Outcome:
    """NTP with power boost of slow replicas within rack and site budgets.

    Parameters and result as :func:`dp_drop`.
    """
    return _plan(instance, "ntp-pw", reduced=True, boost=True)
