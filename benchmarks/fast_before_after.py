"""``fast``'s CPU time at 32k-131k GPUs, two versions of the package in one run.

Usage::

    git archive <commit> ntp_opt | tar -x -C /tmp/before     # the version to compare with
    python benchmarks/fast_before_after.py /tmp/before .     # roots holding ntp_opt/

The instances are those of ``benchmarks/large.py`` (NVL32 and NVL72, 32k and
131k GPUs, generous and tight power). For each root, in turn and ``--rounds``
times, a subprocess times :func:`ntp_opt.planners.fast.plan_fast` without
validation (CPU seconds, ``time.process_time``, best of ``--repeat``) and
reports the plan's relative goodput and site power; the table keeps each
root's best time per instance over the rounds (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SPECS = [
    (kind, n if kind == "nvl32" else n // 72 * 72, policy, frac, power)
    for n in (32768, 131072)
    for kind, policy, frac, power in (
        ("nvl32", "elastic", 1e-3, "generous"),
        ("nvl32", "elastic", 4e-3, "generous"),
        ("nvl32", "fixed", 1e-3, "generous"),
        ("nvl32", "elastic", 2e-3, "tight"),
        ("nvl72", "fixed", 2e-3, "generous"),
    )
]

CHILD = """
import json, sys, time
sys.path.insert(0, {bench!r})
from large import build
from ntp_opt import evaluate
from ntp_opt.planners.fast import plan_fast
for spec in {specs!r}:
    inst = build(*spec, seed=1)
    _ = inst.arrays
    best = float("inf")
    for _ in range({repeat}):
        t = time.process_time()
        try:
            out = plan_fast(inst, validate=False)  # before the planner contract
        except TypeError:
            out = plan_fast(inst)
        plan = out[0] if isinstance(out, tuple) else out.plan
        best = min(best, time.process_time() - t)
    ev = evaluate(inst, plan)
    rel = ev.goodput * inst.job.seq_time_s / inst.job.dp
    print(json.dumps([inst.name, best, rel, ev.site_power_w / 1000]), flush=True)
"""


def run(root: Path, repeat: int) -> list[list]:
    """One subprocess on ``root``'s package: a row per instance."""
    env = {**os.environ, "PYTHONPATH": str(root.resolve())}
    code = CHILD.format(bench=str(HERE), specs=SPECS, repeat=repeat)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs=2, type=Path, help="before and after: dirs holding ntp_opt/")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    best: list[dict[str, list]] = [{}, {}]
    for _ in range(args.rounds):
        for i, root in enumerate(args.roots):
            for name, sec, rel, kw in run(root, args.repeat):
                old = best[i].get(name)
                best[i][name] = [min(sec, old[0]) if old else sec, rel, kw]
    print("| instance | before s | after s | change | before rel. | after rel. |")
    print("|---|---|---|---|---|---|")
    for name, (b, rb, _) in best[0].items():
        a, ra, _ = best[1][name]
        print(f"| {name} | {b:.3f} | {a:.3f} | {100 * (a / b - 1):+.0f} % | {rb:.5f} | {ra:.5f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
