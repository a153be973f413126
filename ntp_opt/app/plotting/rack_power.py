"""The rack power picture: :func:`plot_rack_power`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ntp_opt.app.plotting.style import literal, pyplot
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.rules.power import exceeds
from ntp_opt.rules.validate import evaluate

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes


def plot_rack_power(instance: Instance, plan: Plan, ax: Axes | None = None) -> Axes:
    """Draw every rack's power draw against its budget.

    Bars are the validator's rack sums (:func:`ntp_opt.rules.validate.evaluate`,
    ``rack_power_w``), red when above budget; the black ticks are the budgets.

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan for it.
    ax
        Axes to draw on (a new figure when ``None``).

    Returns
    -------
    matplotlib.axes.Axes
        The bars (``ax.containers[0]``) carry gid ``"rack_power"``, the budget
        ticks ``"rack_budget"``.
    """
    plt = pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3))
    a = instance.arrays
    ev = evaluate(instance, plan)
    power = np.asarray(ev.rack_power_w, dtype=float) / 1e3
    budget = a.rack_budget / 1e3
    xs = np.arange(len(power))
    over = exceeds(np.asarray(ev.rack_power_w, dtype=float), a.rack_budget)  # as the validator
    bars = ax.bar(
        xs,
        power,
        width=0.8 if len(xs) <= 256 else 1.0,
        color=np.where(over, "#d62728", "#4c72b0").tolist(),
        linewidth=0,
        label="draw",
    )
    for bar in bars:
        bar.set_gid("rack_power")
    ticks = ax.hlines(budget, xs - 0.45, xs + 0.45, colors="black", linewidths=1.0, label="budget")
    ticks.set_gid("rack_budget")
    ax.set_xlim(-0.6, len(xs) - 0.4)
    ax.set_ylim(0, max(float(budget.max(initial=0)), float(power.max(initial=0))) * 1.08 or 1)
    ax.set_xlabel(f"rack (0 .. {len(xs) - 1}, in instance order)")
    ax.set_ylabel("power (kW)")
    worst = float((power / np.where(budget > 0, budget, np.inf)).max(initial=0))
    ax.set_title(
        f"rack power against budget: site {ev.site_power_w / 1e3:,.1f} of "
        f"{a.site_budget / 1e3:,.1f} kW; fullest rack at {100 * worst:.1f} %"
        + (f"; {int(over.sum())} over budget" if over.any() else ""),
        fontsize=10,
    )
    if len(xs) <= 40:
        ax.set_xticks(xs, [literal(str(r)) for r in a.rack_ids], rotation=90, fontsize=7)
    ax.legend(fontsize=7, loc="lower right")
    return ax
