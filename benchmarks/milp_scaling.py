"""Exact planner from 1k to 131k GPUs: CP-SAT and HiGHS side by side.

Usage::

    python benchmarks/milp_scaling.py [--time-limit 60] [--sizes 1k,4k,32k]
                                      [--policy fixed|elastic] [--backends cpsat,highs]
    python benchmarks/milp_scaling.py --policy elastic --sizes 32k,128k --failed 0.001
    python benchmarks/milp_scaling.py --files instances/paper-nvl32-32k-0.1pct.json.gz,...

For NVL32 (TP32, PP8) and GB200 NVL72 (TP64, PP4) clusters of about 1k, 4k,
32k, 64k and 128k GPUs (``--sizes``; ``elastic`` is elastic with power boost,
the jobs' default ``max_boost = 0.3``) with 0.1 % and 1 % failed GPUs and
0.05 % stragglers (seeded), it prints one row per instance: the ``ntp``
heuristic's relative goodput, the ``fast`` planner's (with its gap to its own
bound and its time), and for each backend the exact planner's relative goodput, relative bound, gap,
status, wall and CPU time, and the ratio optimum / ntp measured in the same
run. ``--files`` runs instance files (each with its own job) instead.
Figures are relative goodput (1.0 = the job with no failures).
"""

from __future__ import annotations

import argparse
import time

from ntp_opt import Instance, Job, solve
from ntp_opt.model import topology

SIZES = {
    "1k": (32, 16),
    "4k": (128, 64),
    "32k": (1024, 448),
    "64k": (2048, 910),
    "128k": (4096, 1820),
}  # NVL32 domains, NVL72 racks


def make(kind: str, size: str, failed: float, policy: str, seed: int = 1) -> Instance:
    """One benchmark instance (deterministic for a seed)."""
    n32, n72 = SIZES[size]
    if kind == "nvl32":
        g = topology.nvl32(n32, rack_power_factor=1.3)
        tp, pp, domains = 32, 8, n32
    else:
        g = topology.gb200_nvl72(n72)
        tp, pp, domains = 64, 4, n72
    topology.fail_random(g, fraction=failed, seed=seed)
    n = len(topology.gpus(g))
    topology.add_stragglers(g, count=max(1, round(0.0005 * n)), speed=(0.8, 0.95), seed=seed + 1)
    dp = domains // pp
    job = Job(tp=tp, pp=pp, dp=dp, global_batch=16 * dp, batch_policy=policy)
    return Instance(f"{kind}-{size}-{failed * 100:g}pct", g, job)


def main() -> None:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--sizes", default="1k,4k,32k")
    ap.add_argument("--failed", default="0.001,0.01")
    ap.add_argument("--kinds", default="nvl32,nvl72")
    ap.add_argument("--policy", default="fixed", choices=["fixed", "elastic"])
    ap.add_argument("--backends", default="cpsat,highs")
    ap.add_argument(
        "--files",
        default="",
        help="comma-separated instance files to run instead of the generated shapes "
        "(their own policy; e.g. the library's elastic-with-boost instances at 32k-131k)",
    )
    args = ap.parse_args()
    backends = args.backends.split(",")
    head = ["instance", "GPUs", "failed", "ntp", "fast", "fast gap", "fast s"]
    for b in backends:
        head += [f"{b} rel", f"{b} bound", f"{b} gap", f"{b} status", f"{b} s", f"{b} cpu s"]
        head += [f"{b}/ntp"]
    policy = "of each file" if args.files else args.policy
    print(f"policy {policy}, time limit {args.time_limit:g} s (wall), threads 1")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    if args.files:
        from ntp_opt import load_instance

        todo = [lambda path=path: load_instance(path) for path in args.files.split(",")]
    else:
        todo = [
            lambda kind=kind, size=size, failed=failed: make(kind, size, failed, args.policy)
            for size in args.sizes.split(",")
            for kind in args.kinds.split(",")
            for failed in (float(f) for f in args.failed.split(","))
        ]
    for load in todo:
        inst = load()
        s = inst.summary()
        ntp = solve(inst, "ntp")
        fast = solve(inst, "fast")
        row = [inst.name, str(s["gpus"]), str(s["failed"]), f"{ntp.relative_objective:.6f}"]
        row += [
            f"{fast.relative_objective or 0.0:.6f}",
            f"{fast.gap or 0.0:.1e}",
            f"{fast.runtime_s:.2f}",
        ]
        for b in backends:
            start, cpu = time.perf_counter(), time.process_time()
            res = solve(inst, b, time_limit=args.time_limit)
            wall = time.perf_counter() - start
            cpu = time.process_time() - cpu
            rel = res.relative_objective or 0.0
            # relative = absolute / the job's nominal goodput (the plan's own ratio)
            scale = rel / res.objective if res.objective else inst.job.seq_time_s / inst.job.dp
            bound = "-" if res.bound is None else f"{res.bound * scale:.6f}"
            gap = "-" if res.gap is None else f"{res.gap:.1e}"
            ratio = rel / ntp.relative_objective if ntp.relative_objective else float("inf")
            status = str(res.status) + ("" if res.limit == "none" else "*")
            row += [f"{rel:.6f}", bound, gap, status, f"{wall:.1f}", f"{cpu:.1f}", f"{ratio:.4f}"]
        print("| " + " | ".join(row) + " |", flush=True)
    print("\n* stopped by the time limit")


if __name__ == "__main__":
    main()
