"""The ``ntp-opt bench`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Literal

from rich.console import Console

from ntp_opt.model.echo import echo
from ntp_opt.solve import POLICIES


def run(args: argparse.Namespace) -> int:
    from ntp_opt.app.bench import run_bench, summary, update_best_known

    planners = args.planners.split(",") if args.planners else list(POLICIES)
    seeds = [int(x) for x in args.seeds.split(",")]
    timeout = args.timeout if args.timeout is not None else args.time_limit + 60.0
    best_known: Path | Literal["auto"] | None = (
        None if args.no_best_known else Path(args.best_known) if args.best_known else "auto"
    )
    workers = args.workers if args.workers is not None else (None if args.backend == "ray" else 1)
    if args.backend == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ValueError("--backend ray needs ray: pip install 'ntp-opt[ray]'") from None
    rows = run_bench(
        [Path(p) for p in args.paths],
        planners,
        seeds,
        Path(args.output),
        time_limit=args.time_limit,
        timeout=timeout,
        workers=workers,
        progress=not args.quiet and Console(stderr=True).is_terminal,
        backend=args.backend,
        ray_address=args.ray_address,
        best_known=None,
    )
    print(summary(rows))
    print(f"wrote {echo(Path(args.output) / 'results.jsonl')}, summary.md and plots")
    if best_known is not None:
        for table, changes in update_best_known(rows, best_known).items():
            print(f"{table}: {len(changes)} improvement{'s' if len(changes) != 1 else ''}")
            for line in changes:
                print(f"  {line}")
    return 0


def add_parser(sub: Any) -> None:
    """The ``ntp-opt bench`` subcommand."""
    b = sub.add_parser("bench", help="run planners x seeds on many instances; resumable")
    b.add_argument("paths", nargs="+", help="instance files or directories of them")
    b.add_argument("--planners", help=f"comma-separated (default {','.join(POLICIES)})")
    b.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")
    b.add_argument("-o", "--output", default="bench-results", help="output directory")
    b.add_argument(
        "--time-limit", type=float, default=30.0, help="seconds per exact solve (default 30)"
    )
    b.add_argument(
        "--timeout", type=float, help="hard seconds per run, then killed (default time limit + 60)"
    )
    b.add_argument(
        "--workers",
        type=int,
        help="runs in flight at once (default 1; with --backend ray the cluster's CPUs)",
    )
    b.add_argument(
        "--backend",
        choices=["process", "ray"],
        default="process",
        help="local process pool (default) or a Ray cluster (needs ntp-opt[ray])",
    )
    b.add_argument(
        "--ray-address",
        help="ray.init address for --backend ray ('auto': this machine's cluster; "
        "default: a new local Ray)",
    )
    bk = b.add_mutually_exclusive_group()
    bk.add_argument(
        "--best-known",
        metavar="PATH",
        help="best-known table to update (default: best_known.json beside the instance "
        "files or one folder up, e.g. instances/best_known.json, if it exists)",
    )
    bk.add_argument(
        "--no-best-known", action="store_true", help="do not update any best-known table"
    )
    b.set_defaults(func=run)
