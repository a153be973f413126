"""Power limits and power draw, shared by the validator and the planners.

A stage's power multiplier ``pi`` must lie in ``[1, 1 + max_boost]`` and keep
every GPU of the stage within the power limit its board accepts:
``pi * tdp_w <= max_power_w`` (docs/model.md, "Board power limits"). So the
largest multiplier of a stage is the minimum, over its GPUs, of

    cap_g = min(1 + max_boost, max_power_w / tdp_w)

(``max_power_w`` absent: ``cap_g = 1 + max_boost`` exactly, so instances
written before the attribute existed keep their meaning bit for bit). The
per-GPU caps are compiled once per instance
(:attr:`ntp_opt.model.instance.Instance.max_multiplier`).

Draw (docs/model.md, spec section 3): a used GPU draws ``tdp_w * pi``, an unused healthy
GPU ``tdp_w * idle_power_fraction``, a failed GPU nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ntp_opt.model.instance import Instance

__all__ = [
    "can_boost",
    "gpu_draw",
    "largest_cap",
    "rack_and_site_draw",
    "stage_cap",
]


def stage_cap(instance: Instance, gpus: np.ndarray | list[int]) -> float:
    """The largest multiplier a stage on GPUs ``gpus`` (indices) may run at.

    ``1 + max_boost`` for an empty stage.
    """
    idx = np.asarray(gpus, dtype=np.int64)
    if idx.size == 0:
        return 1.0 + instance.job.max_boost
    return float(instance.max_multiplier[idx].min())


def gpu_draw(instance: Instance, power_of: np.ndarray) -> np.ndarray:
    """Watts every GPU draws when GPU ``i`` runs at multiplier ``power_of[i]`` (0 = unused).

    Parameters
    ----------
    instance
        The instance.
    power_of
        Per GPU: its stage's multiplier, or 0 when it is in no stage.

    Returns
    -------
    numpy.ndarray
        ``tdp * power_of`` for used GPUs, ``tdp * idle_power_fraction`` for
        unused healthy ones, 0 for failed ones.
    """
    a = instance.arrays
    idle = instance.job.idle_power_fraction
    draw: np.ndarray = np.where(power_of > 0, power_of, np.where(a.healthy, idle, 0.0)) * a.tdp
    return draw


def rack_and_site_draw(instance: Instance, power_of: np.ndarray) -> tuple[np.ndarray, float]:
    """Watts per rack (rack order) and for the site; see :func:`gpu_draw`."""
    a = instance.arrays
    per_gpu = gpu_draw(instance, power_of)
    rack = np.bincount(a.gpu_rack, weights=per_gpu, minlength=len(a.rack_ids))
    return rack, float(per_gpu.sum())


def can_boost(instance: Instance) -> bool:
    """Can any stage run above multiplier 1 (``alpha > 0`` and some board with headroom)?

    Equal to ``max_boost > 0 and power_exponent > 0`` for every instance
    whose GPUs carry no ``max_power_w``.
    """
    job = instance.job
    if job.max_boost <= 0 or job.power_exponent <= 0:
        return False
    caps = instance.max_multiplier
    return bool(caps.size == 0 or caps.max() > 1.0)


def largest_cap(instance: Instance, healthy_only: bool = True) -> float:
    """The largest multiplier any (healthy) GPU allows; ``1 + max_boost`` if there is none."""
    caps = instance.max_multiplier
    if healthy_only:
        caps = caps[instance.arrays.healthy]
    return float(caps.max()) if caps.size else 1.0 + instance.job.max_boost
