"""ntp_opt: plan nonuniform tensor-parallel training on clusters with failed GPUs.

The public API (``docs/api.md``) is the names of :data:`__all__`:

* :mod:`ntp_opt.topology` (the module :mod:`ntp_opt.model.topology`) builds
  cluster graphs and marks failures;
* :class:`Job` and :class:`Instance` describe the problem;
* :func:`solve` plans it with one of :data:`PLANNERS` and returns a
  :class:`Result`; :class:`SolveProgress` is what its callback receives;
* :func:`validate`, :func:`evaluate` and :func:`check` judge any plan;
* :func:`load_instance`, :func:`save_instance`, :func:`load_plan` and
  :func:`save_plan` read and write the JSON formats;
* :class:`Replanner` and :class:`ClusterEvent` re-plan a running job after
  failures, repairs and stragglers.

The names are imported on first use (PEP 562), so that ``import ntp_opt``, and
a command that needs one layer (``ntp-opt solve --planner fast``), does not
import every layer.

Old module paths (``ntp_opt.replan``, ``ntp_opt.milp.search``, ...: the table
:data:`_MOVED`) work for one more release, with a :class:`DeprecationWarning`
naming the new path: as attributes through :func:`__getattr__`, and in
``import`` statements through :class:`_OldPaths`, which makes the old name the
very module object of the new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ntp_opt.model import topology
    from ntp_opt.model.control import SolveProgress
    from ntp_opt.model.files import InputError, load_instance, load_plan, save_instance, save_plan
    from ntp_opt.model.instance import Instance
    from ntp_opt.model.job import Job
    from ntp_opt.model.plan import Plan, Replica, Stage
    from ntp_opt.model.topology import TopologyError
    from ntp_opt.rules.validate import Evaluation, PlanError, Violation, check, evaluate, validate
    from ntp_opt.solve import PLANNERS, Limit, Result, Status, solve
    from ntp_opt.workflows.replan import ClusterEvent, Replanned, Replanner

__version__ = "0.1.0"

__all__ = [
    "PLANNERS",
    "ClusterEvent",
    "Evaluation",
    "InputError",
    "Instance",
    "Job",
    "Limit",
    "Plan",
    "PlanError",
    "Replanned",
    "Replanner",
    "Replica",
    "Result",
    "SolveProgress",
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
    "SolveProgress": "ntp_opt.model.control",
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
    "PLANNERS": "ntp_opt.solve",
    "Limit": "ntp_opt.solve",
    "Result": "ntp_opt.solve",
    "Status": "ntp_opt.solve",
    "solve": "ntp_opt.solve",
    "ClusterEvent": "ntp_opt.workflows.replan",
    "Replanned": "ntp_opt.workflows.replan",
    "Replanner": "ntp_opt.workflows.replan",
}

#: Deprecated module paths, for one release: old name under ``ntp_opt`` -> the
#: module it moved to (a package's submodules follow it: ``ntp_opt.milp.search``
#: is ``ntp_opt.planners.exact.search``).
_MOVED: dict[str, str] = {
    "bench": "ntp_opt.app.bench",
    "cli": "ntp_opt.app.cli",
    "control": "ntp_opt.model.control",
    "expected": "ntp_opt.rules.expected",
    "export": "ntp_opt.app.export",
    "failures": "ntp_opt.model.failures",
    "files": "ntp_opt.model.files",
    "hardware": "ntp_opt.model.hardware",
    "importers": "ntp_opt.app.importers",
    "instance": "ntp_opt.model.instance",
    "job": "ntp_opt.model.job",
    "megatron": "ntp_opt.planners.megatron",
    "milp": "ntp_opt.planners.exact",
    "plan": "ntp_opt.model.plan",
    "plot": "ntp_opt.app.plotting",
    "power": "ntp_opt.rules.power",
    "recourse": "ntp_opt.rules.recourse",
    "replan": "ntp_opt.workflows.replan",
    "riskaware": "ntp_opt.planners.riskaware",
    "safeio": "ntp_opt.model.safeio",
    "service": "ntp_opt.app.service",
    "simulate": "ntp_opt.workflows.simulate",
    "topology": "ntp_opt.model.topology",
    "validate": "ntp_opt.rules.validate",
}

#: Public functions named like a module (the layer ``ntp_opt/solve.py``, the old
#: path ``ntp_opt.validate``): importing that module must not rebind them.
_SHADOWED = frozenset({"solve", "validate"})


def _moved_to(name: str) -> str | None:
    """The module a deprecated path moved to, or ``None`` if ``name`` did not move.

    Parameters
    ----------
    name
        A full module name, e.g. ``"ntp_opt.milp.search"``.

    Returns
    -------
    str or None
        The new full name (``"ntp_opt.planners.exact.search"``).
    """
    head, _, rest = name.partition(".")
    if head != __name__ or not rest:
        return None
    old, dot, tail = rest.partition(".")
    new = _MOVED.get(old)
    return None if new is None else new + dot + tail


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f"{old} is deprecated and goes in the next release; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def __getattr__(name: str) -> Any:
    """Import a public name on first use (PEP 562) and keep it; an old module
    path (:data:`_MOVED`) gives the new module, with a deprecation warning."""
    if name == "topology":
        value: Any = importlib.import_module("ntp_opt.model.topology")
    elif name in _SOURCES:
        value = getattr(importlib.import_module(_SOURCES[name]), name)
    elif name in _MOVED:
        _warn(f"{__name__}.{name}", _MOVED[name], stacklevel=2)
        return importlib.import_module(_MOVED[name])
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import ntp_opt.replan`` and the like: the old name becomes an alias of the
    module it moved to (the same object, so patching one patches the other)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec for a deprecated path (:func:`_moved_to`); ``None`` for any other."""
        new = _moved_to(fullname)
        if new is None:
            return None
        spec = importlib.util.find_spec(new)
        if spec is None:
            return None
        is_package = spec.submodule_search_locations is not None
        return importlib.util.spec_from_loader(fullname, self, is_package=is_package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        """The new module, imported (the old name is bound to it, unchanged)."""
        new = _moved_to(spec.name)
        assert new is not None  # find_spec returned this spec for it
        _warn(spec.name, new, stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import system overwrites it next
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Give the module back its own spec (:meth:`create_module` ran it already)."""
        alias = module.__spec__
        assert alias is not None  # the import system set it to the alias spec
        module.__spec__ = alias.loader_state

    def get_code(self, fullname: str) -> types.CodeType | None:
        """The new module's code (``python -m ntp_opt.cli`` runs it)."""
        new = _moved_to(fullname)
        spec = importlib.util.find_spec(new) if new else None
        loader = getattr(spec, "loader", None)
        if new is None or not isinstance(loader, importlib.abc.InspectLoader):
            return None
        _warn(fullname, new, stacklevel=2)
        return loader.get_code(new)


class _Package(types.ModuleType):
    """The package: the import system may not rebind the :data:`_SHADOWED` functions."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            # ``import ntp_opt.solve`` binds the submodule on its package: the
            # public name stays the function (resolved by ``__getattr__``).
            return
        super().__setattr__(name, value)


if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
    sys.meta_path.insert(0, _OldPaths())
sys.modules[__name__].__class__ = _Package
