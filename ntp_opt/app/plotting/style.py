"""Colours, sizes and the lazy matplotlib import shared by the pictures of a plan."""

from __future__ import annotations

import colorsys
from typing import Any

GPU_LEVEL_MAX = 4096
"""Largest cluster :func:`plot_plan` draws GPU by GPU with ``level="auto"``."""

SPARE_COLOR = "#c8c8c8"
FAILED_COLOR = "#ffffff"
BOOST_EDGE = "#ff7f0e"
MOVED_EDGE = "#d62fd6"
FIGURE_SIZE_IN = (11, 10)
"""Width and height of :func:`plan_figure` in inches."""
LABEL_MAX = 64
"""Boost labels (watts) are written on the map only up to this many boosted stage parts."""

USED, SPARE, FAILED = 0, 1, 2
STATE_NAMES = ("used", "spare", "failed")


def pyplot() -> Any:
    """``matplotlib.pyplot``, imported on first use.

    Returns
    -------
    module
        ``matplotlib.pyplot``.

    Raises
    ------
    ImportError
        Without matplotlib (the message names the extra to install).
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "ntp_opt.app.plotting needs matplotlib: pip install 'ntp-opt[plot]'", name="matplotlib"
        ) from None
    return plt


def literal(text: str) -> str:
    """``text`` as literal matplotlib text: a ``$`` never starts mathtext."""
    return text.replace("$", r"\$")


def replica_color(replica: int, stage: int = 0, n_stages: int = 1) -> str:
    """The colour of a replica's stage, as ``#rrggbb``.

    Replicas get hues spread by the golden ratio (neighbours differ most);
    later stages of a replica are darker shades of its hue.

    Parameters
    ----------
    replica
        Replica index (0-based); negative means unused (spare grey).
    stage
        Stage index in the replica.
    n_stages
        Stages of the replica.

    Returns
    -------
    str
    """
    if replica < 0:
        return SPARE_COLOR
    hue = (replica * 0.618033988749895) % 1.0
    value = 0.95 - 0.4 * (stage / (n_stages - 1) if n_stages > 1 else 0.0)
    r, g, b = colorsys.hsv_to_rgb(hue, 0.6, value)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"
