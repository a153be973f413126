"""The ``ntp-opt plot`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ntp_opt.app.plotting import FIGURE_SIZE_IN
from ntp_opt.model.echo import echo
from ntp_opt.model.files import (
    load_instance,
    load_plan,
)

DPI_MIN, DPI_MAX = 10, 600
"""Bounds of ``--dpi``: at 600 dpi the figure is 6,600 x 6,000 pixels (about 160 MB of RGBA)."""


def run(args: argparse.Namespace) -> int:
    import io

    from ntp_opt.app.plotting import plan_html
    from ntp_opt.model.safeio import atomic_write

    out = Path(args.output)
    kind = out.suffix.lower().lstrip(".")
    if kind not in ("svg", "png", "pdf", "html"):
        raise ValueError(f"{out}: -o must end in .svg, .png, .pdf or .html")
    from ntp_opt.app.plotting import plan_layout

    if not DPI_MIN <= args.dpi <= DPI_MAX:
        w, h = FIGURE_SIZE_IN
        raise ValueError(
            f"--dpi {args.dpi}: must be {DPI_MIN} .. {DPI_MAX} (the figure is {w} x {h} inches; "
            f"{args.dpi} dpi would be {round(w * args.dpi):,} x {round(h * args.dpi):,} pixels)"
        )
    instance = load_instance(args.instance)
    plan = load_plan(args.plan)
    if args.reorder:
        from ntp_opt.planners.megatron import megatron_order

        plan = megatron_order(plan, instance.job.tp)
    diff = load_plan(args.diff) if args.diff is not None else None
    for file, p in ((args.plan, plan), (args.diff, diff)):
        try:
            if p is not None:
                plan_layout(instance, p)  # every GPU must be in the instance
        except ValueError as err:
            raise ValueError(f"{file}: {err}") from None
    inputs = [args.instance, args.plan] + ([args.diff] if args.diff is not None else [])
    if kind == "html":
        atomic_write(out, plan_html(instance, plan, diff), inputs)
    else:
        try:
            import matplotlib

            matplotlib.use("Agg")
        except ImportError:
            raise ValueError(
                f"{out}: writing .{kind} needs matplotlib: pip install 'ntp-opt[plot]' "
                "(.html needs nothing)"
            ) from None
        import matplotlib.pyplot as plt

        from ntp_opt.app.plotting import plan_figure

        fig = plan_figure(instance, plan, diff)
        buf = io.BytesIO()
        fig.savefig(buf, format=kind, dpi=args.dpi)
        plt.close(fig)
        atomic_write(out, buf.getvalue(), inputs)
    print(f"wrote {echo(out)}")
    return 0


def add_parser(sub: Any) -> None:
    """The ``ntp-opt plot`` subcommand."""
    pl = sub.add_parser(
        "plot", help="draw a plan: GPU map and rack power (.svg/.png) or an HTML page"
    )
    pl.add_argument("instance", help="instance file")
    pl.add_argument("plan", help="plan file")
    pl.add_argument(
        "-o",
        "--output",
        required=True,
        help="FILE.svg, FILE.png, FILE.pdf (matplotlib) or FILE.html (self-contained page)",
    )
    pl.add_argument("--diff", metavar="OLD_PLAN", help="earlier plan: mark the GPUs that moved")
    pl.add_argument(
        "--dpi",
        type=int,
        default=110,
        help=f"resolution of a .png ({DPI_MIN} .. {DPI_MAX}, default 110)",
    )
    pl.add_argument(
        "--reorder",
        action="store_true",
        help="reduced replicas first, as `export --reorder` launches them: "
        "the DP ranks drawn are then the launch files' ranks",
    )
    pl.set_defaults(func=run)
