"""Large instances: the ``fast`` planner at 32k-131k GPUs, and re-planning at 32k.

Usage::

    python benchmarks/large.py            # prints tables, writes benchmarks/large.md
    python benchmarks/large.py --quick    # 32k only, fewer events

For each instance it prints the ``fast`` planner's time (instance already
built; building and compiling the graph is reported apart), relative
goodput, proven bound and gap, and the ``ntp`` / ``ntp-pw`` heuristics'
goodput on the same instance (ratios from one run). Then single events on a
32k-GPU cluster are re-planned with :func:`ntp_opt.workflows.replan.replan`: time,
GPUs moved, and the gap of the kept plan to its bound.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from ntp_opt import Instance, Job, solve
from ntp_opt.model import topology
from ntp_opt.model.safeio import atomic_write
from ntp_opt.workflows.replan import ClusterEvent, replan

HERE = Path(__file__).resolve().parent


def build(kind: str, gpus: int, policy: str, fraction: float, power: str, seed: int) -> Instance:
    """A large instance: NVL32 (TP32 -> 30/28, PP8) or NVL72 (TP64 -> 56..64, PP4)."""
    if kind == "nvl32":
        g = topology.nvl32(gpus // 32, rack_power_factor=1.3 if power == "generous" else 1.0)
        job = Job(
            tp=32,
            tp_allowed=(28, 30, 32),
            pp=8,
            dp=gpus // 256,
            global_batch=gpus // 16,
            batch_policy=policy,
        )
    else:
        g = topology.gb200_nvl72(gpus // 72, rack_power_factor=1.3 if power == "generous" else 1.0)
        job = Job(
            tp=64, pp=4, dp=gpus // 72 // 4, global_batch=gpus // 72 // 4 * 8, batch_policy=policy
        )
    topology.fail_random(g, fraction=fraction, seed=seed)
    topology.add_stragglers(g, count=gpus // 4096, speed=(0.7, 0.95), seed=seed + 1)
    if power == "tight":
        g.graph["power_budget_w"] = 0.98 * sum(
            d.get("tdp_w", 1000.0) for _, d in g.nodes(data=True) if d.get("kind") == "gpu"
        )
    name = f"{kind}-{gpus}-{policy}-{fraction:g}-{power}"
    return Instance(name, g, job, {"seed": seed}, copy_graph=False)


def plan_rows(sizes: list[int]) -> list[str]:
    rows = [
        "| instance | GPUs | build s | fast s | fast | bound | gap % | ntp | ntp-pw "
        "| fast/ntp-pw |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    specs = []
    for n in sizes:
        specs += [
            ("nvl32", n, "elastic", 1e-3, "generous"),
            ("nvl32", n, "elastic", 4e-3, "generous"),
            ("nvl32", n, "fixed", 1e-3, "generous"),
            ("nvl32", n, "elastic", 2e-3, "tight"),
            ("nvl72", n // 72 * 72, "fixed", 2e-3, "generous"),
        ]
    for kind, n, policy, frac, power in specs:
        t = time.perf_counter()
        inst = build(kind, n, policy, frac, power, seed=1)
        _ = inst.arrays  # compile now: building is timed apart
        built = time.perf_counter() - t
        res = solve(inst, "fast")
        base = {p: solve(inst, p).relative_objective or 0.0 for p in ("ntp", "ntp-pw")}
        job = inst.job
        rel_bound = (res.bound or 0.0) * job.seq_time_s / job.dp
        rel = res.relative_objective or 0.0
        ratio = rel / base["ntp-pw"] if base["ntp-pw"] else float("nan")
        row = (
            f"| {inst.name} | {inst.arrays.n_gpus} | {built:.1f} | {res.runtime_s:.2f} | "
            f"{rel:.5f} | {rel_bound:.5f} | {100 * (res.gap or 0):.3f} | {base['ntp']:.5f} | "
            f"{base['ntp-pw']:.5f} | {ratio:.4f} |"
        )
        print(row, flush=True)
        rows.append(row)
    return rows


def replan_rows(n_events: int) -> list[str]:
    inst = build("nvl32", 32768, "elastic", 1e-3, "generous", seed=1)
    plan = solve(inst, "fast").plan
    assert plan is not None
    a = inst.arrays
    used = np.zeros(a.n_gpus, dtype=bool)
    for g in plan.used_gpus():
        used[a.gpu_index[g]] = True
    rng = np.random.default_rng(7)
    kinds = {
        "fail a used GPU": lambda: ClusterEvent(
            "fail", (a.gpu_ids[rng.choice(np.flatnonzero(used))],)
        ),
        "fail a spare GPU": lambda: ClusterEvent(
            "fail", (a.gpu_ids[rng.choice(np.flatnonzero(~used & a.healthy))],)
        ),
        "fail a tray": lambda: ClusterEvent(
            "fail", (a.tray_ids[int(rng.integers(len(a.tray_ids)))],)
        ),
        "repair a GPU": lambda: ClusterEvent(
            "repair", (a.gpu_ids[rng.choice(np.flatnonzero(~a.healthy))],)
        ),
        "new straggler (0.8)": lambda: ClusterEvent(
            "speed", (a.gpu_ids[rng.choice(np.flatnonzero(used))],), 0.8
        ),
    }
    rows = [
        "| event (32,768 GPUs) | runs | median ms | max ms | local kept | moved (median, max) "
        "| global moved (median) | gap % (max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, make in kinds.items():
        times, moved, gmoved, gaps, local = [], [], [], [], 0
        for _ in range(n_events):
            ev = make()
            if ev.kind == "fail" and any(
                not a.healthy[a.gpu_index[x]] for x in ev.nodes if x in a.gpu_index
            ):
                continue
            out = replan(inst, plan, [ev])
            times.append(1000 * out.runtime_s)
            moved.append(out.moved)
            gaps.append(100 * out.gap)
            local += out.choice == "local"
            if out.global_moved is not None:
                gmoved.append(out.global_moved)
        row = (
            f"| {label} | {len(times)} | {statistics.median(times):.0f} | {max(times):.0f} | "
            f"{local}/{len(times)} | {statistics.median(moved):.0f}, {max(moved)} | "
            f"{statistics.median(gmoved) if gmoved else '-'} | {max(gaps):.3f} |"
        )
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="32k GPUs only, 5 events per kind")
    parser.add_argument("-o", "--output", type=Path, default=HERE / "large.md")
    args = parser.parse_args()
    sizes = [32768] if args.quick else [32768, 131072]
    lines = ["# Large instances and re-planning", "", "`python benchmarks/large.py`", ""]
    lines += ["## The fast planner", "", *plan_rows(sizes), ""]
    lines += ["## Re-planning one event", "", *replan_rows(5 if args.quick else 20), ""]
    atomic_write(args.output, "\n".join(lines) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
