"""The self-contained HTML page of a plan: :func:`plan_html`.

The page's markup, style and script are the package file ``page.html``; the
plan's data is filled in as JSON.
"""

from __future__ import annotations

import html
import json
from collections.abc import Hashable
from importlib.resources import files
from typing import Any

from ntp_opt.app.plotting.layout import domain_parts, plan_layout, tp_summary
from ntp_opt.app.plotting.style import (
    BOOST_EDGE,
    FAILED_COLOR,
    MOVED_EDGE,
    SPARE_COLOR,
    replica_color,
)
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.rules.validate import evaluate


def _ident(x: Hashable) -> str:
    """A node id as the page shows it."""
    return str(x)


def _html_data(instance: Instance, plan: Plan, diff: Plan | None) -> dict[str, Any]:
    a = instance.arrays
    lay = plan_layout(instance, plan, diff)
    ev = evaluate(instance, plan)
    palette = [[replica_color(r, s, n) for s in range(n)] for r, n in enumerate(lay.n_stages)]

    return {
        "name": instance.name,
        "policy": str(plan.metrics.get("policy", "")),
        "relative_goodput": ev.relative_goodput,
        "feasible": ev.feasible,
        "site_w": ev.site_power_w,
        "site_budget_w": a.site_budget,
        "diff": diff is not None,
        "tp_summary": tp_summary(plan, lay.tp_base)
        + (f", PP {max(lay.n_stages)}" if lay.n_stages else ""),
        "tp": list(lay.tp),
        "tp_base": lay.tp_base,
        "trays": [_ident(t) for t in a.tray_ids],
        "palette": palette,
        "spare": SPARE_COLOR,
        "failed_color": FAILED_COLOR,
        "boost": BOOST_EDGE,
        "moved_color": MOVED_EDGE,
        "gpu": {
            "id": [_ident(g) for g in a.gpu_ids],
            "rep": lay.replica.tolist(),
            "stage": lay.stage.tolist(),
            "state": lay.state.tolist(),
            "speed": [round(float(x), 4) for x in a.speed],
            "watts": [round(float(x), 1) for x in lay.watts],
            "mult": [round(float(x), 4) for x in lay.multiplier],
            "moved": lay.moved.astype(int).tolist(),
            "tray": a.gpu_tray.tolist(),
        },
        "racks": [
            {
                "id": _ident(a.rack_ids[ri]),
                "power": round(ev.rack_power_w[ri], 1),
                "budget": round(float(a.rack_budget[ri]), 1),
                "domains": [
                    {"id": _ident(a.domain_ids[p.domain]), "gpus": p.gpus.tolist()} for p in parts
                ],
            }
            for ri, parts in enumerate(domain_parts(instance))
        ],
    }


def _page_template() -> str:
    """The page's markup, style and script with ``__TITLE__`` and ``__DATA__`` to fill in."""
    return files("ntp_opt.app.plotting").joinpath("page.html").read_text(encoding="utf-8")


def plan_html(instance: Instance, plan: Plan, diff: Plan | None = None) -> str:
    """One self-contained HTML page showing a plan (no network access needed).

    The page shows one square per rack (one strip per replica as wide as its
    share of the rack's GPUs, a dot on reduced replicas, marks for failed,
    straggling, boosted and moved GPUs, a bar for power against budget) and,
    on a click or with ``#rack=ID`` in the address, the rack's domains (full
    ids) and trays (hosts, one row each) with tooltips (GPU id, host, state,
    speed, DP rank, stage, TP degree, power in watts). Ids are data, never
    markup: no ``<`` reaches the page inside the embedded JSON.

    Parameters
    ----------
    instance, plan, diff
        As for :func:`plot_plan`.

    Returns
    -------
    str
        The page.
    """
    data = json.dumps(_html_data(instance, plan, diff), separators=(",", ":"))
    # Inside <script> no "<" may appear at all ("</script>", "<!--" would end
    # or swallow the block): JSON reads the escapes back as the same text.
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    page = _page_template()
    return page.replace("__TITLE__", html.escape(instance.name)).replace("__DATA__", data)
