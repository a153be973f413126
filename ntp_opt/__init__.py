"""ntp_opt: plan nonuniform tensor-parallel training on clusters with failed GPUs.

The public API:

* :mod:`ntp_opt.topology` builds cluster graphs and marks failures;
* :class:`Job` and :class:`Instance` describe the problem;
* :func:`solve` plans it and returns a :class:`Result`;
* :func:`validate`, :func:`evaluate` and :func:`check` judge any plan;
* :func:`load_instance`, :func:`save_instance`, :func:`load_plan` and
  :func:`save_plan` read and write the JSON formats.
"""

# ``ntp_opt.validate`` is both a function (below) and a compatibility module path; load the
# module first so that importing it later never rebinds the package attribute to the module.
import ntp_opt.validate  # noqa: F401  # isort: skip
from ntp_opt.model import topology
from ntp_opt.model.files import InputError, load_instance, load_plan, save_instance, save_plan
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.model.topology import TopologyError
from ntp_opt.rules.validate import Evaluation, PlanError, Violation, check, evaluate, validate
from ntp_opt.solve import Limit, Result, Status, solve

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
