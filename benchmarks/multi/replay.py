"""Fleets that follow demand: the re-planner vs the static partition vs re-solving.

Clusters as in ``benchmarks/multi/run.py`` (NVL32 or GB200 NVL72, 0.2 % of the
GPUs failed at random, one TP32 PP4 training job on about three quarters of
the domains, fleets chat / agents / embed at load 1.0) at about 4k GPUs
(128 NVL32 domains, DP 24) and 32k GPUs (1,024 NVL32 domains, DP 192). Demand
traces from :func:`ntp_opt.workflows.multi.demand.generate_demand` around the fleets'
base demand (embed plays the batch role): ``diurnal``, ``bursty``, ``ramp``
(and ``flat``, noise only), one step per ``--step-s`` seconds.

Each trace is replayed by ``replay`` (first plan by the MILP, then
:func:`ntp_opt.workflows.multi.replanner.replan_multi` with the default migration cost and
hysteresis), ``static`` (the static partition sized for each fleet's peak
demand) and ``resolve`` (the MILP from scratch at every step). Every plan is
validated. Figures: mean weighted goodput, the same net of migration losses
(every planner charged by the same :class:`MigrationCost`), mean served share
per fleet and training relative goodput, GPUs moved (total and per step, the
first placement left out) and the median decision CPU time (``time.process_time``,
one thread).

Usage::

    python benchmarks/multi/replay.py [--sizes 4k,32k] [--shapes diurnal,bursty,ramp]
        [--steps 24] [--step-s 3600] [--seed 0] [--time-limit 60] [--fraction 0.002]
        [--stragglers N] [--out results-replay.md]

Sizes: ``4k`` and ``32k`` (NVL32), ``4k-nvl72`` and ``32k-nvl72`` (GB200 NVL72,
57 and 456 domains, DP 20 and 160).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run  # noqa: E402  (the cluster builder of benchmarks/multi/run.py)

from ntp_opt.model.safeio import atomic_write  # noqa: E402
from ntp_opt.workflows.multi.demand import generate_demand  # noqa: E402
from ntp_opt.workflows.multi.replay import PLANNERS, replay, summary  # noqa: E402

DEFAULT_TABLE = HERE / "results-replay.md"
#: size -> (cluster kind, domains, training DP replicas)
SIZES = {
    "4k": ("nvl32", 128, 24),
    "32k": ("nvl32", 1024, 192),
    "4k-nvl72": ("nvl72", 57, 20),
    "32k-nvl72": ("nvl72", 456, 160),
}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4k,32k")
    ap.add_argument("--shapes", default="diurnal,bursty,ramp")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--step-s", type=float, default=3600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fraction", type=float, default=0.002)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument(
        "--stragglers", type=int, default=0, help="healthy GPUs slowed to 0.7-0.95 at random"
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_TABLE)
    args = ap.parse_args(argv)
    header = (
        "| cluster | trace | planner | mean W | net W | served chat / agents / embed "
        "| training | GPUs moved (per step) | median CPU s (max) |"
    )
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for size in args.sizes.split(","):
        kind, domains, dp = SIZES[size]
        run.CLUSTERS[kind] = (domains, dp)
        multi = run.build(kind, args.fraction, 1.0, args.seed, args.stragglers)
        n = multi.instance.arrays.n_gpus
        for shape in args.shapes.split(","):
            trace = generate_demand(
                multi.workloads,
                shape,
                steps=args.steps,
                step_s=args.step_s,
                seed=args.seed,  # type: ignore[arg-type]
            )
            t0 = time.perf_counter()
            records = replay(multi, trace, time_limit=args.time_limit, seed=args.seed)
            wall = time.perf_counter() - t0
            for p in PLANNERS:
                s = summary(records, p)
                served = " / ".join(f"{v:.3f}" for v in s["mean_served"].values())
                rows.append(
                    f"| {kind} ({n}) | {shape} | {p} | {s['mean_weighted_goodput']:.4f} "
                    f"| {s['mean_net_weighted_goodput']:.4f} | {served} "
                    f"| {s['mean_training_relative_goodput']:.3f} "
                    f"| {s['gpus_moved_total']} ({s['gpus_moved_per_step']:.1f}) "
                    f"| {s['median_decision_cpu_s']:.3f} ({s['max_decision_cpu_s']:.3f}) |"
                )
                print(rows[-1], flush=True)
            print(f"{size} {shape}: {wall:.1f}s wall", flush=True)
    text = "\n".join(
        [
            "# Fleets that follow demand: re-planner vs static partition vs re-solving",
            "",
            "Weighted goodput W = training relative goodput + chat served + 2 x agents "
            "served + 0.5 x embed served (maximum 4.5), averaged over the trace's steps; "
            "net W subtracts the migration losses of every planner's moves under the "
            "default `MigrationCost` (replica start 120 s, stop 30 s, training restart "
            "600 s), spread over the trace. GPUs moved and CPU times leave out the first "
            "placement. CPU = `time.process_time` of one decision (one thread), on a "
            "shared 2-core machine. Generated by `python benchmarks/multi/replay.py "
            f"--sizes {args.sizes} --shapes {args.shapes} --steps {args.steps} --step-s "
            f"{args.step_s:g} --seed {args.seed} --time-limit {args.time_limit:g} --fraction "
            f"{args.fraction:g} --stragglers {args.stragglers}`; see "
            "the script's docstring.",
            "",
            *rows,
            "",
        ]
    )
    atomic_write(args.out, text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
