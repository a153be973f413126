"""Heterogeneous workloads sharing one cluster (issue #7, part 3).

* :mod:`.workloads`: :class:`ServingWorkload`, :class:`Workloads`,
  :class:`MultiInstance`, :class:`ServingReplica`, :class:`MultiPlan`;
* :mod:`.validate`: the independent validator and weighted-goodput evaluator;
* :mod:`.milp`: :func:`solve_multi`, the integer-programming planner;
* :mod:`.static`: :func:`solve_static`, the static-partition baseline.

See ``docs/workloads.md``.
"""

from ntp_opt.multi.milp import MultiResult, MultiStatus, solve_multi
from ntp_opt.multi.static import solve_static
from ntp_opt.multi.validate import (
    MULTI_RULES,
    MultiEvaluation,
    check_multi,
    evaluate_multi,
    validate_multi,
)
from ntp_opt.multi.workloads import (
    MultiInstance,
    MultiPlan,
    ServingReplica,
    ServingWorkload,
    Workloads,
)

__all__ = [
    "MULTI_RULES",
    "MultiEvaluation",
    "MultiInstance",
    "MultiPlan",
    "MultiResult",
    "MultiStatus",
    "ServingReplica",
    "ServingWorkload",
    "Workloads",
    "check_multi",
    "evaluate_multi",
    "solve_multi",
    "solve_static",
    "validate_multi",
]
