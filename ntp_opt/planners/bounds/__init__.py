"""Upper bounds on goodput, valid for every plan (used by ``fast``, the exact search
and re-planning).

- :mod:`~ntp_opt.planners.bounds.capacity`: :func:`capacity_bound` and :func:`gpu_bound`
  (every healthy GPU at its best power);
- :mod:`~ntp_opt.planners.bounds.stage`: :func:`stage_bound` (the stage structure
  of each domain and the resharding overhead), its multipliers and re-planning's
  incremental form;
- :mod:`~ntp_opt.planners.bounds.rows`: the domain rows and classes it works on;
- :mod:`~ntp_opt.planners.bounds.case`: the Lagrangian bound of one case;
- :mod:`~ntp_opt.planners.bounds.fixed`: the ``fixed`` batch policy's refinement;
- :mod:`~ntp_opt.planners.bounds.batched`: batched bisection steps and sums.
"""

from ntp_opt.planners.bounds.capacity import capacity_bound, gpu_bound
from ntp_opt.planners.bounds.rows import DomainRows, domain_rows, domain_rows_after
from ntp_opt.planners.bounds.stage import (
    DualPoints,
    FixedSpeeds,
    stage_bound,
    stage_bound_at,
    stage_bound_point,
)

__all__ = [
    "DomainRows",
    "DualPoints",
    "FixedSpeeds",
    "capacity_bound",
    "domain_rows",
    "domain_rows_after",
    "gpu_bound",
    "stage_bound",
    "stage_bound_at",
    "stage_bound_point",
]
