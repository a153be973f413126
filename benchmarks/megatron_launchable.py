"""What planning under every restriction of Megatron-LM's NTP runtime gains.

Usage::

    python benchmarks/megatron_launchable.py [--time-limit 10] [FILES ...]

For every instance (default: ``instances/*.json`` and ``instances/*.json.gz``)
it solves, with the same time limit each:

* the earlier ``optimal-megatron``: one reduced degree, reduced replicas
  first, but free local batches (``solve_megatron(..., one_batch=False)``);
* that plan made launchable after the fact by ``equal_batch`` (what
  ``ntp-opt export --equal-batch`` does), or why it cannot be;
* ``optimal-megatron`` as it is now: planned under one local batch (``fixed``:
  ``n b = B``; a multiple of ``micro_batch``), exported as it is;
* the unrestricted ``optimal``, for reference.

It prints one markdown table of relative goodput (1.0 = the job with no
failures); ``*`` marks a figure not proven optimal, the last columns give the
launchable plan's replicas x local batch, its status and gap. Every plan is
checked by the validator; the launchable plans also by
:func:`ntp_opt.planners.megatron.megatron_compatible` with ``uniform_batch``
(``megatron-slots`` aside: the export places inactive ranks on placeholder
hosts).
"""

from __future__ import annotations

import argparse
import glob
import time
from pathlib import Path

from ntp_opt import load_instance, solve
from ntp_opt.app.export import equal_batch, megatron_export
from ntp_opt.model.instance import Instance
from ntp_opt.planners.base import RunOptions
from ntp_opt.planners.megatron import (
    MegatronError,
    megatron_compatible,
    megatron_order,
    solve_megatron,
)
from ntp_opt.rules.validate import evaluate
from ntp_opt.solve import Result

ROOT = Path(__file__).resolve().parent.parent


def _fig(res: Result) -> str:
    if res.relative_objective is None:
        return "-"
    return f"{res.relative_objective:.4f}{'' if res.status == 'optimal' else '*'}"


def _old(inst: Instance, time_limit: float) -> tuple[str, str]:
    """The free-batch planner's figure and that plan after ``equal_batch``."""
    out = solve_megatron(inst, RunOptions(time_limit=time_limit), one_batch=False)
    assert out.plan is not None
    ev = evaluate(inst, out.plan)
    assert ev.feasible
    old = f"{ev.relative_goodput:.4f}{'' if out.proven else '*'}"
    if not out.plan.replicas:
        return old, "paused"
    batches = sorted({r.local_batch for r in out.plan.replicas})
    try:
        fixed = equal_batch(inst, megatron_order(out.plan, inst.job.tp))
    except MegatronError:
        n = len(out.plan.replicas)
        return old, f"not exportable ({inst.job.global_batch} over {n})"
    rel = evaluate(inst, fixed).relative_goodput
    return old, f"{rel:.4f}" + (" (as is)" if len(batches) == 1 else "")


def _new(inst: Instance, res: Result) -> tuple[str, str]:
    """The launchable plan's replicas x batch and its status / gap."""
    plan = res.plan
    if plan is None or not plan.replicas:
        return "paused", str(res.status)
    problems = [
        v.rule
        for v in megatron_compatible(inst, plan, uniform_batch=True)
        if v.rule != "megatron-slots"
    ]
    assert problems == [], (inst.name, problems)
    shape = f"{len(plan.replicas)} x {plan.replicas[0].local_batch}"
    gap = "" if res.gap is None else f", gap {100 * res.gap:.2f} %"
    return shape, f"{res.status}{gap}"


def _exports(inst: Instance, res: Result) -> str:
    """Whether the launchable plan exports as it is (no ``equal_batch``, no reorder).

    ``yes`` when its inactive ranks find free healthy GPUs in the cluster,
    ``torchrun`` added when every host's ranks are contiguous; otherwise the
    number of GPU slots on named hosts it needs, checked by exporting with
    that many (hosts of 8 GPUs).
    """
    plan = res.plan
    if plan is None or not plan.replicas:
        return "-"
    try:
        ex = megatron_export(inst, plan)
    except MegatronError as e:
        if [v.rule for v in e.violations] != ["megatron-placeholders"]:
            return "no: " + ", ".join(v.rule for v in e.violations)
        a = inst.arrays
        big_t, n_pp = inst.job.tp, inst.job.pp
        active = sum(n_pp * r.tp for r in plan.replicas)
        inactive = sum(n_pp * (big_t - r.tp) for r in plan.replicas)
        missing = inactive - (int(a.healthy.sum()) - active)
        hosts = [f"spare{i:03d}" for i in range(-(-missing // 8))]
        ex = megatron_export(inst, plan, placeholder_hosts=hosts, placeholder_gpus=8)
        return f"{missing} slots on named hosts" + (", torchrun" if ex.torchrun_hosts else "")
    return "yes" + (", torchrun" if ex.torchrun_hosts else "")


def main() -> None:
    """Run the comparison and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="instance files (default: the library)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per solve")
    args = ap.parse_args()
    files = args.files or sorted(
        f
        for f in glob.glob(str(ROOT / "instances" / "*.json"))
        + glob.glob(str(ROOT / "instances" / "*.json.gz"))
        if not f.endswith("best_known.json")  # the table, not an instance
    )
    tl = args.time_limit
    print(f"## optimal-megatron under one local batch (time limit {tl:g} s per solve)\n")
    print(
        "| instance | GPUs | failed | policy | B / max local | old optimal-megatron (free batches) "
        "| old + equal-batch | optimal-megatron (launchable) | replicas x batch | status "
        "| exports as is | optimal |"
    )
    print("|" + "---|" * 12)
    start = time.perf_counter()
    for path in files:
        inst = load_instance(path)
        s = inst.summary()
        job = inst.job
        old, fixed = _old(inst, tl)
        new = solve(inst, "optimal-megatron", time_limit=tl)
        free = solve(inst, "optimal", time_limit=tl)
        shape, status = _new(inst, new)
        print(
            f"| {s['name']} | {s['gpus']} | {s['failed']} | {job.batch_policy} "
            f"| {job.global_batch} / {job.local_batch_max} | {old} | {fixed} | {_fig(new)} "
            f"| {shape} | {status} | {_exports(inst, new)} | {_fig(free)} |",
            flush=True,
        )
    print(
        f"\ntotal {time.perf_counter() - start:.0f} s; * = exact planner stopped by the time "
        "limit (best plan found, not proven optimal)"
    )


if __name__ == "__main__":
    main()
