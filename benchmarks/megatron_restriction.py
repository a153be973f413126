"""What Megatron-LM's NTP runtime restriction costs: optimal against optimal-megatron.

Usage::

    python benchmarks/megatron_restriction.py [--time-limit 20] [FILES ...]

For every instance of the library (default ``instances/*.json`` and
``instances/*.json.gz``) it solves, with the same time limit each, the
unrestricted exact planner and the one restricted to plans Megatron-LM's NTP
runtime can run (one reduced TP degree, reduced replicas first), with and
without power boost, plus Megatron's out-of-the-box behaviour on a launcher
that packs failed domains first (``megatron-ntp-reordered``) for reference.
It prints one markdown table: relative goodput (1.0 = the job with no
failures) of each, ``*`` after a figure not proven optimal, the loss of the
restriction ``1 - megatron / optimal`` in percent, and the TP degrees used.
Every plan is checked by the validator (``solve`` does it) and the
restricted plans by :func:`ntp_opt.planners.megatron.megatron_compatible`.
"""

from __future__ import annotations

import argparse
import glob
import time
from pathlib import Path

from ntp_opt import load_instance, solve
from ntp_opt.planners.megatron import megatron_compatible
from ntp_opt.solve import EXACT, Result

ROOT = Path(__file__).resolve().parent.parent


def _fig(res: Result) -> str:
    if res.relative_objective is None:
        return "-"
    mark = "" if res.status == "optimal" or res.solver not in EXACT else "*"
    return f"{res.relative_objective:.4f}{mark}"


def _degrees(res: Result) -> str:
    if res.plan is None or not res.plan.replicas:
        return "-"
    return ",".join(str(t) for t in sorted({r.tp for r in res.plan.replicas}, reverse=True))


def _loss(free: Result, meg: Result) -> str:
    if not free.objective or meg.objective is None:
        return "-"
    loss = 1 - meg.objective / free.objective
    return f"{100 * loss:.2f}" if abs(loss) > 1e-9 else "0.00"  # float noise is no loss


def main() -> None:
    """Run the comparison and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="instance files (default: the library)")
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per solve")
    args = ap.parse_args()
    files = args.files or sorted(
        f
        for f in glob.glob(str(ROOT / "instances" / "*.json"))
        + glob.glob(str(ROOT / "instances" / "*.json.gz"))
        if not f.endswith("best_known.json")  # the table, not an instance
    )
    print(f"## Megatron-LM NTP restriction (time limit {args.time_limit:g} s per solve)\n")
    print(
        "| instance | GPUs | failed | TP allowed | policy | optimal | optimal-megatron "
        "| loss % | degrees opt / meg | optimal-nopower | optimal-megatron-nopower | loss % "
        "| megatron-ntp-reordered |"
    )
    print("|" + "---|" * 13)
    start = time.perf_counter()
    for path in files:
        inst = load_instance(path)
        s = inst.summary()
        kw = {"time_limit": args.time_limit}
        free = solve(inst, "optimal", **kw)
        meg = solve(inst, "optimal-megatron", **kw)
        free0 = solve(inst, "optimal-nopower", **kw)
        meg0 = solve(inst, "optimal-megatron-nopower", **kw)
        peer = solve(inst, "megatron-ntp-reordered")
        for res in (meg, meg0):
            if res.plan is not None and res.plan.replicas:
                assert megatron_compatible(inst, res.plan) == [], path
        allowed = inst.job.allowed
        print(
            f"| {s['name']} | {s['gpus']} | {s['failed']} | {allowed[0]}-{allowed[-1]} "
            f"({len(allowed)}) | {s['batch_policy']} | {_fig(free)} | {_fig(meg)} "
            f"| {_loss(free, meg)} | {_degrees(free)} / {_degrees(meg)} | {_fig(free0)} "
            f"| {_fig(meg0)} | {_loss(free0, meg0)} | {_fig(peer)} |",
            flush=True,
        )
    print(
        f"\ntotal {time.perf_counter() - start:.0f} s; * = exact planner stopped by the time "
        "limit (best plan found, not proven optimal)"
    )


if __name__ == "__main__":
    main()
