"""Heterogeneous workloads on one cluster: the multi-workload MILP vs static partitions.

Instances built for it: about 4k GPUs in NVL32 (128 domains) or GB200 NVL72
(57 domains) with a fraction of the GPUs failed at random, one training job
(TP32 reducible to 30 and 28, PP4, fixed global batch) on about three quarters
of the domains, and three serving fleets that ask for the rest of the cluster
times a *load* factor (1.0: demand matches the GPUs left; 1.1: 10 % more):

| fleet  | TP degrees (req/s per replica) | weight | minimum share       |
|--------|--------------------------------|--------|---------------------|
| chat   | 4 (3.5), 8 (6.5)               | 1.0    | 4 replicas          |
| agents | 2 (1.9), 4 (3.5)               | 2.0    | half of its demand  |
| embed  | 1 (1.0), 2 (1.9)               | 0.5    | none                |

Training has weight 1.0. Three plans per instance, each checked by the
multi-workload validator:

* ``static``: every workload gets a fixed block of domains in proportion to
  its nominal need (:func:`ntp_opt.workflows.multi.static.solve_static`);
  training planned exactly inside its block (``optimal-nopower``), fleets greedily;
* ``milp-split``: the MILP, whole domains only (``share_domains=False``);
* ``milp``: the MILP, packing serving replicas into the GPUs training leaves
  idle inside its domains.

Usage::

    python benchmarks/multi/run.py [--kinds nvl32,nvl72] [--fractions 0.001,0.002,0.004]
        [--loads 1.0,1.1] [--seed 0] [--time-limit 60] [--stragglers N] [--out table.md]

Prints one line per instance and writes a markdown table (default
``benchmarks/multi/results.md``).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from ntp_opt import Instance, Job
from ntp_opt.model import topology
from ntp_opt.model.safeio import atomic_write
from ntp_opt.model.workloads import MultiInstance, ServingWorkload, Workloads
from ntp_opt.planners.multi import solve_multi
from ntp_opt.rules.multi import MultiEvaluation
from ntp_opt.workflows.multi.static import solve_static

HERE = Path(__file__).resolve().parent
DEFAULT_TABLE = HERE / "results.md"

#: (name, throughput per degree, weight, share of the serving GPUs, min replicas, min fraction)
FLEETS = (
    ("chat", {4: 3.5, 8: 6.5}, 1.0, 0.45, 4, 0.0),
    ("agents", {2: 1.9, 4: 3.5}, 2.0, 0.30, 0, 0.5),
    ("embed", {1: 1.0, 2: 1.9}, 0.5, 0.25, 0, 0.0),
)
#: cluster kind -> (domains, training DP replicas)
CLUSTERS = {"nvl32": (128, 24), "nvl72": (57, 20)}
PP = 4
LOCAL_BATCH = 8


def build(kind: str, fraction: float, load: float, seed: int, stragglers: int = 0) -> MultiInstance:
    """One benchmark instance (see the module docstring)."""
    domains, dp = CLUSTERS[kind]
    g = topology.nvl32(domains) if kind == "nvl32" else topology.gb200_nvl72(domains)
    size = 32 if kind == "nvl32" else 72
    if fraction > 0:
        topology.fail_random(g, fraction=fraction, seed=seed)
    if stragglers:
        topology.add_stragglers(g, count=stragglers, speed=(0.7, 0.95), seed=seed + 1)
    job = Job(tp=32, tp_allowed=(28, 30, 32), pp=PP, dp=dp, global_batch=dp * LOCAL_BATCH)
    inst = Instance(f"multi-{kind}-{fraction:g}-load{load:g}-s{seed}", g, job)
    per_domain = size // job.tp
    train_domains = math.ceil(dp * PP / per_domain)
    serving_gpus = (domains - train_domains) * size
    fleets = []
    for name, rates, weight, share, min_rep, min_frac in FLEETS:
        best = max(r / t for t, r in rates.items())
        demand = round(share * load * serving_gpus * best, 1)
        fleets.append(
            ServingWorkload(
                name=name,
                throughput=rates,
                demand=demand,
                weight=weight,
                min_replicas=min_rep,
                min_fraction=min_frac,
            )
        )
    return MultiInstance(inst, Workloads(training_weight=1.0, serving=tuple(fleets)))


def _shares(ev: MultiEvaluation) -> str:
    parts = [f"T {ev.training.relative_goodput:.3f}"]
    parts += [f"{name} {f.served:.3f}" for name, f in ev.fleets.items()]
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default="nvl32,nvl72")
    ap.add_argument("--fractions", default="0.001,0.002,0.004")
    ap.add_argument("--loads", default="1.0,1.1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument(
        "--stragglers", type=int, default=0, help="healthy GPUs slowed to 0.7-0.95 at random"
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_TABLE)
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    fractions = [float(x) for x in args.fractions.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    rows = []
    header = (
        "| cluster | failed | load | static W | milp-split W | milp W | milp / static "
        "| milp status (gap) | idle GPUs static / milp | milp shares (training rel., served) "
        "| milp s (CPU s) |"
    )
    sep = "|" + "---|" * (header.count("|") - 1)
    for kind in kinds:
        for fraction in fractions:
            for load in loads:
                multi = build(kind, fraction, load, args.seed, args.stragglers)
                t0 = time.perf_counter()
                _, st = solve_static(multi, time_limit=args.time_limit, seed=args.seed)
                t1 = time.perf_counter()
                split = solve_multi(
                    multi, time_limit=args.time_limit, seed=args.seed, share_domains=False
                )
                c0 = time.process_time()
                full = solve_multi(multi, time_limit=args.time_limit, seed=args.seed)
                cpu = time.process_time() - c0
                assert full.objective is not None and full.evaluation is not None
                assert split.objective is not None
                static_w = st.weighted_goodput if st.feasible else float("nan")
                ratio = full.objective / static_w if st.feasible and static_w > 0 else math.nan
                gap = full.gap
                failed = int((~multi.instance.arrays.healthy).sum())
                line = (
                    f"| {kind} ({multi.instance.arrays.n_gpus}) | {failed} ({fraction:.1%}) "
                    f"| {load:g} | {static_w:.4f}{'' if st.feasible else ' (breaks a min share)'} "
                    f"| {split.objective:.4f} | {full.objective:.4f} | {ratio:.4f} "
                    f"| {full.status} ({'no bound' if gap is None else f'{gap:.1e}'}) "
                    f"| {st.idle_healthy} / {full.evaluation.idle_healthy} "
                    f"| {_shares(full.evaluation)} | {full.runtime_s:.1f} ({cpu:.1f}) |"
                )
                rows.append(line)
                print(
                    f"{kind} failed={failed} load={load:g}: static {static_w:.4f} "
                    f"({t1 - t0:.1f}s) split {split.objective:.4f} milp {full.objective:.4f} "
                    f"[{full.status}, {full.programs} programs, {full.runtime_s:.1f}s, "
                    f"CPU {cpu:.1f}s] "
                    f"ratio {ratio:.4f}",
                    flush=True,
                )
    text = "\n".join(
        [
            "# Multi-workload plans vs static partitions",
            "",
            "Weighted goodput W = training relative goodput + chat served + 2 x agents "
            "served + 0.5 x embed served (maximum 4.5). Generated by "
            f"`python benchmarks/multi/run.py --kinds {args.kinds} --fractions "
            f"{args.fractions} --loads {args.loads} --seed {args.seed} --time-limit "
            f"{args.time_limit:g} --stragglers {args.stragglers}`; see the script's "
            "docstring for the instances. Times: wall seconds of the MILP (its CPU "
            "seconds in brackets; one HiGHS thread, on a shared 2-core machine). Gap: "
            "(bound - W) / bound; 0.0e+00 where the plan reaches the bound exactly "
            "(every fleet served in full and training at the upper bound of its step time).",
            "",
            header,
            sep,
            *rows,
            "",
        ]
    )
    atomic_write(args.out, text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
