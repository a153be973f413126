"""The figure ``ntp-opt plot`` saves: :func:`plan_figure` (GPU map over rack power)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ntp_opt.app.plotting.gpu_map import plot_plan
from ntp_opt.app.plotting.rack_power import plot_rack_power
from ntp_opt.app.plotting.style import FIGURE_SIZE_IN, pyplot
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure


def plan_figure(instance: Instance, plan: Plan, diff: Plan | None = None) -> Figure:
    """A figure with the plan map (top) and rack power (bottom).

    Parameters
    ----------
    instance, plan, diff
        As for :func:`plot_plan`.

    Returns
    -------
    matplotlib.figure.Figure
    """
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=FIGURE_SIZE_IN, gridspec_kw={"height_ratios": [3.2, 1]}, layout="constrained"
    )
    plot_plan(instance, plan, ax=top, diff=diff)
    plot_rack_power(instance, plan, ax=bottom)
    return fig
