"""ntp_opt: plan nonuniform tensor-parallel training on clusters with failed GPUs.

The public API:

* :mod:`ntp_opt.topology` builds cluster graphs and marks failures;
* :class:`Job` and :class:`Instance` describe the problem;
* :func:`solve` plans it and returns a :class:`Result`;
* :func:`validate`, :func:`evaluate` and :func:`check` judge any plan;
* :func:`load_instance`, :func:`save_instance`, :func:`load_plan` and
  :func:`save_plan` read and write the JSON formats.
"""

from . import topology
from .files import InputError, load_instance, load_plan, save_instance, save_plan
from .instance import Instance
from .job import Job
from .plan import Plan, Replica, Stage
from .solve import Limit, Result, Status, solve
from .topology import TopologyError
from .validate import Evaluation, PlanError, Violation, check, evaluate, validate

__version__ = "0.1.0"

__all__ = [
    "Evaluation",
    "InputError",
    "Instance",
    "Job",
    "Limit",
    "Plan",
    "PlanError",
    "Replica",
    "Result",
    "Stage",
    "Status",
    "TopologyError",
    "Violation",
    "check",
    "evaluate",
    "load_instance",
    "load_plan",
    "save_instance",
    "save_plan",
    "solve",
    "topology",
    "validate",
]
