"""Pictures of a plan: the GPU map, rack power, goodput over time.

The functions draw on a matplotlib ``Axes`` (``ax``; a new figure when
``None``) and return it, so they compose into any figure::

    fig, (top, bottom) = plt.subplots(2, 1)
    plot_plan(instance, plan, ax=top)
    plot_rack_power(instance, plan, ax=bottom)

matplotlib is only needed here (``pip install 'ntp-opt[plot]'``); it is
imported when a function is called. :func:`plan_html` needs nothing: it writes
one self-contained HTML page (inline SVG and JavaScript, no network access)
with an overview per rack and a drill-down to the domains and GPUs of a rack.

What the map shows (``docs/plot.md``):

- the title gives the degrees (DP, TP and the reduced replicas by degree, PP);
- every GPU is a square, grouped by tray (host, outlined) and NVLink domain
  inside its rack; its colour is its replica (hue) and pipeline stage
  (shade); replica ``r`` is DP rank ``r`` (labelled ``r.stage`` where legible);
- GPUs of a reduced replica (TP below ``job.tp``) carry a black dot;
- failed GPUs are crossed, stragglers (``speed < 1``) hatched, healthy GPUs
  the plan does not use (spares) grey;
- GPUs of a boosted stage (power multiplier above 1) have an orange edge and,
  when the map is small enough to read, a label with their watts
  (``tdp_w`` times the multiplier);
- with ``diff=OLD_PLAN``, GPUs whose role changed (see :func:`plan_layout`)
  have a magenta edge.

Above :data:`GPU_LEVEL_MAX` GPUs the map draws one cell per domain (per rack
part of a domain) instead, coloured by the replica holding most of its GPUs,
crossed when it holds a failed GPU, hatched when it holds a straggler.

One module per picture, each drawing on the ``ax`` it is given:
:mod:`~ntp_opt.app.plotting.gpu_map` (:func:`plot_plan`),
:mod:`~ntp_opt.app.plotting.rack_power` (:func:`plot_rack_power`),
:mod:`~ntp_opt.app.plotting.goodput` (:func:`plot_goodput_over_time`) and
:mod:`~ntp_opt.app.plotting.figure` (:func:`plan_figure`, the two first
together); :mod:`~ntp_opt.app.plotting.layout` computes what they show and
:mod:`~ntp_opt.app.plotting.page` fills the page ``page.html`` (a package
file) for :func:`plan_html`.
"""

from ntp_opt.app.plotting.figure import plan_figure
from ntp_opt.app.plotting.goodput import plot_goodput_over_time
from ntp_opt.app.plotting.gpu_map import plot_plan
from ntp_opt.app.plotting.layout import PlanLayout, plan_layout, tp_summary
from ntp_opt.app.plotting.page import plan_html
from ntp_opt.app.plotting.rack_power import plot_rack_power
from ntp_opt.app.plotting.style import (
    BOOST_EDGE,
    FAILED_COLOR,
    FIGURE_SIZE_IN,
    GPU_LEVEL_MAX,
    MOVED_EDGE,
    SPARE_COLOR,
    replica_color,
)

__all__ = [
    "BOOST_EDGE",
    "FAILED_COLOR",
    "FIGURE_SIZE_IN",
    "GPU_LEVEL_MAX",
    "MOVED_EDGE",
    "SPARE_COLOR",
    "PlanLayout",
    "plan_figure",
    "plan_html",
    "plan_layout",
    "plot_goodput_over_time",
    "plot_plan",
    "plot_rack_power",
    "replica_color",
    "tp_summary",
]
