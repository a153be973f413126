"""ntp_opt: plan nonuniform tensor-parallel training on clusters with failed GPUs.

The public API:

* :mod:`ntp_opt.topology` builds cluster graphs and marks failures;
* :class:`Job` and :class:`Instance` describe the problem;
* :func:`solve` plans it and returns a :class:`Result`;
* :func:`validate`, :func:`evaluate` and :func:`check` judge any plan;
* :func:`load_instance`, :func:`save_instance`, :func:`load_plan` and
  :func:`save_plan` read and write the JSON formats.

The names are imported on first use (PEP 562), so that ``import ntp_opt``, and
a command that needs one layer (``ntp-opt solve --policy fast``), does not
import every layer.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: Where each public name lives: name -> module (the name itself is read from it).
_SOURCES: dict[str, str] = {
    "InputError": "ntp_opt.model.files",
    "load_instance": "ntp_opt.model.files",
    "load_plan": "ntp_opt.model.files",
    "save_instance": "ntp_opt.model.files",
    "save_plan": "ntp_opt.model.files",
    "Instance": "ntp_opt.model.instance",
    "Job": "ntp_opt.model.job",
    "Plan": "ntp_opt.model.plan",
    "Replica": "ntp_opt.model.plan",
    "Stage": "ntp_opt.model.plan",
    "TopologyError": "ntp_opt.model.topology",
    "Evaluation": "ntp_opt.rules.validate",
    "PlanError": "ntp_opt.rules.validate",
    "Violation": "ntp_opt.rules.validate",
    "check": "ntp_opt.rules.validate",
    "evaluate": "ntp_opt.rules.validate",
    "validate": "ntp_opt.rules.validate",
    "Limit": "ntp_opt.solve",
    "Result": "ntp_opt.solve",
    "Status": "ntp_opt.solve",
    "solve": "ntp_opt.solve",
}

#: Public functions named like a submodule (``ntp_opt/solve.py``, the compatibility
#: path ``ntp_opt/validate.py``): importing that module must not rebind them.
_SHADOWED = frozenset({"solve", "validate"})


def __getattr__(name: str) -> Any:
    """Import a public name on first use (PEP 562) and keep it."""
    if name == "topology":
        value: Any = importlib.import_module("ntp_opt.model.topology")
    elif name in _SOURCES:
        value = getattr(importlib.import_module(_SOURCES[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """The package module: the import system may not rebind :data:`_SHADOWED` names."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            # ``import ntp_opt.solve`` binds the submodule on its package: the
            # public name stays the function (resolved by ``__getattr__``).
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
