"""``fast`` against ``optimal``: goodput ratio and the power of equal-goodput plans.

Usage::

    python benchmarks/fast_vs_optimal.py                    # 200 random + the library
    python benchmarks/fast_vs_optimal.py --random 50 --max-gpus 4608 --time-limit 5

Random instances: the hypothesis strategy of the tests
(``tests/strategies.py``, ``instances()``: small in-scope clusters and topology
presets with failures, stragglers and budgets), drawn from ``--seed``.
Library: every ``instances/*.json(.gz)`` of at most ``--max-gpus`` GPUs.

``optimal`` runs with ``--time-limit`` seconds: where it is not proven, the
ratio is taken against its **bound** too (``fast / bound``, a lower bound on
the true ratio) and the row says so. Printed: the distribution (min, 1st
percentile, median, share >= 0.99) of ``fast / optimal``, the cases where
``fast`` pauses while ``optimal`` runs, and, on the library, the site power
(kW) of ``ntp-pw``, ``fast`` and ``optimal`` with their relative goodput (the
power is comparable where the goodputs are equal).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ntp_opt.model.files import load_instance  # noqa: E402
from ntp_opt.solve import solve  # noqa: E402


def _random(n: int, seed: int) -> list:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.strategies import instances

    out: list = []

    @settings(
        max_examples=n,
        database=None,
        derandomize=True,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(instances(), st.just(seed))
    def draw(inst, _seed):
        if len(out) < n:
            out.append(inst)

    draw()
    return out


def _optimal(inst, time_limit: float):
    """``optimal``'s result; an exception of the exact planner (a deadline reached
    while building a program, on a shared machine) is said and tried once more with
    twice the time, then the instance is left out (``None``)."""
    for limit in (time_limit, 2 * time_limit):
        try:
            return solve(inst, "optimal", time_limit=limit)
        except Exception as err:
            print(f"optimal failed on {inst.name} ({limit:g} s): {type(err).__name__}: {err}")
    return None


def _row(inst, time_limit: float) -> dict | None:
    best = _optimal(inst, time_limit)
    if best is None:
        return None
    fast = solve(inst, "fast")
    pw = solve(inst, "ntp-pw")
    opt = best.objective or 0.0
    ref = opt if best.status == "optimal" else (best.bound or opt)
    f = fast.objective or 0.0
    return {
        "name": inst.name,
        "gpus": inst.arrays.n_gpus,
        "status": str(best.status),
        "opt": opt,
        "bound": best.bound,
        "fast": f,
        "ratio": (f / opt) if opt > 0 else (1.0 if f == 0 else float("inf")),
        "ratio_bound": (f / ref) if ref and ref > 0 else 1.0,
        "paused": opt > 0 and not (fast.plan is not None and fast.plan.replicas),
        "rel": (best.relative_objective, fast.relative_objective, pw.relative_objective),
        "kw": tuple(
            (r.evaluation.site_power_w / 1000 if r.evaluation is not None else float("nan"))
            for r in (best, fast, pw)
        ),
    }


def _more_watts(row: dict, i: int) -> bool:
    """Does planner ``i`` (1 fast, 2 ntp-pw) draw more site power than ``optimal``
    for no more goodput (a plan that spends watts for nothing)?"""
    rel, kw = row["rel"], row["kw"]
    if rel[i] is None or rel[0] is None or not np.isfinite(kw[i]) or not np.isfinite(kw[0]):
        return False
    return bool(kw[i] > kw[0] * (1 + 1e-9) and rel[i] <= rel[0] * (1 + 1e-9))


def _summary(rows: list[dict], label: str) -> None:
    r = np.array([x["ratio"] for x in rows if x["opt"] > 0])
    rb = np.array([x["ratio_bound"] for x in rows if x["opt"] > 0])
    unproven = sum(1 for x in rows if x["status"] != "optimal")
    print(f"\n{label}: {len(rows)} instances ({unproven} not proven by optimal)")
    if len(r):
        print(
            f"fast/optimal: min {r.min():.4f}, p1 {np.percentile(r, 1):.4f}, "
            f"median {np.median(r):.4f}, >= 0.99: {np.mean(r >= 0.99):.1%}, "
            f">= 0.999: {np.mean(r >= 0.999):.1%}"
        )
        print(f"fast/bound (optimal's bound where unproven): min {rb.min():.4f}")
    paused = [x["name"] for x in rows if x["paused"]]
    print(f"fast paused where optimal runs: {len(paused)} {paused[:5]}")
    for i, who in ((1, "fast"), (2, "ntp-pw")):
        more = [x["name"] for x in rows if _more_watts(x, i)]
        print(f"{who} spends more kW than optimal at <= its goodput: {len(more)} {more[:5]}")
    worst = sorted((x for x in rows if x["opt"] > 0), key=lambda x: x["ratio"])[:5]
    for x in worst:
        print(f"  worst: {x['name']} ({x['gpus']} GPUs) {x['ratio']:.4f} [{x['status']}]")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-gpus", type=int, default=4608)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--no-library", action="store_true")
    args = ap.parse_args(argv)
    if args.random:
        drawn = [_row(inst, args.time_limit) for inst in _random(args.random, args.seed)]
        rows = [x for x in drawn if x is not None]
        if len(rows) < len(drawn):
            print(f"left out (optimal failed twice): {len(drawn) - len(rows)}")
        _summary(rows, "random instances (tests/strategies.py)")
    if not args.no_library:
        lib = []
        for p in sorted((ROOT / "instances").glob("*.json*")):
            if p.name in ("best_known.json",):
                continue
            try:
                inst = load_instance(p)
            except Exception as err:  # not an instance file
                print(f"skip {p.name}: {str(err).splitlines()[0]}")
                continue
            if inst.arrays.n_gpus > args.max_gpus:
                continue
            x = _row(inst, args.time_limit)
            if x is None:
                continue
            lib.append(x)
            print(
                f"| {x['name']} | {x['gpus']} | {x['status']} | "
                + " | ".join(f"{v:.4f}" if v is not None else "-" for v in x["rel"])
                + " | "
                + " | ".join(f"{v:.1f}" for v in x["kw"])
                + f" | {x['ratio']:.4f} |",
                flush=True,
            )
        print(
            "columns: instance | GPUs | optimal status | rel. goodput optimal, fast, ntp-pw"
            " | site kW optimal, fast, ntp-pw | fast/optimal"
        )
        _summary(lib, "library (instances/)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
