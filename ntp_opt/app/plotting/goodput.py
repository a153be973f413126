"""The goodput-over-time picture of a simulation: :func:`plot_goodput_over_time`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ntp_opt.app.plotting.style import pyplot

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes

    from ntp_opt.workflows.simulate import SimResult


def plot_goodput_over_time(sim_result: SimResult, ax: Axes | None = None) -> Axes:
    """Draw the relative goodput of a :func:`ntp_opt.workflows.simulate.simulate` run over time.

    Parameters
    ----------
    sim_result
        The result of :func:`ntp_opt.workflows.simulate.simulate`.
    ax
        Axes to draw on (a new figure when ``None``).

    Returns
    -------
    matplotlib.axes.Axes
        The goodput step line carries gid ``"goodput"``, the GPUs down
        ``"failed_gpus"`` (on a twin axis), the time average ``"mean"``.
    """
    plt = pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    steps = sim_result.steps
    ts = [s.t_hours for s in steps] + [sim_result.horizon_hours]
    gs = [s.relative_goodput for s in steps]
    gs = [*gs, gs[-1]] if gs else [0.0]
    (line,) = ax.step(ts if steps else [0.0], gs, where="post", color="#1f77b4", lw=1.5)
    line.set_gid("goodput")
    line.set_label(f"relative goodput ({sim_result.policy})")
    mean = ax.axhline(
        sim_result.mean_relative_goodput,
        color="#1f77b4",
        ls="--",
        lw=0.8,
        label=f"time average {sim_result.mean_relative_goodput:.4f}",
    )
    mean.set_gid("mean")
    lo = min(gs)
    hi = max(gs)
    pad = max(0.002, 0.1 * (hi - lo))
    ax.set_ylim(max(0.0, lo - pad), hi + pad)
    ax.set_xlim(0, sim_result.horizon_hours)
    ax.set_xlabel("time (hours)")
    ax.set_ylabel("relative goodput")
    twin = ax.twinx()
    down = [s.failed_gpus for s in steps]
    (dl,) = twin.step(
        ts if steps else [0.0],
        [*down, down[-1]] if down else [0],
        where="post",
        color="#7f7f7f",
        lw=0.8,
        label="GPUs down",
    )
    dl.set_gid("failed_gpus")
    twin.set_ylabel("GPUs down", color="#7f7f7f")
    twin.set_ylim(0, max(1, *down) * 1.15 if down else 1)
    ax.set_zorder(twin.get_zorder() + 1)  # the goodput line above the GPUs down
    ax.patch.set_visible(False)
    handles = [line, mean, dl]
    ax.legend(handles=handles, labels=[h.get_label() for h in handles], fontsize=7, loc="best")
    ax.set_title(
        f"{sim_result.policy}: goodput over {sim_result.horizon_hours:g} h, "
        f"{sim_result.replans} re-plans, "
        f"paused {sim_result.paused_hours:g} h",
        fontsize=10,
    )
    return ax
