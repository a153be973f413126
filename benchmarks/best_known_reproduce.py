"""Re-run the planner that produced each value of ``instances/best_known.json`` and compare.

Usage: ``python benchmarks/best_known_reproduce.py [--time-limit S] [--max-gpus N]``.

For each bundled instance whose file is present, runs ``goodput_planner`` (seed
``goodput_seed``) and, when different, ``bound_planner``, and prints the value
found next to the stored one. Heuristics and ``fast`` are deterministic and
must reproduce to the last digit; exact planners must reach the stored
goodput (they proved it, or found it within their limit) within ``1e-9``
relative, unless their time limit stopped them (a run shorter than the
stored one may end with a weaker bound). Exits 1 if any other value is worse.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ntp_opt import Limit, load_instance, solve
from ntp_opt.rules.goodput import relative_goodput

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    """Run the check; print one line per planner run."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=60.0, help="exact planners, s")
    ap.add_argument("--max-gpus", type=int, default=10**9, help="skip larger instances")
    args = ap.parse_args()
    table = json.loads((ROOT / "instances" / "best_known.json").read_text())["instances"]
    worse = 0
    for name, entry in table.items():
        path = ROOT / "instances" / entry["file"]
        if not path.exists() or entry["gpus"] > args.max_gpus:
            continue
        instance = load_instance(path)
        runs = {(entry["goodput_planner"], "goodput", entry["goodput"])}
        if entry.get("bound_planner") and entry["bound_planner"] != entry["goodput_planner"]:
            runs.add((entry["bound_planner"], "bound", entry["bound"]))
        for planner, what, stored in sorted(runs):
            res = solve(
                instance,
                planner,
                time_limit=args.time_limit,
                seed=int(entry.get("goodput_seed", 0)),
            )
            found = res.relative_objective if what == "goodput" else None
            if what == "bound" and res.bound is not None:
                found = relative_goodput(instance.job, res.bound)
            ok = found is not None and (
                found >= stored * (1 - 1e-9) if what == "goodput" else found <= stored * (1 + 1e-9)
            )
            same = found is not None and abs(found - stored) <= 1e-9 * max(1.0, abs(stored))
            worse += not ok
            if not ok and res.limit == Limit.TIME:  # a shorter run than the stored one
                worse -= 1
                mark = "short of it at the time limit"
            else:
                mark = "same" if same else ("better" if ok else "WORSE")
            print(
                f"{name:40s} {planner:16s} {what:7s} stored {stored:.9f} "
                f"now {found if found is None else format(found, '.9f')} {mark} ({res.status})",
                flush=True,
            )
    print(f"{worse} value(s) worse than stored")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
