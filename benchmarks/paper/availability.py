"""Reproduce the TP-group availability numbers of arXiv:2504.06095.

Prints a markdown table comparing the paper's published availability of uniform
tensor-parallel groups (32,768 GPUs, 0.1 % = 32 failed) with the exact hypergeometric
value and a Monte Carlo estimate, and optionally plots availability against the failed
fraction.

Usage::

    python benchmarks/paper/availability.py [--samples N] [--seed S] [--plot [out.png]]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ntp_opt.model.safeio import save_figure
from ntp_opt.workflows.availability import (
    PAPER_N_FAILED,
    PAPER_N_GPUS,
    PUBLISHED_AVAILABILITY,
    availability_exact,
    availability_sampled,
    availability_table,
)

DEFAULT_PLOT = Path(__file__).resolve().parent / "availability.png"
TPS = (8, 16, 32, 64)
MAX_FAILED_FRACTION = 0.005  # plot range: 0 to 0.5 % failed GPUs
SAMPLED_FRACTIONS = (0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.0045, 0.005)


def _pct(x: float) -> str:
    return f"{100 * x:.4f} %"


def markdown_table(samples: int, seed: int) -> str:
    """Return the paper-comparison table as markdown."""
    rows = availability_table(PAPER_N_GPUS, PAPER_N_FAILED, TPS, samples=samples, seed=seed)
    lines = [
        "| TP | published | exact | sampled ± CI | difference (exact − published) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        published = row["published"]
        pub = "—" if published is None else f"{100 * published:.1f} %"
        diff = "—" if published is None else f"{100 * (row['exact'] - published):+.3f} pp"
        lines.append(
            f"| {row['tp']} | {pub} | {_pct(row['exact'])} | "
            f"{100 * row['sampled']:.4f} ± {100 * row['ci']:.4f} % | {diff} |"
        )
    return "\n".join(lines)


def plot(path: Path, samples: int, seed: int) -> None:
    """Write a PNG of availability vs failed fraction for TP 8/16/32/64."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    n = PAPER_N_GPUS
    failed_counts = range(round(MAX_FAILED_FRACTION * n) + 1)  # same rounding as sampled
    x_exact = [100 * f / n for f in failed_counts]

    fig, ax = plt.subplots(figsize=(7.5, 5.0), dpi=120)
    for i, tp in enumerate(TPS):
        color = f"C{i}"
        exact = [100 * availability_exact(n, f, tp) for f in failed_counts]
        ax.plot(x_exact, exact, color=color, lw=1.5, label=f"TP{tp}")

        xs, ys, errs = [], [], []
        for k, frac in enumerate(SAMPLED_FRACTIONS):
            f = round(frac * n)
            mean, ci = availability_sampled(n, f, tp, samples=samples, seed=seed + k)
            xs.append(100 * f / n)
            ys.append(100 * mean)
            errs.append(100 * ci)
        ax.errorbar(xs, ys, yerr=errs, fmt="o", ms=3.5, color=color, capsize=3, elinewidth=1)

        published = PUBLISHED_AVAILABILITY.get(tp)
        if published is not None:
            ax.plot(
                100 * PAPER_N_FAILED / n,
                100 * published,
                marker="*",
                ms=13,
                color=color,
                markeredgecolor="black",
                linestyle="none",
            )

    handles, _ = ax.get_legend_handles_labels()
    handles += [
        Line2D([], [], color="gray", lw=1.5, label="exact (hypergeometric)"),
        Line2D([], [], color="gray", marker="o", ms=3.5, ls="none", label="sampled ± 95 % CI"),
        Line2D([], [], color="gray", marker="*", ms=11, mec="black", ls="none", label="published"),
    ]
    ax.set_xlim(0, 102 * MAX_FAILED_FRACTION)  # small margin: last points fully visible
    ax.set_xlabel(f"failed GPUs (% of {n:,})")
    ax.set_ylabel("availability (% of TP groups with no failed GPU)")
    ax.set_title(
        f"Uniform-TP availability, N = {n:,} GPUs, failures uniform at random\n"
        f"{samples} sampled failure sets per point (CI bars mostly hidden by markers)",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(handles=handles, fontsize=8, loc="lower left", ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000, help="Monte Carlo samples")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--plot",
        nargs="?",
        const=DEFAULT_PLOT,
        default=None,
        type=Path,
        metavar="OUT.png",
        help=f"write a PNG plot (default path: {DEFAULT_PLOT})",
    )
    args = parser.parse_args(argv)

    print(
        f"N = {PAPER_N_GPUS:,} GPUs, {PAPER_N_FAILED} failed "
        f"({100 * PAPER_N_FAILED / PAPER_N_GPUS:.4f} %), "
        f"samples = {args.samples}, seed = {args.seed}\n"
    )
    t0 = time.perf_counter()
    print(markdown_table(args.samples, args.seed))
    print(f"\ntable computed in {time.perf_counter() - t0:.2f} s")

    if args.plot is not None:
        t0 = time.perf_counter()
        plot(args.plot, args.samples, args.seed)
        print(f"plot written to {args.plot} in {time.perf_counter() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
