"""The backend interface and the registry of backends.

A backend is one solver for an :class:`~ntp_opt.planners.exact.program.IntProgram`.
It has a ``name`` (what ``backend=`` and ``--backend`` accept), the ``extra``
that installs it (``pip install 'ntp-opt[<extra>]'``), :meth:`Backend.available`
and :meth:`Backend.solve`; a backend that can also bound a program by its
relaxation implements :class:`RelaxingBackend`. Each backend module
(:mod:`~ntp_opt.planners.exact.backends.cpsat`, ...) defines one class and
registers one instance with :func:`register`; callers look backends up with
:func:`get_backend`, never by comparing names. The solver packages (``ortools``,
``highspy``, ``pulp``) are imported only inside the backend modules.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from ntp_opt.planners.exact.backends.common import (
    BackendUnavailable,
    Data,
    Options,
    Raw,
    finish,
    prepare,
)
from ntp_opt.planners.exact.program import IntProgram, IntSolution

__all__ = [
    "Backend",
    "RelaxingBackend",
    "SolverBackend",
    "backend_names",
    "check_backend",
    "get_backend",
    "register",
    "registered",
]

logger = logging.getLogger(__name__)


@runtime_checkable
class Backend(Protocol):
    """What every backend offers (see the module docstring)."""

    @property
    def name(self) -> str:
        """What ``backend=`` and ``--backend`` accept."""
        ...

    @property
    def extra(self) -> str:
        """The extra that installs the solver: ``pip install 'ntp-opt[<extra>]'``."""
        ...

    @property
    def has_work_limit(self) -> bool:
        """Whether the backend honours ``Options.work_limit`` (a deterministic limit)."""
        ...

    def load(self) -> Any:
        """Import the solver package; :class:`BackendUnavailable` naming the extra if missing."""
        ...

    def available(self) -> bool:
        """Whether :meth:`load` succeeds here."""
        ...

    def solve(self, program: IntProgram, options: Options) -> IntSolution:
        """Maximise ``program`` under the checked ``options``."""
        ...


@runtime_checkable
class RelaxingBackend(Backend, Protocol):
    """A backend that also bounds a program by a (partly) continuous relaxation."""

    def relax(
        self,
        program: IntProgram,
        threads: int = 1,
        *,
        integer_from: int | None = None,
        node_limit: int | None = None,
        time_limit: float | None = None,
    ) -> float | None:
        """An upper bound on the program's optimum, or None (see
        :func:`~ntp_opt.planners.exact.oracle.lp_relaxation`)."""
        ...


class SolverBackend(ABC):
    """The shared part of a backend: load, check the program, run, check the answer.

    A subclass sets ``name`` and ``extra`` (and ``has_work_limit`` when it
    honours ``Options.work_limit``) and implements :meth:`load` and
    :meth:`run`; :meth:`solve` normalises the program
    (:func:`~ntp_opt.planners.exact.backends.common.prepare`), answers trivial
    programs itself, and rounds and checks the backend's :class:`Raw` answer
    (:func:`~ntp_opt.planners.exact.backends.common.finish`).
    """

    name: ClassVar[str]
    extra: ClassVar[str]
    has_work_limit: ClassVar[bool] = False

    @abstractmethod
    def load(self) -> Any:
        """Import what the backend needs; :class:`BackendUnavailable` if missing."""

    @abstractmethod
    def run(self, solver: Any, program: IntProgram, data: Data, opts: Options) -> Raw:
        """Solve the normalised program with what :meth:`load` returned."""

    def available(self) -> bool:
        """Whether the backend's solver can be imported (and run) here.

        Returns
        -------
        bool
            False when :meth:`load` raises :class:`BackendUnavailable`.
        """
        try:
            self.load()
        except BackendUnavailable:
            return False
        return True

    def solve(self, program: IntProgram, options: Options) -> IntSolution:
        """Maximise ``program``.

        Parameters
        ----------
        program
            The integer program.
        options
            Checked options (:func:`~ntp_opt.planners.exact.backends.common.options`).

        Returns
        -------
        IntSolution
            As :func:`~ntp_opt.planners.exact.backends.solve_program` describes.
        """
        solver = self.load()
        t0 = time.perf_counter()
        data, broken = prepare(program)
        if broken:
            raw = Raw("infeasible", log=f"infeasible before solving: {', '.join(broken)}")
        elif program.n_vars == 0:
            raw = Raw("optimal", values=np.zeros(0), bound=0.0, log="empty program")
        else:
            raw = self.run(solver, program, data, options)
        solution = finish(program, data, self.name, raw, options, time.perf_counter() - t0)
        logger.debug(
            "%s: %d variables, %d rows: %s, objective %s, bound %s, %.3f s%s",
            self.name,
            program.n_vars,
            data.count,
            solution.status,
            solution.objective,
            solution.bound,
            solution.runtime_s,
            " (interrupted)" if solution.interrupted else "",
        )
        return solution


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add ``backend`` to the registry (after those registered before it).

    Parameters
    ----------
    backend
        The backend; its ``name`` must be new.

    Returns
    -------
    Backend
        ``backend``.

    Raises
    ------
    ValueError
        A backend of that name is registered already.
    """
    if backend.name in _REGISTRY:
        raise ValueError(f"a backend named {backend.name!r} is registered already")
    _REGISTRY[backend.name] = backend
    return backend


def backend_names() -> tuple[str, ...]:
    """Names of the registered backends, in order of registration (of preference).

    Returns
    -------
    tuple[str, ...]
        The names.
    """
    return tuple(_REGISTRY)


def registered() -> tuple[Backend, ...]:
    """The registered backends, in order of registration.

    Returns
    -------
    tuple[Backend, ...]
        The backends.
    """
    return tuple(_REGISTRY.values())


def check_backend(backend: str) -> None:
    """ValueError unless ``backend`` names a registered backend.

    Parameters
    ----------
    backend
        A backend name.

    Raises
    ------
    ValueError
        Unknown backend (the message lists the known ones).
    """
    if backend not in _REGISTRY:
        raise ValueError(f"unknown backend {backend!r}; known backends: {', '.join(_REGISTRY)}")


def get_backend(backend: str) -> Backend:
    """The registered backend named ``backend``.

    Parameters
    ----------
    backend
        A backend name.

    Returns
    -------
    Backend
        The backend.

    Raises
    ------
    ValueError
        Unknown backend.
    """
    check_backend(backend)
    return _REGISTRY[backend]
