"""Node attribute values and defaults of the cluster topology, and the number checks they use."""

from __future__ import annotations

import math
import numbers

DEFAULT_TDP_W: float = 1000.0
"""Default GPU thermal design power in watts."""

SPEED_MIN: float = 1e-6
"""Smallest relative speed of a GPU (files, re-planning events, the service)."""

SPEED_MAX: float = 1000.0
"""Largest relative speed of a GPU in an instance file."""

NIC_GBPS_PER_GPU: float = 400.0
"""Scale-out bandwidth per GPU (one 400 Gb/s NIC per GPU) used for domain-leaf edges."""

HEALTHY = "healthy"
"""GPU ``state`` of a working GPU (the default)."""

FAILED = "failed"
"""GPU ``state`` of a failed GPU."""

KINDS = ("gpu", "tray", "domain", "rack", "switch")
"""Every node ``kind``, in containment order."""


def is_real(x: object) -> bool:
    """Tell whether `x` is a real number (not a bool).

    Parameters
    ----------
    x : object
        Any value.

    Returns
    -------
    bool
        True for ``int``, ``float`` and other :class:`numbers.Real` values except ``bool``.
    """
    t = type(x)
    if t is float or t is int:
        return True
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_int(x: object) -> bool:
    """Tell whether `x` is an integer (not a bool).

    Parameters
    ----------
    x : object
        Any value.

    Returns
    -------
    bool
        True for :class:`numbers.Integral` values except ``bool``.
    """
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def require_pos_int(name: str, value: object) -> int:
    """Return `value` as an ``int`` if it is a positive integer.

    Parameters
    ----------
    name : str
        The argument's name, for the error message.
    value : object
        The value to check.

    Returns
    -------
    int
        ``int(value)``.

    Raises
    ------
    ValueError
        If `value` is not a positive integer.
    """
    if not is_int(value) or int(value) <= 0:  # type: ignore[call-overload]
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def require_pos_finite(name: str, value: object) -> float:
    """Return `value` as a ``float`` if it is a finite number > 0.

    Parameters
    ----------
    name : str
        The argument's name, for the error message.
    value : object
        The value to check.

    Returns
    -------
    float
        ``float(value)``.

    Raises
    ------
    ValueError
        If `value` is not a finite real number > 0.
    """
    if not is_real(value) or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type,operator]
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]
