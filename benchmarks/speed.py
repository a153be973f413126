"""Speed against the floor: every figure next to what reading the file alone costs.

Usage::

    python benchmarks/speed.py                  # every bundled instance (and instances/large/)
    python benchmarks/speed.py --quick          # instances of at most 4,608 GPUs
    python benchmarks/speed.py --section fast   # only some sections (repeatable)
    python benchmarks/speed.py -o speed.md      # also write the tables as Markdown

The *floor* is measured in the same run, per instance: ``gzip`` decompression
plus ``json.loads`` of the same file (no program reading the instance can do
less), and once ``python -c "import numpy"`` in a subprocess (the cost of
starting any numpy program). Times are CPU seconds (``time.process_time``,
the figure the targets of issue 15 use; the machine may be shared) and wall
seconds, the best of ``--repeat`` runs.

The 32k-131k-GPU instances live in ``instances/large/`` and are generated on
demand: ``python instances/generate.py --large``.

Sections (``SECTIONS``; one function each, returning Markdown lines):

* ``fast``: per instance, the floor, :func:`ntp_opt.model.files.load_instance`
  (with the arrays compiled), and :func:`ntp_opt.planners.fast.plan_fast`
  without validation (the planner's own time, as :func:`ntp_opt.solve.solve`
  runs it), of which :func:`ntp_opt.planners.bounds.capacity.capacity_bound`.

* ``replan``: one event re-planned by a :class:`ntp_opt.workflows.replan.Replanner`
  (the running plan checked once, events applied to its layout), 20 events
  of each kind (a used GPU, a spare GPU or a tray fails, a GPU is repaired, a
  used GPU becomes a straggler), each from the same running plan
  (``commit=False``): median and max CPU ms per kind, in ``"auto"`` mode (the
  bound decides) and ``"local"`` mode (no bound), next to the floor, the
  exact batch split of the running plan's replicas alone. The events of a
  runner share what its :class:`~ntp_opt.workflows.replan_state.PlanState` keeps
  (the bound's multipliers and domain classes, the boosts' memo), as a
  scheduler's chain of events does (an early event may pay for what later
  ones reuse: it shows in the max).
  Targets (issue 15): median <= 10 ms and max <= 50 ms at 32k, median <= 30 ms
  at 131k. Instances: the
  NVL32 clusters of ``benchmarks/large.py`` at 32k and 131k GPUs (``--quick``:
  4k), where the running plan is within the tolerance of the bound, and the
  32k and 128k files of ``instances/large/`` (``"local"`` mode only: their
  ``fast`` plans are further from the bound than the tolerance, so ``"auto"``
  falls back to a global plan after every event).
  Then the chain table (issue 30): 10 used GPUs failing one after the other
  (committed), two seeds, on the 32k NVL32 cluster (``--quick``: 4k) and on
  ``instances/paper-nvl32-32k-0.1pct.json.gz`` as bundled (elastic) and with
  a fixed batch: median, p90 and max CPU ms, and how many events each path
  took (which bound decided, which plan was kept). ``benchmarks/replan_chains.py``
  runs the same chains against an older revision in the same process.

* ``cli``: per instance, ``ntp-opt solve FILE --planner fast -o plan.json`` end
  to end in a subprocess (CPU: its user + system time; peak RSS: its
  ``ru_maxrss``; both from ``os.wait4``, the child's own ``getrusage``; run it
  from outside the repository to measure the code on ``PYTHONPATH``), next
  to the floor (gunzip + ``json.loads`` of the file, plus the numpy import).
  With ``--load-file FILE`` (repeatable; e.g. a ~1M-node instance generated in
  /tmp, not bundled), also :func:`~ntp_opt.model.files.load_instance` of that
  file in a subprocess: the load's CPU and the child's peak RSS. Also, once,
  what the command costs before it reads a file: the interpreter with the
  imports of ``solve`` (``build_parser("solve")`` in a child).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from ntp_opt.model.files import load_instance
from ntp_opt.model.instance import Instance
from ntp_opt.model.safeio import atomic_write
from ntp_opt.planners.bounds import capacity_bound
from ntp_opt.planners.fast import plan_fast
from ntp_opt.rules.validate import certified

HERE = Path(__file__).resolve().parent
INSTANCES = HERE.parent / "instances"
FAST_TARGET_S = 0.3
"""``fast`` (``plan_fast`` with its bound) on every bundled instance: at most this (CPU s)."""
QUICK_GPUS = 4608
"""``--quick`` keeps the instances of at most this many GPUs."""


@dataclass
class Timing:
    """CPU and wall seconds of one measured block."""

    cpu: float = 0.0
    wall: float = 0.0


@contextmanager
def timed() -> Iterator[Timing]:
    """Measure the CPU and wall time of the block into the yielded :class:`Timing`."""
    out = Timing()
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        yield out
    finally:
        out.cpu = time.process_time() - cpu
        out.wall = time.perf_counter() - wall


def best_of(repeat: int, run: Callable[[], Any]) -> tuple[Timing, Any]:
    """The fastest of ``repeat`` runs (CPU and wall each their minimum) and the last result."""
    times, result = [], None
    for _ in range(max(1, repeat)):
        with timed() as t:
            result = run()
        times.append(t)
    return Timing(min(t.cpu for t in times), min(t.wall for t in times)), result


def numpy_import_floor(repeat: int) -> Timing:
    """CPU (user + system of the child) and wall time of ``python -c "import numpy"``."""
    cpus, walls = [], []
    for _ in range(max(1, repeat)):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import numpy"], check=True)
        walls.append(time.perf_counter() - wall)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return Timing(min(cpus), min(walls))


@dataclass
class Context:
    """What every section gets: the instance files, the options, the shared floor."""

    files: list[Path]
    quick: bool
    repeat: int
    numpy_floor: Timing
    parsed_gpus: dict[Path, int] = field(default_factory=dict)
    load_files: list[Path] = field(default_factory=list)


def read_floor(path: Path) -> tuple[Timing, Timing, Any]:
    """gunzip and ``json.loads`` of ``path`` timed apart; the parsed document."""
    raw = path.read_bytes()
    with timed() as unzip:
        text = gzip.decompress(raw) if path.suffix == ".gz" else raw
    with timed() as parse:
        doc = json.loads(text)
    return unzip, parse, doc


def gpu_count(doc: Any) -> int:
    """GPUs in a parsed instance file."""
    nodes = doc.get("cluster", {}).get("nodes", [])
    return sum(1 for n in nodes if n.get("kind") == "gpu")


def bundled_files() -> list[Path]:
    """The bundled instance files (``instances/*.json.gz``, then ``instances/large/``)."""
    return sorted(INSTANCES.glob("*.json.gz")) + sorted((INSTANCES / "large").glob("*.json.gz"))


def _fmt(t: Timing) -> str:
    return f"{t.cpu:.3f} / {t.wall:.3f}"


def fast_section(ctx: Context) -> list[str]:
    """The ``fast`` planner per instance, next to the floor of reading its file."""
    rows = [
        "| instance | GPUs | gunzip + json.loads | load | fast | of which bound "
        "| fast without bound | fast / floor | candidate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(rows), flush=True)
    worst = 0.0
    for path in ctx.files:
        unzip, parse, doc = read_floor(path)
        gpus = gpu_count(doc)
        del doc
        if ctx.quick and gpus > QUICK_GPUS:
            continue
        floor = Timing(unzip.cpu + parse.cpu, unzip.wall + parse.wall)

        def load(p: Path = path) -> Instance:
            inst = load_instance(p)
            _ = inst.arrays  # compiled here, not in the planner
            return inst

        load_t, inst = best_of(1, load)
        fast_t, out = best_of(ctx.repeat, lambda i=inst: plan_fast(i))
        plan = out.plan
        bound_t, _ = best_of(ctx.repeat, lambda i=inst: capacity_bound(i))
        worst = max(worst, fast_t.cpu)
        name = path.name.removesuffix(".json.gz")
        rows.append(
            f"| {name} | {gpus:,} | {_fmt(floor)} | {_fmt(load_t)} | {_fmt(fast_t)} "
            f"| {bound_t.cpu:.3f} | {max(fast_t.cpu - bound_t.cpu, 0.0):.3f} "
            f"| {fast_t.cpu / max(floor.cpu, 1e-9):.2f} "
            f"| {plan.metrics.get('candidate', 'paused')} |"
        )
        print(rows[-1], flush=True)
    return [
        "## `fast` (`plan_fast`, its plan not validated)",
        "",
        "CPU / wall seconds, best of "
        f"{ctx.repeat}; 'of which bound' is `capacity_bound` alone (CPU), 'fast without "
        f"bound' the difference; slowest `fast`: {worst:.3f} s CPU (target: at most "
        f"{FAST_TARGET_S} s on every bundled instance, issue 15).",
        "",
        *rows,
        "",
    ]


REPLAN_EVENTS = 20
"""Events of each kind the ``replan`` section re-plans."""


def _replan_events(
    instance: Instance, layout_gpus: Any, n: int, seed: int = 7
) -> dict[str, list[Any]]:
    """``n`` events of each kind, each valid on ``instance`` (the running plan's GPUs given)."""
    import numpy as np

    from ntp_opt.workflows.replan import ClusterEvent

    a = instance.arrays
    used = np.zeros(a.n_gpus, dtype=bool)
    used[layout_gpus] = True
    rng = np.random.default_rng(seed)
    spare = np.flatnonzero(~used & a.healthy)
    down = np.flatnonzero(~a.healthy)
    whole = [i for i in range(len(a.tray_ids)) if a.healthy[a.gpu_tray == i].all()]
    ids = a.gpu_ids
    kinds: dict[str, Callable[[], Any]] = {
        "fail a used GPU": lambda: ClusterEvent("fail", ids[rng.choice(np.flatnonzero(used))]),
        "fail a spare GPU": lambda: ClusterEvent("fail", ids[rng.choice(spare)]),
        "fail a tray": lambda: ClusterEvent("fail", a.tray_ids[whole[rng.integers(len(whole))]]),
        "repair a GPU": lambda: ClusterEvent("repair", ids[rng.choice(down)]),
        "new straggler (0.8)": lambda: ClusterEvent(
            "speed", ids[rng.choice(np.flatnonzero(used))], 0.8
        ),
    }
    possible = {
        "fail a spare GPU": len(spare),
        "repair a GPU": len(down),
        "fail a tray": len(whole),
    }
    return {k: [make() for _ in range(n)] for k, make in kinds.items() if possible.get(k, 1)}


def _replan_rows(name: str, instance: Instance, modes: tuple[str, ...], n: int) -> list[str]:
    """Rows of the ``replan`` table for one instance."""
    import statistics

    from ntp_opt.rules.goodput import split_batch
    from ntp_opt.workflows.replan import Replanner

    plan = certified(instance, plan_fast(instance).require_plan())
    rows = []
    runners = {m: Replanner(instance, plan, mode=m) for m in modes}  # type: ignore[arg-type]
    state = runners[modes[0]].state
    speeds = list(state.evaluation.replica_speeds)
    tps = state.layout.degree.tolist()
    floor, _ = best_of(3, lambda: split_batch(instance.job, speeds, tps))
    gpus = instance.arrays.n_gpus
    for kind, events in _replan_events(instance, state.layout.gpus, n).items():
        cells = []
        local = 0
        for mode in ("auto", "local"):
            if mode not in modes:
                cells.append("-")
                continue
            times = []
            for ev in events:
                cpu = time.process_time()
                out = runners[mode].replan([ev], commit=False)
                times.append(1000 * (time.process_time() - cpu))
                local += mode == "auto" and out.choice == "local"
            cells.append(f"{statistics.median(times):.1f} / {max(times):.1f}")
        kept = f"{local}/{len(events)}" if "auto" in modes else "-"
        row = (
            f"| {name} | {gpus:,} | {kind} | {' | '.join(cells)} | {kept} "
            f"| {1000 * floor.cpu:.2f} |"
        )
        print(row, flush=True)
        rows.append(row)
    return rows


CHAIN_EVENTS = 10
"""Single-GPU failures per chain in the ``replan`` section's chain table (issue 30)."""


def _chain_rows(name: str, instance: Instance, n: int, seeds: tuple[int, ...] = (7, 8)) -> str:
    """One row of the chain table: ``n`` committed single-GPU failures per seed."""
    import statistics

    import numpy as np

    from ntp_opt.workflows.replan import ClusterEvent, Replanner

    plan = certified(instance, plan_fast(instance).require_plan())
    times: list[float] = []
    paths: dict[str, int] = {}
    for seed in seeds:
        runner = Replanner(instance, plan)
        rng = np.random.default_rng(seed)
        a = instance.arrays
        for _ in range(n):
            used = np.zeros(a.n_gpus, dtype=bool)
            used[runner.state.layout.gpus] = True
            ev = ClusterEvent("fail", a.gpu_ids[int(rng.choice(np.flatnonzero(used)))])
            cpu = time.process_time()
            out = runner.replan([ev])
            times.append(1000 * (time.process_time() - cpu))
            path = f"{out.bound_kind} bound, {out.choice}"
            paths[path] = paths.get(path, 0) + 1
    times.sort()
    p90 = times[min(len(times) - 1, round(0.9 * (len(times) - 1)))]
    kinds = ", ".join(f"{k}: {v}" for k, v in sorted(paths.items()))
    row = (
        f"| {name} | {instance.job.batch_policy} | {instance.arrays.n_gpus:,} "
        f"| {statistics.median(times):.1f} / {p90:.1f} / {times[-1]:.1f} | {kinds} |"
    )
    print(row, flush=True)
    return row


def chain_rows(ctx: Context) -> list[str]:
    """The chain table: committed single-GPU failures (issue 30)."""
    from large import build

    head = [
        "| instance | batch | GPUs | median / p90 / max ms | events by path |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(head), flush=True)
    gpus = 4096 if ctx.quick else 32768
    rows = [
        _chain_rows(
            f"NVL32 (`large.py`) {gpus}",
            build("nvl32", gpus, "elastic", 1e-3, "generous", seed=1),
            CHAIN_EVENTS,
        )
    ]
    paper = HERE.parent / "instances" / "paper-nvl32-32k-0.1pct.json.gz"
    if not ctx.quick and paper.exists():
        inst = load_instance(paper)
        rows.append(_chain_rows(paper.name.removesuffix(".json.gz"), inst, CHAIN_EVENTS))
        fixed = inst.with_job(inst.job.model_copy(update={"batch_policy": "fixed"}))
        rows.append(
            _chain_rows(f"{paper.name.removesuffix('.json.gz')} (fixed)", fixed, CHAIN_EVENTS)
        )
    return [
        "### Chains of single-GPU failures (issue 30)",
        "",
        f"CPU ms per event, {CHAIN_EVENTS} used GPUs failing one after the other (each "
        "re-plan committed), two seeds, from the running `fast` plan, `auto` mode; the "
        "paths say which bound decided and which plan was kept (against an older "
        "revision: `benchmarks/replan_chains.py`).",
        "",
        *head,
        *rows,
        "",
    ]


def replan_section(ctx: Context) -> list[str]:
    """Re-planning one event with a :class:`~ntp_opt.workflows.replan.Replanner`."""
    sys.path.insert(0, str(HERE))
    from large import build  # the NVL32 clusters

    head = [
        "| instance | GPUs | event | auto: median / max ms | local: median / max ms "
        "| auto kept local | floor: batch split ms |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(head), flush=True)
    rows: list[str] = []
    sizes = [4096] if ctx.quick else [32768, 131072]
    for n in sizes:
        inst = build("nvl32", n, "elastic", 1e-3, "generous", seed=1)
        rows += _replan_rows(inst.name, inst, ("auto", "local"), REPLAN_EVENTS)
    if not ctx.quick:
        for path in ctx.files:
            if path.parent.name != "large" or not any(k in path.name for k in ("32k", "128k")):
                continue
            inst = load_instance(path)
            name = path.name.removesuffix(".json.gz")
            rows += _replan_rows(name, inst, ("local",), REPLAN_EVENTS)
    return [
        "## `replan` (one event, `Replanner`)",
        "",
        f"CPU milliseconds per event, {REPLAN_EVENTS} events of each kind, each from the "
        "running `fast` plan; the floor is the exact batch split of its replicas alone "
        "(best of 3). `auto` computes the bound incrementally where it settles the choice; "
        "`local` skips it.",
        "",
        *head,
        *rows,
        "",
        *chain_rows(ctx),
    ]


@dataclass
class ChildRun:
    """CPU seconds (user + system), wall seconds and peak RSS (MB) of one child process."""

    cpu: float
    wall: float
    rss_mb: float
    stdout: str


_LAUNCHER = """
import os, subprocess, sys, time
wall = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime,
      time.perf_counter() - wall, usage.ru_maxrss, flush=True)
"""


def run_child(args: list[str]) -> ChildRun:
    """Run ``args`` and measure that child alone (``os.wait4``: its own rusage).

    A small launcher process starts it: Linux keeps the peak RSS of the
    process a child was forked from in the child's ``ru_maxrss``, so a child
    of this (large) process would report at least this one's peak.

    The child keeps Python's bytecode cache as an installed package has it:
    ``PYTHONDONTWRITEBYTECODE`` is dropped from its environment (some sandboxes
    set it, and then every run would compile the package's sources again while
    the floor's ``import numpy`` reads numpy's cached bytecode).
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    proc = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    *lines, last = proc.stdout.splitlines() or [""]
    fields = last.split()
    if proc.returncode or len(fields) != 4 or fields[0] != "0":
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return ChildRun(float(fields[1]), float(fields[2]), int(fields[3]) / 1024, "\n".join(lines))


def best_child(repeat: int, args: list[str]) -> ChildRun:
    """The fastest of ``repeat`` child runs (CPU, wall and RSS each their minimum)."""
    runs = [run_child(args) for _ in range(max(1, repeat))]
    return ChildRun(
        min(r.cpu for r in runs),
        min(r.wall for r in runs),
        min(r.rss_mb for r in runs),
        runs[-1].stdout,
    )


_LOAD_SCRIPT = """
import sys, time
from ntp_opt.model.files import load_instance
cpu, wall = time.process_time(), time.perf_counter()
inst = load_instance(sys.argv[1])
_ = inst.arrays
print(time.process_time() - cpu, time.perf_counter() - wall, inst.arrays.n_gpus)
"""


_IMPORT_SCRIPT = """
from ntp_opt.app.cli import build_parser
build_parser("solve")
"""


def cli_section(ctx: Context) -> list[str]:
    """``ntp-opt solve --planner fast -o`` end to end per instance, next to the floor."""
    rows = [
        "| instance | GPUs | floor: gunzip + json.loads + numpy | CLI solve --planner fast -o "
        "| CLI / floor | peak RSS MB |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(rows), flush=True)
    with TemporaryDirectory() as tmp:
        for path in ctx.files:
            unzip, parse, doc = read_floor(path)
            gpus = gpu_count(doc)
            del doc
            if ctx.quick and gpus > QUICK_GPUS:
                continue
            floor = Timing(
                unzip.cpu + parse.cpu + ctx.numpy_floor.cpu,
                unzip.wall + parse.wall + ctx.numpy_floor.wall,
            )
            args = [sys.executable, "-m", "ntp_opt.app.cli", "solve", str(path)]
            run = best_child(ctx.repeat, [*args, "--planner", "fast", "-o", f"{tmp}/plan.json"])
            rows.append(
                f"| {path.name.removesuffix('.json.gz')} | {gpus:,} | {_fmt(floor)} "
                f"| {run.cpu:.3f} / {run.wall:.3f} | {run.cpu / max(floor.cpu, 1e-9):.2f} "
                f"| {run.rss_mb:.0f} |"
            )
            print(rows[-1], flush=True)
    loads = [
        "| file | GPUs | gunzip + json.loads | load_instance (+ arrays) | load / floor "
        "| peak RSS MB (child, imports included) |",
        "|---|---|---|---|---|---|",
    ]
    for path in ctx.load_files:
        unzip, parse, doc = read_floor(path)
        del doc
        floor = Timing(unzip.cpu + parse.cpu, unzip.wall + parse.wall)
        run = best_child(ctx.repeat, [sys.executable, "-c", _LOAD_SCRIPT, str(path)])
        cpu, wall, gpus = run.stdout.split()
        loads.append(
            f"| {path.name} | {int(gpus):,} | {_fmt(floor)} | {float(cpu):.3f} / "
            f"{float(wall):.3f} | {float(cpu) / max(floor.cpu, 1e-9):.2f} | {run.rss_mb:.0f} |"
        )
        print(loads[-1], flush=True)
    imports = best_child(ctx.repeat, [sys.executable, "-c", _IMPORT_SCRIPT])
    startup = (
        f"Start and imports of `solve` (`build_parser('solve')` in a child): "
        f"{imports.cpu:.3f} / {imports.wall:.3f} s, {imports.rss_mb:.0f} MB."
    )
    print(startup, flush=True)
    return [
        "## CLI end to end (`ntp-opt solve FILE --planner fast -o plan.json`)",
        "",
        f"CPU / wall seconds of the child process, best of {ctx.repeat}; the floor adds "
        "the numpy import to reading the file.",
        "",
        startup,
        "",
        *rows,
        "",
        *(
            ["### `load_instance` of the `--load-file` instances", "", *loads, ""]
            if ctx.load_files
            else []
        ),
    ]


SECTIONS: dict[str, Callable[[Context], list[str]]] = {
    "fast": fast_section,
    "replan": replan_section,
    "cli": cli_section,
}
"""Every section, in the order printed."""


def main(argv: list[str] | None = None) -> int:
    """Measure the chosen sections and print (optionally write) their tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"at most {QUICK_GPUS:,} GPUs")
    parser.add_argument(
        "--section", action="append", choices=sorted(SECTIONS), help="only these sections"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (best kept)")
    parser.add_argument("-o", "--output", type=Path, help="also write the tables here")
    parser.add_argument(
        "--load-file",
        action="append",
        type=Path,
        default=[],
        help="cli section: also time load_instance of this file (e.g. 1M GPUs in /tmp)",
    )
    parser.add_argument("files", nargs="*", type=Path, help="instance files (default: bundled)")
    args = parser.parse_args(argv)
    numpy_floor = numpy_import_floor(args.repeat)
    ctx = Context(args.files or bundled_files(), args.quick, args.repeat, numpy_floor)
    ctx.load_files = args.load_file
    lines = [
        "# Speed against the floor",
        "",
        "`"
        + " ".join(["python benchmarks/speed.py", *(argv if argv is not None else sys.argv[1:])])
        + "`",
        "",
        f'Floor: `python -c "import numpy"` {_fmt(numpy_floor)} s (CPU / wall, best of '
        f"{args.repeat}); per instance, gunzip + `json.loads` of its file in the tables.",
        "",
    ]
    print("\n".join(lines), flush=True)
    for name in args.section or list(SECTIONS):
        lines += SECTIONS[name](ctx)
    if args.output:
        atomic_write(args.output, "\n".join(lines) + "\n")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
