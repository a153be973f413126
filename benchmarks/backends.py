"""CP-SAT vs HiGHS vs CBC on the same formulation, over small and medium library instances.

Usage::

    python benchmarks/backends.py [--time-limit 20] [--backends cpsat,highs,cbc]
                                  [--instances a.json.gz,...] [--out benchmarks/backends.md]

The exact planners ``cpsat``, ``highs`` and ``cbc`` of :func:`ntp_opt.solve`
run the same θ-search over the same aggregated capacity program
(docs/milp.md); only the integer-programming backend differs. Every backend
gets one thread, the same seed and the same time limit, one after the other
in this one process, so the time ratios printed are measured in one run on
one machine, after each backend has solved ``tiny.json`` once (imports
and warm-up are not timed). For every instance the table gives each backend's relative
goodput (validated), whether it proved optimality (``optimal``; ``feasible*``
= stopped by the time limit or outside the exact scope, with its gap), its
wall time, and the time of each backend divided by CP-SAT's. ``≥`` marks a
ratio whose numerator hit the time limit. With ``--out`` the output is also
written to that file (markdown).
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

from ntp_opt import __version__, solve
from ntp_opt.model.files import load_instance
from ntp_opt.model.safeio import atomic_write

HERE = Path(__file__).resolve().parent
INSTANCES = HERE.parent / "instances"

DEFAULT = (
    "tiny.json",
    "dgx-64-healthy-fixed.json.gz",
    "nvl32-64-1gpu-elastic.json.gz",
    "nvl72-72-tp72-2gpu-fixed.json.gz",
    "nvl36x2-144-tp72-tray-fixed.json.gz",
    "nvl32-256-healthy-tight-fixed.json.gz",
    "dgx-256-2gpu-elastic.json.gz",
    "nvl72-576-tp36-0.4pct-elastic.json.gz",
    "nvl32-1k-0.1pct-fixed.json.gz",
    "nvl32-1k-0.4pct-elastic.json.gz",
    "nvl36x2-1k-tp36-0.4pct-elastic.json.gz",
    "nvl32-4k-trays-fixed.json.gz",
)
"""Small and medium library instances (12 to 4,096 GPUs), both batch policies."""


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    """Run every backend on every instance and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--backends", default="cpsat,highs,cbc")
    ap.add_argument("--instances", default=",".join(DEFAULT), help="files in instances/")
    ap.add_argument("--out", type=Path, help="also write the output here (markdown)")
    args = ap.parse_args(argv)
    backends = args.backends.split(",")
    base = backends[0]
    out: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        out.append(line)

    emit("# Exact backends on the same formulation")
    emit()
    emit(
        f"`python benchmarks/backends.py --time-limit {args.time_limit:g}` — "
        f"{datetime.now(UTC):%Y-%m-%d}, ntp_opt {__version__}, Python "
        f"{platform.python_version()}, one thread per backend, seed 0, all in one run."
    )
    emit("Relative goodput (1.0 = no failures); `feasible*` = not proven (gap shown);")
    emit(f"times in seconds; ratios are time / {base} time (`≥`: the numerator hit the limit).")
    emit()
    head = ["instance", "GPUs", "policy"]
    for b in backends:
        head += [f"{b} goodput", f"{b} status", f"{b} s"]
    head += [f"{b}/{base}" for b in backends[1:]]
    emit("| " + " | ".join(head) + " |")
    emit("|---|---:|---|" + "---:|---|---:|" * len(backends) + "---:|" * (len(backends) - 1))
    ratios: dict[str, list[float]] = {b: [] for b in backends[1:]}
    finished: dict[str, list[float]] = {b: [] for b in backends[1:]}  # nobody hit the limit
    proved: dict[str, int] = dict.fromkeys(backends, 0)
    best: dict[str, int] = dict.fromkeys(backends, 0)
    names = [n for n in args.instances.split(",") if n]
    warm = load_instance(INSTANCES / "tiny.json")
    for b in backends:  # import and warm up every backend before timing anything
        solve(warm, b, time_limit=args.time_limit)
    for name in names:
        inst = load_instance(INSTANCES / name)
        s = inst.summary()
        row = [inst.name, str(s["gpus"]), str(s["batch_policy"])]
        times: dict[str, float] = {}
        limited: dict[str, bool] = {}
        values: dict[str, float] = {}
        for b in backends:
            start = time.perf_counter()
            res = solve(inst, b, time_limit=args.time_limit, seed=0, threads=1)
            times[b] = time.perf_counter() - start
            limited[b] = str(res.limit) != "none"
            values[b] = res.relative_objective or 0.0
            if res.status == "optimal":
                proved[b] += 1
                status = "optimal"
            else:
                gap = "-" if res.gap is None else f"{res.gap:.1e}"
                status = f"{res.status}* {gap}"
            row += [f"{values[b]:.6f}", status, f"{times[b]:.2f}"]
        top = max(values.values())
        for b in backends:
            best[b] += values[b] >= top - 1e-9
        for b in backends[1:]:
            ratio = times[b] / times[base]
            ratios[b].append(ratio)
            if not limited[b] and not limited[base]:
                finished[b].append(ratio)
            row.append(("≥ " if limited[b] and not limited[base] else "") + f"{ratio:.2f}")
        emit("| " + " | ".join(row) + " |")
    emit()
    n = len(names)
    for b in backends:
        emit(f"- {b}: proved optimal on {proved[b]} of {n}; best goodput on {best[b]} of {n}")
    for b in backends[1:]:
        emit(
            f"- {b}/{base} time: geometric mean {_geomean(finished[b]):.2f} over the "
            f"{len(finished[b])} instances where neither hit the time limit "
            f"({_geomean(ratios[b]):.2f} over all {n})"
        )
    if args.out:
        atomic_write(args.out, "\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
