"""The gap table of issue 31: ``solve(inst, "risk-aware", time_limit=60, threads=1)``.

Usage::

    python benchmarks/risk/gaps.py [--time-limit 60] [--only NAME ...]

Instances: the built ``pack``, ``mixed``, ``mixed-fixed`` and ``mixed-large``
(``ntp_opt.model.risk_instances``) and ``nvl32-256-pfail``, a generated
256-GPU NVL32 cluster with per-GPU ``p_fail`` (:func:`generated`, the same as
``ntp-opt gen --builder nvl32 --gpus 256 --tp 32 --pp 2 --dp 3 --p-fail 0.002``);
``--only nvl32-512-tray nvl32-1024-pfail`` runs two more generated clusters
(per-tray and per-GPU ``p_fail``).
Prints one Markdown row per instance: the gap, the expected objective, its
bound, the status and the CPU and wall seconds (the machine may be shared).
The measured tables, before and after issue 31, are in ``gaps.md``.
"""

from __future__ import annotations

import argparse
import time

from ntp_opt import Instance, Job, solve, topology
from ntp_opt.model.risk_instances import risk_instance

BUILT = ("pack", "mixed", "mixed-fixed", "mixed-large")


def generated() -> Instance:
    """256 GPUs in 8 NVL32 domains, every GPU ``p_fail`` 0.002; TP32, PP2, DP3 (2 spare domains)."""
    cluster = topology.nvl32(8)
    topology.set_p_fail(cluster, 0.002)
    job = Job(tp=32, pp=2, dp=3, global_batch=48, batch_policy="elastic")
    return Instance("nvl32-256-pfail", cluster, job)


def tray_512() -> Instance:
    """512 GPUs in 16 NVL32 domains, every tray ``p_fail`` 0.01; TP32, PP2, DP6 (4 spare)."""
    cluster = topology.nvl32(16)
    topology.set_p_fail(cluster, 0.01, topology.trays(cluster))
    job = Job(tp=32, pp=2, dp=6, global_batch=96, batch_policy="elastic")
    return Instance("nvl32-512-tray", cluster, job)


def gpu_1024() -> Instance:
    """1,024 GPUs in 32 NVL32 domains, every GPU ``p_fail`` 0.001; TP32, PP4, DP6 (8 spare)."""
    cluster = topology.nvl32(32)
    topology.set_p_fail(cluster, 0.001)
    job = Job(tp=32, pp=4, dp=6, global_batch=96, batch_policy="elastic")
    return Instance("nvl32-1024-pfail", cluster, job)


#: The generated instances by name (only the first is in the default table).
GENERATED = {"nvl32-256-pfail": generated, "nvl32-512-tray": tray_512, "nvl32-1024-pfail": gpu_1024}


def main() -> None:
    """Run the table."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--only", nargs="*", default=None)
    args = p.parse_args()
    names = [*BUILT, *GENERATED]
    print("| instance | gap | expected objective | bound | status | CPU s | wall s |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        if (args.only and name not in args.only) or (
            not args.only and name in GENERATED and name != "nvl32-256-pfail"
        ):
            continue
        inst = GENERATED[name]() if name in GENERATED else risk_instance(name)
        c0, w0 = time.process_time(), time.perf_counter()
        res = solve(inst, "risk-aware", time_limit=args.time_limit, threads=1)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        bound = "none" if res.bound is None else f"{res.bound:.6f}"
        gap = "inf (no bound)" if res.gap is None else f"{res.gap:.2e}"
        print(
            f"| {name} | {gap} | {res.expected_objective:.6f} | {bound} "
            f"| {res.status} | {cpu:.1f} | {wall:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
