"""The multi-workload planner: a training job and serving fleets on one cluster.

* :mod:`.configs`: domain classes, their training configurations, serving bins;
* :mod:`.program`: the integer program at one step time and its solution as a plan;
* :mod:`.milp`: :func:`solve_multi`, the search over step times.

The description is :mod:`ntp_opt.model.workloads`, the validator
:mod:`ntp_opt.rules.multi`, the static-partition baseline and the replay
:mod:`ntp_opt.workflows.multi`. See ``docs/workloads.md``.
"""

from ntp_opt.planners.multi.milp import MultiResult, MultiStatus, gpus_by_owner, solve_multi

__all__ = ["MultiResult", "MultiStatus", "gpus_by_owner", "solve_multi"]
