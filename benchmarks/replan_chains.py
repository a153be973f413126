"""Chains of single-GPU failures re-planned by a ``Replanner``: an older revision against now.

Usage::

    python benchmarks/replan_chains.py --rev cfeee58           # 32k, 2 seeds x 10 events
    python benchmarks/replan_chains.py --rev cfeee58 --quick   # 4k

The package of revision ``--rev`` (``git archive``) is imported next to the
working tree's, under another name, so both run in one process: each event is
re-planned by the old code, then by the new, one after the other (the same
machine load for both). Per instance: median, p90 and max CPU ms per event
(each re-plan committed, ``auto`` mode), how many events took each path
(which bound decided, which plan was kept) on each side, on how many events
both gave the same plan, choice and migration (in brackets: the same but
for power multipliers), and the GPUs moved and the lowest goodput over the
chain on each side (where the sides differ, each chain goes on from its own
plan; the events are the same). ``--best-of K`` times each event as the
fastest of ``K`` replays, which takes most of the machine's load out of the
medians. The main columns are **cold**: each of the ``K`` replays (what-ifs)
starts from the Replanner's state as it was before the event (:class:`_Snapshot`:
a fresh :class:`PlanState` whose chain memo is a copy of the memo before the
event, and the lazily computed attributes of the running instance, plan and
layout dropped again), so each is the event computed once, as a scheduler
computes it, and the fastest of them is the cold cost without the machine's
noise. Then ``K - 1`` **warm** replays follow without restoring (the last one
commits): they reuse what the earlier replays of the same event left in the
memo (the figure before the cold columns existed). The table also gives each
side's median of the first cold replays alone. ``--verify`` also checks that
no replay changed the snapshot it started from (the copy shares the memo's
arrays: it fails if any is written in place).
Instances: the NVL32 cluster of
``benchmarks/large.py`` (elastic), and ``instances/paper-nvl32-32k-0.1pct``
as bundled (elastic) and with a fixed batch (issue 30).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import io
import pickle
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def old_package(rev: str, into: Path) -> ModuleType:
    """``ntp_opt`` of ``rev``, importable as ``ntp_opt_base`` (its imports renamed)."""
    blob = subprocess.run(
        ["git", "archive", rev, "ntp_opt"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    src = into / "ntp_opt"
    for path in src.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\bntp_opt\b", "ntp_opt_base", text))
    src.rename(into / "ntp_opt_base")
    sys.path.insert(0, str(into))
    return importlib.import_module("ntp_opt_base")


def instances(pkg: str, quick: bool) -> list[tuple[str, Any]]:
    """The chains' instances, built by package ``pkg`` (as ``large.build`` does)."""
    topology = importlib.import_module(f"{pkg}.model.topology")
    top = importlib.import_module(pkg)
    files = importlib.import_module(f"{pkg}.model.files")
    gpus = 4096 if quick else 32768
    g = topology.nvl32(gpus // 32, rack_power_factor=1.3)
    job = top.Job(
        tp=32,
        tp_allowed=(28, 30, 32),
        pp=8,
        dp=gpus // 256,
        global_batch=gpus // 16,
        batch_policy="elastic",
    )
    topology.fail_random(g, fraction=1e-3, seed=1)
    topology.add_stragglers(g, count=gpus // 4096, speed=(0.7, 0.95), seed=2)
    out = [(f"NVL32 (`large.py`) {gpus}", top.Instance("nvl32", g, job, {}, copy_graph=False))]
    if not quick:
        paper = files.load_instance(ROOT / "instances" / "paper-nvl32-32k-0.1pct.json.gz")
        out.append(("paper-nvl32-32k-0.1pct", paper))
        fixed = paper.with_job(paper.job.model_copy(update={"batch_policy": "fixed"}))
        out.append(("paper-nvl32-32k-0.1pct (fixed)", fixed))
    return out


def shape(plan: Any) -> tuple[Any, ...]:
    """A plan as plain tuples (the two packages' classes differ)."""
    return tuple(
        (rep.tp, rep.local_batch, tuple((st.domain, st.gpus, st.power) for st in rep.stages))
        for rep in plan.replicas
    )


def placement(plan: Any) -> tuple[Any, ...]:
    """A plan as plain tuples without the power multipliers."""
    return tuple(
        (rep.tp, rep.local_batch, tuple((st.domain, st.gpus) for st in rep.stages))
        for rep in plan.replicas
    )


def stats(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]
    return f"{statistics.median(xs):.1f} / {p90:.1f} / {xs[-1]:.1f}"


def _thawed(x: Any) -> Any:
    """``x`` with its containers copied (dicts, lists, sets; tuples holding one),
    everything else shared: the memo's arrays and objects are compared by identity
    with the instance's (``is``) and never written in place (``--verify``)."""
    if isinstance(x, dict):
        return {k: _thawed(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_thawed(v) for v in x]
    if isinstance(x, set):
        return set(x)
    if isinstance(x, tuple) and type(x) is tuple:
        items = [_thawed(v) for v in x]
        return x if all(a is b for a, b in zip(items, x, strict=True)) else tuple(items)
    return x


def _fingerprint(x: Any) -> str:
    """A digest of ``x``'s contents (arrays' bytes included)."""
    return hashlib.sha256(pickle.dumps(x, protocol=5)).hexdigest()


@dataclass
class _Snapshot:
    """A Replanner's state before an event, to start each cold replay from."""

    runner: Any
    state: Any
    memo: Any
    keys: list[tuple[Any, set[str]]]
    digest: str | None = None

    @classmethod
    def of(cls, runner: Any, verify: bool) -> _Snapshot:
        """The state of ``runner`` now (``verify``: with a digest to check later)."""
        st = runner.state
        objs = [st.instance, st.base, st.plan, st.layout, st.evaluation, st.instance.arrays]
        keys = [(o, set(vars(o))) for o in objs if o is not None and hasattr(o, "__dict__")]
        snap = cls(runner, st, _thawed(st.memo), keys)
        if verify:
            snap.digest = snap.contents()
        return snap

    def contents(self) -> str:
        """The digest of what a replay must not change."""
        st = self.state
        return _fingerprint((self.memo, st.points, st.rows, st.fixed))

    def restore(self) -> None:
        """Put the runner back as it was (a new state object: nothing cached on it)."""
        for obj, keys in self.keys:
            for k in set(vars(obj)) - keys:
                del vars(obj)[k]
        self.runner.state = dataclasses.replace(self.state, memo=_thawed(self.memo))

    def check(self) -> None:
        """Fail if a replay changed the snapshot (``verify`` only)."""
        if self.digest is not None and self.contents() != self.digest:
            raise SystemExit("a replay wrote into the state it started from")


@dataclass
class _Tally:
    """One instance's figures on both sides (``"before"``, ``"now"``)."""

    times: dict[str, list[float]] = field(default_factory=lambda: {"before": [], "now": []})
    warm: dict[str, list[float]] = field(default_factory=lambda: {"before": [], "now": []})
    first: dict[str, list[float]] = field(default_factory=lambda: {"before": [], "now": []})
    paths: dict[str, dict[str, int]] = field(default_factory=lambda: {"before": {}, "now": {}})
    moved: dict[str, int] = field(default_factory=lambda: {"before": 0, "now": 0})
    low: dict[str, float] = field(default_factory=lambda: {"before": np.inf, "now": np.inf})
    same: int = 0
    placed: int = 0

    def row(self, name: str, inst: Any) -> str:
        """The table's row."""
        kinds = {
            side: ", ".join(f"{p}: {c}" for p, c in sorted(self.paths[side].items()))
            for side in self.paths
        }
        med = {
            what: {side: statistics.median(xs) for side, xs in got.items()}
            for what, got in (("first", self.first), ("warm", self.warm), ("cold", self.times))
        }
        ratio = {what: m["now"] / m["before"] for what, m in med.items()}
        return (
            f"| {name} | {inst.job.batch_policy} | {inst.arrays.n_gpus:,} "
            f"| {stats(self.times['before'])} | {stats(self.times['now'])} "
            f"| {ratio['cold']:.2f} "
            f"| {med['warm']['before']:.1f} / {med['warm']['now']:.1f} | {ratio['warm']:.2f} "
            f"| {med['first']['before']:.1f} / {med['first']['now']:.1f} "
            f"| {kinds['before']} | {kinds['now']} "
            f"| {self.same} ({self.placed}) / {len(self.times['now'])} "
            f"| {self.moved['before']} / {self.moved['now']} "
            f"| {self.low['before']:.3f} / {self.low['now']:.3f} |"
        )


def _replay(runner: Any, mod: Any, gpu: Any, commit: bool) -> tuple[Any, float]:
    """One re-plan of the failure of ``gpu``, and its CPU milliseconds."""
    event = [mod.ClusterEvent("fail", gpu)]
    cpu = time.process_time()
    out = runner.replan(event, commit=commit)
    return out, 1000 * (time.process_time() - cpu)


def _event(
    runs: dict[str, Any], runners: dict[str, Any], gpu: Any, args: argparse.Namespace, t: _Tally
) -> None:
    """Re-plan the failure of ``gpu`` on both sides (``best_of`` cold replays, then
    ``best_of - 1`` warm ones, the last committed) and tally it."""
    outs = {}
    k = args.best_of
    for side, (mod, _, _) in runs.items():
        snap = _Snapshot.of(runners[side], args.verify)
        cold = []
        for _ in range(k):
            snap.restore()
            outs[side], ms = _replay(runners[side], mod, gpu, commit=k == 1)
            cold.append(ms)
        snap.check()
        warm = [cold[-1]]
        for i in range(k - 1):
            outs[side], ms = _replay(runners[side], mod, gpu, commit=i == k - 2)
            warm.append(ms)
        t.first[side].append(cold[0])
        t.times[side].append(min(cold))
        t.warm[side].append(min(warm))
    old, new = outs["before"], outs["now"]
    t.same += (shape(old.plan), old.choice, old.moved) == (shape(new.plan), new.choice, new.moved)
    t.placed += (placement(old.plan), old.choice, old.moved) == (
        placement(new.plan),
        new.choice,
        new.moved,
    )
    for side, out in outs.items():
        path = f"{out.bound_kind} bound, {out.choice}"
        t.paths[side][path] = t.paths[side].get(path, 0) + 1
        t.moved[side] += out.moved
        t.low[side] = min(t.low[side], out.goodput)


def _chains(inst: Any, runs: dict[str, Any], args: argparse.Namespace) -> _Tally:
    """Every seed's chain of ``args.events`` failures of used GPUs, on both sides."""
    t = _Tally()
    for seed in args.seeds:
        runners = {s: m.Replanner(i, p) for s, (m, i, p) in runs.items()}
        rng = np.random.default_rng(seed)
        a = inst.arrays
        for _ in range(args.events):
            used = np.zeros(a.n_gpus, dtype=bool)
            used[runners["now"].state.layout.gpus] = True
            gpu = a.gpu_ids[int(rng.choice(np.flatnonzero(used)))]
            _event(runs, runners, gpu, args, t)
    return t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", required=True, help="the older revision (git)")
    ap.add_argument("--quick", action="store_true", help="4k GPUs only")
    ap.add_argument("--events", type=int, default=10, help="failures per chain")
    ap.add_argument("--seeds", type=int, nargs="+", default=[7, 8])
    ap.add_argument(
        "--best-of",
        type=int,
        default=1,
        help="time each event as the fastest of this many cold replays (and of as many warm)",
    )
    ap.add_argument(
        "--verify", action="store_true", help="check that no replay changed its snapshot"
    )
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        old_package(args.rev, Path(tmp))
        sides = {
            "before": ("ntp_opt_base", instances("ntp_opt_base", args.quick)),
            "now": ("ntp_opt", instances("ntp_opt", args.quick)),
        }
        print(
            "| instance | batch | GPUs | cold, before: median / p90 / max ms "
            "| cold, now: median / p90 / max ms | ratio | warm median: before / now | ratio "
            "| first replay, median: before / now "
            "| events by path, before | events by path, now "
            "| same plan (placement) / events | GPUs moved, before / now "
            "| lowest goodput, before / now |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            flush=True,
        )
        for k, (name, inst) in enumerate(sides["now"][1]):
            runs = {}
            for side, (pkg, insts) in sides.items():
                fast = importlib.import_module(f"{pkg}.planners.fast")
                replan = importlib.import_module(f"{pkg}.workflows.replan")
                out = fast.plan_fast(insts[k][1])  # before the planner contract: (plan, bound)
                runs[side] = (replan, insts[k][1], out[0] if isinstance(out, tuple) else out.plan)
            if shape(runs["before"][2]) != shape(runs["now"][2]):
                raise SystemExit(f"{name}: the two revisions' fast plans differ")
            print(_chains(inst, runs, args).row(name, inst), flush=True)


if __name__ == "__main__":
    main()
