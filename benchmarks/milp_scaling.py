"""Exact planner from 1k to 131k GPUs: CP-SAT and HiGHS side by side.

Usage::

    python benchmarks/milp_scaling.py [--time-limit 60] [--sizes 1k,4k,32k]
                                      [--policy fixed|elastic] [--backends cpsat,highs]
    python benchmarks/milp_scaling.py --policy elastic --sizes 32k,128k --failed 0.001
    python benchmarks/milp_scaling.py --files instances/paper-nvl32-32k-0.1pct.json.gz,...
    python benchmarks/milp_scaling.py --files instances/large/nvl32-128k-0.1pct-fixed.json.gz \
                                      --policy elastic --backends cpsat
    python benchmarks/milp_scaling.py --grid [--grid-sizes 9k,32k] [--tps 8,16]
                                      [--policies fixed,elastic] [--grid-failed 0.001,0.004]

For NVL32 (TP32, PP8) and GB200 NVL72 (TP64, PP4) clusters of about 1k, 4k,
32k, 64k and 128k GPUs (``--sizes``; ``elastic`` is elastic with power boost,
the jobs' default ``max_boost = 0.3``) with 0.1 % and 1 % failed GPUs and
0.05 % stragglers (seeded), it prints one row per instance: the ``ntp``
heuristic's relative goodput, the ``fast`` planner's (with its gap to its own
bound and its time), and for each backend the exact planner's relative goodput, relative bound, gap,
status, wall and CPU time, and the ratio optimum / ntp measured in the same
run. ``--files`` runs instance files (each with its own job) instead; with
``--policy`` their jobs' batch policy is replaced (the last usage line is the
131k NVL32 elastic-with-boost shape of issue 16: the library's 131k NVL32
instance, elastic).
Figures are relative goodput (1.0 = the job with no failures).

``--grid`` runs the GB200 NVL72 grid instead (issue 16: several stages per
domain): 9,216 GPUs (128 racks) and 32,256 GPUs (448 racks; ``gen`` takes
whole 72-GPU racks, so not 32,768), TP8 (nine stages per rack) and TP16
(four), PP8, ``dp`` as many as the racks hold, ``B = 16 dp``, fixed and
elastic (boost up to 1.3), 0.1 % and 0.4 % failed GPUs, seed 3 -- the
instances ``ntp-opt gen --builder nvl72 --gpus N --fail-fraction F --tp T
--pp 8 --batch-policy P --seed 3`` writes. Per instance: ``ntp-pw`` and
``optimal`` (CP-SAT, 1 thread), the bound, gap, status, CPU seconds, and
whether a plan better than ``ntp-pw`` exists: ``yes`` (by how much), ``none``
when the proven bound is within the tolerance of ``ntp-pw``'s goodput, or
``open``.
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


GRID_RACKS = {"9k": 128, "32k": 448}  # NVL72 racks: 9,216 and 32,256 GPUs


def make_grid(size: str, tp: int, failed: float, policy: str, seed: int = 3) -> Instance:
    """One NVL72 grid instance, as ``ntp-opt gen --builder nvl72 --gpus N
    --fail-fraction F --tp T --pp 8 --batch-policy P --seed 3`` writes it."""
    racks = GRID_RACKS[size]
    g = topology.build("nvl72", 72 * racks)
    topology.fail_random(g, fraction=failed, seed=seed)
    pp = 8
    dp = max(1, racks * (72 // tp) // pp)
    job = Job(tp=tp, pp=pp, dp=dp, global_batch=16 * dp, batch_policy=policy)
    name = f"nvl72-{size}-tp{tp}-{failed * 100:g}pct-{policy}"
    return Instance(name, g, job, {"builder": "nvl72", "gpus": 72 * racks, "seed": seed})


def run_grid(args: argparse.Namespace) -> None:
    """The NVL72 TP8/TP16 grid: ``ntp-pw`` against ``optimal``, one row per instance."""
    head = ["instance", "GPUs", "failed", "ntp-pw", "optimal", "bound", "gap", "status"]
    head += ["CPU s", "better than ntp-pw"]
    print(f"NVL72 grid, optimal (CP-SAT), time limit {args.time_limit:g} s (wall), threads 1")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for size in args.grid_sizes.split(","):
        for tp in (int(t) for t in args.tps.split(",")):
            for policy in args.policies.split(","):
                for failed in (float(f) for f in args.grid_failed.split(",")):
                    inst = make_grid(size, tp, failed, policy)
                    s = inst.summary()
                    pw = solve(inst, "ntp-pw")
                    cpu = time.process_time()
                    res = solve(inst, "optimal", time_limit=args.time_limit, threads=1)
                    cpu = time.process_time() - cpu
                    rel = res.relative_objective or 0.0
                    scale = rel / res.objective if res.objective else 0.0
                    pw_rel = pw.relative_objective or 0.0
                    bound = None if res.bound is None else res.bound * scale
                    status = str(res.status) + ("" if res.limit == "none" else "*")
                    if rel > pw_rel * (1 + 1e-6):
                        better = f"yes, +{(rel / pw_rel - 1) * 100:.2f} %" if pw_rel else "yes"
                    elif bound is not None and bound <= pw_rel * (1 + 2e-6):
                        better = "none (bound = ntp-pw)"
                    else:
                        better = "open"
                    row = [inst.name, str(s["gpus"]), str(s["failed"]), f"{pw_rel:.6f}"]
                    row += [f"{rel:.6f}", "-" if bound is None else f"{bound:.6f}"]
                    row += ["-" if res.gap is None else f"{res.gap:.1e}", status, f"{cpu:.1f}"]
                    row += [better]
                    print("| " + " | ".join(row) + " |", flush=True)
    print("\n* stopped by the time limit")


def main() -> None:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--sizes", default="1k,4k,32k")
    ap.add_argument("--failed", default="0.001,0.01")
    ap.add_argument("--kinds", default="nvl32,nvl72")
    ap.add_argument(
        "--policy",
        default=None,
        choices=["fixed", "elastic"],
        help="batch policy (default fixed; with --files, replaces the files' own)",
    )
    ap.add_argument("--backends", default="cpsat,highs")
    ap.add_argument(
        "--files",
        default="",
        help="comma-separated instance files to run instead of the generated shapes "
        "(their own policy; e.g. the library's elastic-with-boost instances at 32k-131k)",
    )
    ap.add_argument("--grid", action="store_true", help="run the NVL72 TP8/TP16 grid")
    ap.add_argument("--grid-sizes", default="9k,32k", help="of the grid: 9k, 32k")
    ap.add_argument("--tps", default="8,16", help="of the grid: TP degrees")
    ap.add_argument("--policies", default="fixed,elastic", help="of the grid")
    ap.add_argument("--grid-failed", default="0.001,0.004", help="of the grid: failed fraction")
    args = ap.parse_args()
    if args.grid:
        run_grid(args)
        return
    backends = args.backends.split(",")
    head = ["instance", "GPUs", "failed", "ntp", "fast", "fast gap", "fast s"]
    for b in backends:
        head += [f"{b} rel", f"{b} bound", f"{b} gap", f"{b} status", f"{b} s", f"{b} cpu s"]
        head += [f"{b}/ntp"]
    policy = args.policy or ("of each file" if args.files else "fixed")
    print(f"policy {policy}, time limit {args.time_limit:g} s (wall), threads 1")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    if args.files:
        from ntp_opt import load_instance

        def load_file(path: str) -> Instance:
            inst = load_instance(path)
            if args.policy is None:
                return inst
            job = Job(**{**inst.job.model_dump(), "batch_policy": args.policy})
            return inst.with_job(job)

        todo = [lambda path=path: load_file(path) for path in args.files.split(",")]
    else:
        todo = [
            lambda kind=kind, size=size, failed=failed: make(kind, size, failed, policy)
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
