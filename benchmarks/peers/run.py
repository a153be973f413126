"""Peer baselines side by side: Megatron-LM's NTP defaults and a Malleus-style batch ILP.

Usage::

    python benchmarks/peers/run.py [--time-limit 30]

Part 1 loads the paper's 32k-GPU NVL32 instances (0.1 % and 0.4 % failed)
and the GB200 NVL72 instance and prints the relative goodput (1.0 = the job
with no failures) of ``dp-drop`` (for reference), ``megatron-ntp`` (as
launched and re-ordered), ``ntp``, ``ntp-pw`` and ``optimal`` (stopped after
``--time-limit`` seconds; its status and gap are printed).

Where ``megatron-ntp`` (or ``-reordered``) rounds Megatron's own reduced
degree down to an allowed one, an extra row ``... (own degree)`` shows what Megatron's
rule alone would run (the job's ``tp_allowed`` relaxed to every degree from
``tp_min`` to ``T``): the cost of the rounding.

Part 2 compares the batch split alone: at dp = 16, 64, 256 and 1024 replicas
with 8 micro-batches each (N = 8 dp) and per-micro-batch times ``o_i = 32 / t``
for replicas at TP ``t`` of 32 (seeded random mixes: TP28 and TP30 half each;
then 3/4 of the replicas at TP32 with 1/8 at TP30 and 1/8 at TP28): the
corrected re-implementation of Malleus's ILP (PuLP + CBC, ``m_i >= 1``, time
limit ``--time-limit``), the ILP as the released code solves and applies it
(``m_i >= 4`` stages, counts read in variable-name order; stopped at the same
limit, which the released code does not set), and this project's exact split:
time, objective ``max_i o_i m_i`` (for the released code: reported and
applied), whether each proved optimality. Takes 4-8 minutes with the default
limit.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from ntp_opt import load_instance, solve
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.planners.peers import malleus_split, malleus_split_as_shipped, our_split

ROOT = Path(__file__).resolve().parents[2]
INSTANCES = (
    "paper-nvl32-32k-0.1pct.json.gz",
    "paper-nvl32-32k-0.4pct.json.gz",
    "gb200-nvl72-9k-trays.json.gz",
)
POLICIES = ("dp-drop", "megatron-ntp", "megatron-ntp-reordered", "ntp", "ntp-pw", "optimal")
DP_SIZES = (16, 64, 256, 1024)
MICRO_PER_REPLICA = 8
STAGES = 4  # stages per pipeline: the released ILP's lower bound on m_i


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(head: list[str]) -> None:
    print(_row(head))
    print("|" + "|".join("---" for _ in head) + "|")


def _degrees(allowed: tuple[int, ...]) -> str:
    if list(allowed) == list(range(allowed[0], allowed[-1] + 1)) and len(allowed) > 3:
        return f"{allowed[0]}-{allowed[-1]}"
    return ",".join(map(str, allowed))


def goodput_tables(time_limit: float) -> None:
    """Part 1: relative goodput of every policy on the bundled instances."""
    for name in INSTANCES:
        inst = load_instance(ROOT / "instances" / name)
        s = inst.summary()
        job = inst.job
        print(
            f"\n### {s['name']}: {s['gpus']:,} GPUs, {s['failed']} failed, "
            f"{s['stragglers']} stragglers; TP{job.tp} (allowed {_degrees(job.allowed)}), "
            f"PP{job.pp}, DP{job.dp}, B={job.global_batch}, {job.batch_policy}\n"
        )
        _table(
            [
                "policy",
                "relative goodput",
                "replicas",
                "reduced",
                "TP degrees",
                "status",
                "gap",
                "s",
            ]
        )
        for policy in POLICIES:
            res = solve(inst, policy, time_limit=time_limit)
            ev = res.evaluation
            assert res.plan is not None and ev is not None and ev.feasible
            degrees = sorted({r.tp for r in res.plan.replicas}, reverse=True)
            gap = "" if res.gap is None else f"{res.gap:.2%}"
            status = str(res.status) + ("" if res.limit == "none" else f" ({res.limit})")
            if res.plan.metrics.get("paused"):
                status += ", paused"
            cells = [
                policy,
                f"{res.relative_objective:.4f}",
                str(ev.n_replicas),
                str(ev.n_reduced),
                ",".join(map(str, degrees)) or "-",
                status,
                gap,
                f"{res.runtime_s:.2f}",
            ]
            print(_row(cells), flush=True)
            if policy.startswith("megatron-ntp"):
                own_row(inst, policy, res.relative_objective, degrees)


def own_row(inst: Instance, policy: str, rounded: float, degrees: list[int]) -> None:
    """``policy`` with every degree from ``tp_min`` to ``T`` allowed, if its degrees differ."""
    job = inst.job
    free = tuple(range(job.min_tp, job.tp + 1))
    if tuple(job.allowed) == free:
        return
    relaxed = Instance(
        inst.name,
        inst.cluster,
        Job(**{**job.model_dump(), "tp_allowed": free}),
        inst.meta,
        copy_graph=False,
    )
    res = solve(relaxed, policy)
    ev = res.evaluation
    assert res.plan is not None and ev is not None and ev.feasible
    own = sorted({r.tp for r in res.plan.replicas}, reverse=True)
    if own == degrees:
        return
    cells = [
        f"{policy} (own degree)",
        f"{res.relative_objective:.4f}",
        str(ev.n_replicas),
        str(ev.n_reduced),
        ",".join(map(str, own)) or "-",
        f"TP{min(own)} not in tp_allowed; rounding costs "
        f"{100 * (res.relative_objective - rounded):.1f} points",
        "",
        f"{res.runtime_s:.2f}",
    ]
    print(_row(cells), flush=True)


#: Replica mixes for the batch split: name -> (o_i choices, weights). o = 32 / t for a
#: replica at TP t of 32 (throughput proportional to GPUs).
MIXES: dict[str, tuple[tuple[float, ...], tuple[int, ...]]] = {
    "TP28 and TP30 replicas, half each": ((32 / 28, 32 / 30), (1, 1)),
    "3/4 of the replicas at TP32, 1/8 at TP30, 1/8 at TP28": ((1.0, 32 / 30, 32 / 28), (6, 1, 1)),
}


def split_table(time_limit: float, seed: int = 0) -> None:
    """Part 2: the batch split alone: corrected ILP, released ILP, ours."""
    for title, (choices, weights) in MIXES.items():
        print(
            f"\n### Batch split, {title} (seeded random mix): {MICRO_PER_REPLICA} micro-batches "
            f"per replica, o_i = 32 / TP, {STAGES} stages, CBC time limit {time_limit:g} s\n"
        )
        _table(
            [
                "dp",
                "N",
                "TP32/30/28",
                "corrected ILP s",
                "corrected objective",
                "proven",
                "released ILP s",
                "released reported",
                "released applied",
                "applied / reported",
                "ours s",
                "ours objective",
                "corrected/ours time",
            ]
        )
        for dp in DP_SIZES:
            rng = random.Random(seed + dp)
            times = rng.choices(choices, weights=weights, k=dp)
            n_total = MICRO_PER_REPLICA * dp
            ilp = malleus_split(times, n_total, time_limit=time_limit)
            shipped = malleus_split_as_shipped(times, n_total, STAGES, time_limit=time_limit)
            ours = our_split(times, n_total)
            assert ours.objective <= ilp.objective * (1 + 1e-9)
            counts = "/".join(str(sum(1 for o in times if o == 32 / t)) for t in (32, 30, 28))
            if shipped.m:
                rep = f"{shipped.reported:.6f}" + ("" if shipped.proven else " (unproven)")
                app = f"{shipped.applied:.6f}"
                ratio = f"{shipped.applied / shipped.reported:.4f}"
            else:
                rep, app, ratio = "no solution", "-", "-"
            print(
                _row(
                    [
                        str(dp),
                        str(n_total),
                        counts,
                        f"{ilp.seconds:.2f}",
                        f"{ilp.objective:.6f}" if ilp.m else "no solution",
                        "yes" if ilp.proven else "no",
                        f"{shipped.seconds:.2f}",
                        rep,
                        app,
                        ratio,
                        f"{ours.seconds:.4f}",
                        f"{ours.objective:.6f}",
                        f"{ilp.seconds / max(ours.seconds, 1e-9):.0f}x",
                    ]
                ),
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    """Run both parts and print markdown tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--time-limit",
        type=float,
        default=30.0,
        help="seconds for the exact planner and for CBC (default 30)",
    )
    args = ap.parse_args(argv)
    start = time.perf_counter()
    print(f"## Peer baselines (time limit {args.time_limit:g} s, threads 1)")
    goodput_tables(args.time_limit)
    split_table(args.time_limit)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
