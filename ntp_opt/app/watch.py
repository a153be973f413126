"""``ntp-opt watch``: follow a live cluster, re-plan on every health change, publish plans.

A :class:`Watcher` reads the cluster every interval (a ``read`` callable that
returns an :class:`~ntp_opt.model.instance.Instance`: the Slurm or Kubernetes
importer on live sources), turns the difference from the running instance
into events (:func:`diff`), re-plans with one long-lived
:class:`~ntp_opt.workflows.replan.Replanner` and publishes every plan that
launches differently from the running one as ``DIR/vNNNN/`` before swapping the symlink
``DIR/current`` to it. See ``docs/watch.md`` for the files, the journal, the
hysteresis rule and a recorded run.

A fresh solve (:func:`ntp_opt.solve.solve`, aligned to the running plan by
:func:`~ntp_opt.workflows.replan.align`) replaces the re-plan when the
cluster's structure changed (other GPUs, hosts, domains or racks), when a
GPU's power (``tdp_w``, ``max_power_w``) or a rack's budget changed (the
re-planner's events are fail, repair and speed), and when the re-planner
refuses the events.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ntp_opt.model.files import instance_to_dict, load_instance, load_plan, plan_to_dict
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.megatron import megatron_order
from ntp_opt.rules.validate import evaluate
from ntp_opt.solve import solve
from ntp_opt.workflows.replan import ClusterEvent, Replanner, align, migration

#: Seconds a flapping GPU is held out after it comes back (``--flap-hold``).
DEFAULT_FLAP_HOLD_S = 600.0
#: Failures within the hold window that make a GPU flapping (``--flap-count``).
DEFAULT_FLAP_COUNT = 2
#: Seconds the ``--on-change`` command may run before it is killed.
HOOK_TIMEOUT_S = 300.0
JOURNAL = "journal.jsonl"
STATUS = "status.json"
CURRENT = "current"


class WatchError(ValueError):
    """The watch cannot start (its output directory is another watch's)."""


# --- reading the difference --------------------------------------------------------------


@dataclass(frozen=True)
class Diff:
    """What changed between two readings of the same cluster.

    Attributes
    ----------
    events
        Fail, repair and speed events, GPU ids (:class:`ClusterEvent`).
    hosts
        Per event, the hosts of its GPUs (for the log).
    structure
        Why the cluster is another one (GPUs, hosts, domains, racks), or ``None``.
    power
        GPU ids whose power (``tdp_w``/``max_power_w``) changed, plus rack ids
        whose budget changed.
    """

    events: tuple[ClusterEvent, ...] = ()
    structure: str | None = None
    power: tuple[str, ...] = ()
    hosts: tuple[tuple[str, ...], ...] = ()

    @property
    def empty(self) -> bool:
        """Nothing changed."""
        return not self.events and self.structure is None and not self.power

    def describe(self) -> str:
        """A short text: ``fail 8 GPUs (h3), repair ...``."""
        parts = []
        if self.structure is not None:
            parts.append(f"new topology ({self.structure})")
        for i, e in enumerate(self.events):
            what = f"{e.kind} {len(e.nodes)} GPU{'s' if len(e.nodes) != 1 else ''}"
            if i < len(self.hosts):
                what += f" ({_short(list(self.hosts[i]))})"
            if e.speed is not None:
                what += f" speed {e.speed:g}"
            parts.append(what)
        if self.power:
            parts.append(f"power limit of {len(self.power)} GPUs/racks")
        return ", ".join(parts) or "no change"


def _short(items: list[str], n: int = 4) -> str:
    return ",".join(items[:n]) + (f",+{len(items) - n}" if len(items) > n else "")


def _hosts_of(instance: Instance, gpus: list[int]) -> list[str]:
    a = instance.arrays
    g = instance.cluster
    out = set()
    for i in gpus:
        gid = a.gpu_ids[i]
        out.add(str(g.nodes[gid].get("host", gid)))
    return sorted(out)


def diff(old: Instance, new: Instance) -> Diff:
    """The events that turn ``old`` into ``new`` (two readings of one cluster).

    Parameters
    ----------
    old, new
        Instances of the same job; GPUs are matched by id.

    Returns
    -------
    Diff
        Fail, repair and speed events (grouped, GPU ids), or the reason the
        structure differs (then no events), or the power changes.
    """
    a, b = old.arrays, new.arrays
    if list(a.gpu_ids) != list(b.gpu_ids):
        gone = len(set(a.gpu_ids) - set(b.gpu_ids))
        added = len(set(b.gpu_ids) - set(a.gpu_ids))
        return Diff(structure=f"{added} GPUs added, {gone} removed" if gone or added else "order")
    for name in ("gpu_tray", "gpu_domain", "gpu_rack"):
        if not np.array_equal(getattr(a, name), getattr(b, name)):
            return Diff(structure=f"hosts, NVLink domains or racks regrouped ({name})")
    ids = list(b.gpu_ids)
    events: list[ClusterEvent] = []
    hosts: list[tuple[str, ...]] = []
    failed = np.flatnonzero(a.healthy & ~b.healthy).tolist()
    repaired = np.flatnonzero(~a.healthy & b.healthy).tolist()
    for kind, idx in (("fail", failed), ("repair", repaired)):
        if idx:
            events.append(ClusterEvent(kind, tuple(ids[i] for i in idx)))  # type: ignore[arg-type]
            hosts.append(tuple(_hosts_of(new, idx)))
    changed = np.flatnonzero(~np.isclose(a.speed, b.speed, rtol=0, atol=1e-9))
    by_speed: dict[float, list[int]] = {}
    for i in changed.tolist():
        by_speed.setdefault(float(b.speed[i]), []).append(i)
    for s, idx in sorted(by_speed.items()):
        events.append(ClusterEvent("speed", tuple(ids[i] for i in idx), s))
        hosts.append(tuple(_hosts_of(new, idx)))
    power = [
        str(ids[i])
        for i in np.flatnonzero(
            ~(np.isclose(a.tdp, b.tdp) & np.isclose(a.max_power, b.max_power, equal_nan=True))
        )
    ]
    if not np.allclose(a.rack_budget, b.rack_budget, equal_nan=True):
        power.append("racks")
    return Diff(tuple(events), None, tuple(power), tuple(hosts))


# --- hysteresis ----------------------------------------------------------------------------


@dataclass
class Flaps:
    """Hysteresis for GPUs that go down and up repeatedly.

    A GPU that failed ``count`` times within the ``hold`` seconds before it
    comes back is *flapping*: it is held out (kept failed in the plan) until
    it has stayed up for ``hold`` seconds; going down meanwhile restarts
    that probation.

    Parameters
    ----------
    hold
        Seconds (the window and the probation).
    count
        Failures within the window that make a GPU flapping (>= 1).
    """

    hold: float = DEFAULT_FLAP_HOLD_S
    count: int = DEFAULT_FLAP_COUNT
    failures: dict[str, list[float]] = field(default_factory=dict)
    up_since: dict[str, float] = field(default_factory=dict)
    holding: set[str] = field(default_factory=set)

    def failed(self, gpu: str, now: float) -> None:
        """Record that ``gpu`` went down at ``now``."""
        times = [t for t in self.failures.get(gpu, []) if now - t < self.hold]
        times.append(now)
        self.failures[gpu] = times
        self.up_since.pop(gpu, None)

    def held(self, gpu: str, now: float) -> bool:
        """Whether ``gpu``, seen up at ``now`` after being down, stays held out."""
        since = self.up_since.setdefault(gpu, now)
        if gpu not in self.holding:
            recent = [t for t in self.failures.get(gpu, []) if since - t < self.hold]
            if len(recent) >= self.count:
                self.holding.add(gpu)
        return gpu in self.holding and now - since < self.hold

    def down(self, gpu: str, now: float) -> None:
        """``gpu`` is seen down: a held GPU that was up failed again, its probation restarts."""
        if self.up_since.pop(gpu, None) is not None:
            self.failed(gpu, now)

    def released(self, gpu: str) -> None:
        """``gpu`` is back in the plan: forget its probation (not its failures)."""
        self.up_since.pop(gpu, None)
        self.holding.discard(gpu)


# --- files ---------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` by a temporary file and a rename (readers never see half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    _write(tmp, text)
    os.replace(tmp, path)


class Journal:
    """``DIR/journal.jsonl``: one fsynced JSON line per observation, publication and hook.

    Parameters
    ----------
    path
        The journal file (created when missing; a torn last line is ignored).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        if path.exists():
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue  # a line torn by kill -9 mid-write
                    if isinstance(rec, dict):
                        self.records.append(rec)
        self._f: TextIO = open(path, "a", encoding="utf-8")
        if path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            self._f.write("\n")  # the torn line stays unreadable; the next one is whole

    def append(self, record: dict[str, Any]) -> None:
        """Append one record and fsync it."""
        record = {"t": round(time.time(), 3), **record}
        self._f.write(json.dumps(record, sort_keys=True) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.records.append(record)

    def close(self) -> None:
        """Close the file."""
        self._f.close()


# --- the watcher ---------------------------------------------------------------------------


@dataclass
class Settings:
    """How a :class:`Watcher` plans and publishes.

    Attributes
    ----------
    out
        The output directory ``DIR``.
    interval
        Seconds between readings.
    planner
        Planner of fresh solves (:data:`ntp_opt.solve.PLANNERS`).
    time_limit
        Seconds a fresh solve may take (exact planners).
    mode, tolerance
        Of the :class:`Replanner`.
    hook
        ``--on-change`` shell command, or ``None``.
    flap_hold, flap_count
        Of :class:`Flaps`.
    max_polls
        Stop after this many readings (``None``: until a signal).
    hook_timeout
        Seconds the hook may run; then it is killed (exit recorded as -1).
    placeholder_hosts
        Hosts outside the cluster for a launch's inactive ranks (as for
        ``ntp-opt export megatron --placeholder-hosts``).
    """

    out: Path
    interval: float = 10.0
    planner: str = "fast"
    time_limit: float = 60.0
    mode: str = "auto"
    tolerance: float = 1e-3
    hook: str | None = None
    flap_hold: float = DEFAULT_FLAP_HOLD_S
    flap_count: int = DEFAULT_FLAP_COUNT
    max_polls: int | None = None
    placeholder_hosts: tuple[str, ...] = ()
    hook_timeout: float = HOOK_TIMEOUT_S


@dataclass
class Running:
    """The published version the launcher runs."""

    version: int
    instance: Instance
    plan: Plan


class Watcher:
    """Follows a cluster through ``read`` and publishes plans under ``settings.out``.

    Parameters
    ----------
    read
        Returns the cluster as it is now (an instance of the job); its
        :class:`~ntp_opt.model.files.InputError` or ``OSError`` is logged and
        the reading skipped.
    settings
        :class:`Settings`.
    log
        Receives one line per message (default: stderr).
    """

    def __init__(
        self,
        read: Callable[[], Instance],
        settings: Settings,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.read = read
        self.s = settings
        self.log = log or _stderr
        self.stop = threading.Event()
        self.out = settings.out
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock = _lock(self.out)
        self.journal = Journal(self.out / JOURNAL)
        self.flaps = Flaps(settings.flap_hold, settings.flap_count)
        self.running: Running | None = None
        self.replanner: Replanner | None = None
        self.polls = 0
        self.status: dict[str, Any] = {"state": "starting", "pid": os.getpid()}
        self.last_error: str | None = None
        #: The change last seen that was not published (an error, or no plan fits),
        #: and whether no plan fits it (then it is not re-planned until the cluster changes).
        self.stuck: str | None = None
        self.stuck_no_plan = False
        self._resume()

    # -- restart ------------------------------------------------------------------------

    def _resume(self) -> None:
        """Take up the last published version and the flap history from the journal."""
        for tmp in self.out.glob(".v*.tmp"):  # a version a kill -9 left half-written
            shutil.rmtree(tmp, ignore_errors=True)
        for rec in self.journal.records:
            if rec.get("kind") == "observe":
                for gpu in rec.get("failed_gpus", []):
                    self.flaps.failed(gpu, float(rec["t"]))
        published = [r for r in self.journal.records if r.get("kind") == "publish"]
        version = int(published[-1]["version"]) if published else 0
        current = _current_version(self.out)
        if current is not None and current > version:
            # killed after current was swapped but before the journal said so: the
            # launcher may already run it, so it is the running version
            self.journal.append(
                {"kind": "publish", "version": current, "dir": _vname(current), "recovered": True}
            )
            version = current
        if not version:
            return
        vdir = self.out / _vname(version)
        instance = load_instance(vdir / "instance.json")
        plan = load_plan(vdir / "plan.json")
        self.running = Running(version, instance, plan)
        self.log(f"resumed: running {_vname(version)} ({vdir})")
        self._pending_hooks(version)

    def _pending_hooks(self, version: int) -> None:
        """Run the hook of ``version`` if a kill -9 came before it started (never twice)."""
        if not self.s.hook:
            return
        started = {r.get("version") for r in self.journal.records if r.get("kind") == "hook-start"}
        if version not in started:
            self._hook(version, self._summary_text(version))

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> int:
        """Poll until :attr:`stop` is set (a signal) or ``max_polls``; returns 0."""
        try:
            while not self.stop.is_set():
                self.poll()
                if self.s.max_polls is not None and self.polls >= self.s.max_polls:
                    break
                self.stop.wait(self.s.interval)
        finally:
            self.status["state"] = "stopped"
            self._status()
            self.journal.close()
            os.close(self._lock)
        return 0

    def poll(self) -> None:
        """One reading: diff, re-plan and publish when the cluster changed."""
        self.polls += 1
        t0 = time.perf_counter()
        now = time.time()
        try:
            seen = self.read()
        except (OSError, ValueError) as err:
            if self.running is None and self.polls == 1:
                raise  # nothing published yet: a wrong source or option, not an outage
            msg = str(err).splitlines()[0] if str(err) else type(err).__name__
            if msg != self.last_error:
                self.log(f"reading the cluster failed (plan kept): {msg}")
            self.last_error = msg
            self.status.update(last_poll=now, last_error=msg)
            self._status()
            return
        self.last_error = None
        t_poll = time.perf_counter() - t0
        effective, held = self._hold(seen, now)
        if self.running is None:
            d = Diff(structure="first reading")
        else:
            d = diff(self.running.instance, effective)
        t_diff = time.perf_counter() - t0 - t_poll
        if sorted(held) != self.status.get("held_out", []):
            self._log_held(seen, sorted(held), now)
        self.status.update(
            state="watching",
            last_poll=now,
            last_error=None,
            polls=self.polls,
            held_out=sorted(held),
            events_pending=[],
        )
        if d.empty:
            self._status()
            return
        change = d.describe()
        ea = effective.arrays
        key = f"{change}|{hash((ea.healthy.tobytes(), ea.speed.tobytes(), ea.tdp.tobytes()))}"
        retry = key == self.stuck  # the same change as the last that was not published
        if retry and self.stuck_no_plan:
            self._status()  # no plan fits it: wait for the cluster to change again
            return
        self.stuck, self.stuck_no_plan = None, False
        if not retry:  # a new observation (a retried one is not counted again, nor journalled)
            failed = [str(g) for e in d.events if e.kind == "fail" for g in e.nodes]
            for g in failed:
                self.flaps.failed(g, now)
            self.journal.append(
                {
                    "kind": "observe",
                    "change": change,
                    "events": [_event_dict(e) for e in d.events],
                    "failed_gpus": failed,
                    "structure": d.structure,
                    "held_out": sorted(held),
                }
            )
        self.status["events_pending"] = [_event_dict(e) for e in d.events]
        self.status["state"] = "re-planning"
        self._status()
        try:
            self._change(effective, d, {"poll_s": t_poll, "diff_s": t_diff}, t0)
            if self.stuck_no_plan:
                self.stuck = key
        except (OSError, ValueError) as err:  # a full disk, a plan the rules refuse ...
            self.replanner = None  # rebuilt from the running version, which stays current
            msg = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            if msg != self.status.get("last_error"):
                self.log(
                    "re-planning or publishing failed (running version kept; retried every "
                    f"poll): {msg}"
                )
                self.journal.append({"kind": "error", "error": msg})
            self.stuck = key
            self.status.update(state="watching", last_error=msg)
            self._status()

    def _log_held(self, seen: Instance, held: list[str], now: float) -> None:
        """One line and one journal record when the set of held-out GPUs changes."""
        a = seen.arrays
        idx = [a.gpu_index[g] for g in a.gpu_ids if str(g) in set(held)]
        hosts = _hosts_of(seen, idx)
        if held:
            until = max(self.flaps.up_since.get(g, now) for g in held) + self.flaps.hold
            self.log(
                f"{len(held)} GPUs ({_short(hosts)}) are up again but held out: they failed "
                f"{self.flaps.count}+ times within {self.flaps.hold:g} s (flapping); back "
                f"in the plan if up until {time.strftime('%H:%M:%S', time.localtime(until))}"
            )
        else:
            self.log("no GPU held out any more")
        self.journal.append({"kind": "hold", "held_out": held})

    def _hold(self, seen: Instance, now: float) -> tuple[Instance, list[str]]:
        """``seen`` with flapping GPUs kept failed; the GPUs held."""
        if self.running is None:
            return seen, []
        old, new = self.running.instance.arrays, seen.arrays
        if list(old.gpu_ids) != list(new.gpu_ids):
            return seen, []
        healthy = new.healthy.copy()
        held = []
        for i in np.flatnonzero(healthy):
            gpu = str(new.gpu_ids[i])
            if old.healthy[i]:
                continue
            if self.flaps.held(gpu, now):
                healthy[i] = False
                held.append(gpu)
            else:
                self.flaps.released(gpu)
        for i in np.flatnonzero(~new.healthy):
            self.flaps.down(str(new.gpu_ids[i]), now)
        if not held:
            return seen, []
        return seen.with_health(healthy, None), held

    def _change(self, instance: Instance, d: Diff, parts: dict[str, float], t0: float) -> None:
        t1 = time.perf_counter()
        how, plan = self._plan(instance, d)
        if plan is not None:  # the launched order: reduced replicas first, as Megatron-LM takes
            plan = megatron_order(plan, instance.job.tp)
        parts["replan_s"] = time.perf_counter() - t1
        if plan is None or self.stop.is_set():
            self.replanner = None  # rebuilt from the running version when needed
            self.status.update(state="watching", events_pending=[])
            self._status()
            return
        old = self.running
        # a new power limit changes the launch's power commands even for the same replicas
        if old is not None and not d.power and d.structure is None and _same(plan, old.plan):
            self.log(f"{d.describe()}: the same replicas ({how}); no new version")
            self.running = Running(old.version, instance, plan)
            self.status.update(state="watching", events_pending=[])
            self._status()
            return
        # past any directory a kill -9 left between its rename and its journal line
        version = max(old.version + 1 if old is not None else 1, _next_version(self.out))
        t2 = time.perf_counter()
        summary = self._summary(version, instance, plan, d, how, old)
        parts["summary_s"] = time.perf_counter() - t2
        try:
            published = self._publish(version, instance, plan, summary, parts, t0)
        finally:
            shutil.rmtree(self.out / f".{_vname(version)}.tmp", ignore_errors=True)
        if not published:
            self.replanner = None  # it moved on to the plan that was not published
            return
        self.running = Running(version, instance, plan)
        self.status.update(state="watching", events_pending=[], last_version=_vname(version))
        self._status()
        timing = " ".join(f"{k[:-2]} {1000 * v:.0f} ms" for k, v in parts.items())
        self.log(f"{self._summary_text(version)}; {how}; {timing}")
        if not plan.replicas:
            self.log(f"{_vname(version)}: the job is paused: no replica fits the healthy GPUs")
        if self.s.hook:
            self._hook(version, self._summary_text(version))

    def _plan(self, instance: Instance, d: Diff) -> tuple[str, Plan | None]:
        """``(how, plan)`` for ``instance``: re-planned, or a fresh solve where the rules say."""
        why = None
        if self.running is None or d.structure is not None:
            why = d.structure or "no running plan"
        elif d.power:
            why = "power limits changed (the re-planner's events are fail, repair, speed)"
        if why is None:
            if self.replanner is None:
                self.replanner = self._replanner(self.running)  # type: ignore[arg-type]
            if self.replanner is not None:
                try:
                    out = self.replanner.replan(d.events)
                    return f"re-planned ({out.choice}, bound {out.bound_kind})", out.plan
                except ValueError as err:
                    why = f"the re-planner refused the events: {err}"
                    self.replanner = None
            else:
                why = "the running plan does not fit the re-planner"
        return self._fresh(instance, why)

    def _replanner(self, running: Running) -> Replanner | None:
        try:
            return Replanner(
                running.instance,
                running.plan,
                tolerance=self.s.tolerance,
                mode=self.s.mode,  # type: ignore[arg-type]
            )
        except ValueError:
            return None

    def _fresh(self, instance: Instance, why: str) -> tuple[str, Plan | None]:
        self.log(f"fresh solve ({self.s.planner}, at most {self.s.time_limit:g} s): {why}")
        cancel = threading.Event()
        done = threading.Event()

        def progress() -> None:  # a line every 10 s of a long solve; a signal cancels it
            start = time.perf_counter()
            report = 10.0
            while not done.wait(0.5):
                if self.stop.is_set():
                    cancel.set()
                elapsed = time.perf_counter() - start
                if elapsed >= report:
                    report += 10.0
                    self.log(f"  solving: {elapsed:.0f} s of at most {self.s.time_limit:g} s")
                    self.status["solving_s"] = round(elapsed, 1)
                    self._status()

        ticker = threading.Thread(target=progress, daemon=True)
        ticker.start()
        try:
            res = solve(instance, self.s.planner, time_limit=self.s.time_limit, cancel=cancel)
        finally:
            done.set()
            ticker.join()
            self.status.pop("solving_s", None)
        if res.plan is None:
            self.log(
                f"no plan for the cluster ({res.status}: {res.reason}); keeping the running one"
            )
            self.journal.append({"kind": "no-plan", "status": str(res.status), "why": res.reason})
            self.stuck_no_plan = True
            return "fresh solve", None
        plan = res.plan
        if self.running is not None and list(self.running.instance.arrays.gpu_ids) == list(
            instance.arrays.gpu_ids
        ):
            with contextlib.suppress(ValueError):
                plan = align(instance, self.running.plan, plan)
        self.replanner = self._replanner(Running(0, instance, plan))
        return f"fresh solve ({self.s.planner}: {why})", plan

    # -- publication ----------------------------------------------------------------------

    def _summary(
        self,
        version: int,
        instance: Instance,
        plan: Plan,
        d: Diff,
        how: str,
        old: Running | None,
    ) -> dict[str, Any]:
        after = evaluate(instance, plan)
        before = None
        moved = None
        if old is not None:
            if list(old.instance.arrays.gpu_ids) == list(instance.arrays.gpu_ids):
                # the running plan on the cluster as it is now: what the events left of it
                before = evaluate(instance, old.plan)
                with contextlib.suppress(ValueError):
                    moved = migration(instance, old.plan, plan)
        a = instance.arrays
        return {
            "version": _vname(version),
            "previous": _vname(old.version) if old is not None else None,
            "change": d.describe(),
            "events": [_event_dict(e) for e in d.events],
            "how": how,
            "goodput_before": _rel(before.relative_goodput)
            if before is not None and before.feasible
            else ("infeasible" if before is not None else None),
            "goodput_after": _rel(after.relative_goodput),
            "gpus_moved": moved,
            "healthy_gpus": int(a.healthy.sum()),
            "gpus": int(a.n_gpus),
            "replicas": len(plan.replicas),
        }

    def _publish(
        self,
        version: int,
        instance: Instance,
        plan: Plan,
        summary: dict[str, Any],
        parts: dict[str, float],
        t0: float,
    ) -> bool:
        from ntp_opt.app.export import MegatronError, export_megatron

        name = _vname(version)
        final = self.out / name
        tmp = self.out / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            t1 = time.perf_counter()
            try:
                export_megatron(
                    instance, plan, tmp / "launch", placeholder_hosts=self.s.placeholder_hosts
                )
                summary["launch"] = "launch/"
            except (MegatronError, ValueError) as err:
                summary["launch"] = None
                summary["launch_refused"] = str(err).splitlines()[0]
            parts["export_s"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            _write(tmp / "instance.json", json.dumps(instance_to_dict(instance)) + "\n")
            _write(tmp / "plan.json", json.dumps(plan_to_dict(plan), indent=1) + "\n")
            if self.stop.is_set():  # a signal: abandon this version, current unchanged
                raise InterruptedError
            summary["timing_ms"] = {k[:-2]: round(1000 * v, 1) for k, v in parts.items()}
            _write(tmp / "summary.json", json.dumps(summary, indent=1) + "\n")
            _fsync_dir(tmp)
            os.rename(tmp, final)
            link = self.out / f".{CURRENT}.tmp"
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            os.symlink(name, link)
            os.replace(link, self.out / CURRENT)
            _fsync_dir(self.out)
            parts["publish_s"] = time.perf_counter() - t2
            parts["total_s"] = time.perf_counter() - t0
            self.journal.append(
                {
                    "kind": "publish",
                    "version": version,
                    "dir": name,
                    "change": summary["change"],
                    "timing_ms": {k[:-2]: round(1000 * v, 1) for k, v in parts.items()},
                }
            )
            return True
        except InterruptedError:
            shutil.rmtree(tmp, ignore_errors=True)
            self.log(f"{name}: abandoned (signal); current unchanged")
            return False

    def _summary_text(self, version: int) -> str:
        try:
            s = json.loads((self.out / _vname(version) / "summary.json").read_text())
        except (OSError, ValueError):
            return _vname(version)
        if s["previous"] is None:
            return f"{s['version']}: first plan, goodput {s['goodput_after']}"
        return (
            f"{s['version']}: {s['change']}; goodput {s['goodput_before']} -> "
            f"{s['goodput_after']}; {s['gpus_moved']} GPUs moved"
        )

    def _hook(self, version: int, summary: str) -> None:
        """Run the hook once for ``version`` (journalled before and after)."""
        name = _vname(version)
        self.journal.append({"kind": "hook-start", "version": version})
        env = {
            **os.environ,
            "NTP_WATCH_VERSION": name,
            "NTP_WATCH_DIR": str((self.out / name).resolve()),
            "NTP_WATCH_SUMMARY": summary,
        }
        try:
            proc = subprocess.Popen(
                self.s.hook or "",
                shell=True,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its children are killed with it on a timeout
            )
        except OSError as err:
            self.log(f"{name}: --on-change could not start: {err}")
            code = 127
        else:
            try:
                code = proc.wait(timeout=self.s.hook_timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                self.log(f"{name}: --on-change killed after {self.s.hook_timeout:g} s")
                code = -1
        self.journal.append({"kind": "hook", "version": version, "exit": code})
        self.status["last_hook"] = {"version": name, "exit": code}
        if code != 0:
            self.log(f"{name}: --on-change failed (exit {code}); it runs again on the next version")

    def _status(self) -> None:
        self.status["out"] = str(self.out)
        if self.running is not None:
            self.status["last_version"] = _vname(self.running.version)
        write_atomic(self.out / STATUS, json.dumps(self.status, indent=1, sort_keys=True) + "\n")


def _lock(out: Path) -> int:
    """Hold ``DIR/.lock`` (one watch per directory); its descriptor."""
    import fcntl

    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise WatchError(f"{out}: another ntp-opt watch publishes there") from None
    return fd


def _same(a: Plan, b: Plan) -> bool:
    """The plans launch the same: replicas, degrees, GPUs, batches and power (not metrics)."""
    return bool(plan_to_dict(a)["replicas"] == plan_to_dict(b)["replicas"])


def _rel(x: float) -> float:
    return round(float(x), 6)


def _event_dict(e: ClusterEvent) -> dict[str, Any]:
    d: dict[str, Any] = {"kind": e.kind, "nodes": [str(n) for n in e.nodes]}
    if e.speed is not None:
        d["speed"] = e.speed
    return d


def _vname(version: int) -> str:
    return f"v{version:04d}"


def _current_version(out: Path) -> int | None:
    """The complete version ``DIR/current`` names, if any."""
    try:
        name = os.readlink(out / CURRENT)
    except OSError:
        return None
    if len(name) != 5 or not name.startswith("v") or not name[1:].isdigit():
        return None
    if not (out / name / "summary.json").is_file():
        return None
    return int(name[1:])


def _next_version(out: Path) -> int:
    names = [p.name for p in out.glob("v[0-9][0-9][0-9][0-9]")]
    return max((int(n[1:]) for n in names), default=0) + 1


def _stderr(line: str) -> None:
    import sys

    stamp = time.strftime("%H:%M:%S")
    print(f"{stamp} ntp-opt watch: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def stop_on_signals(watcher: Watcher) -> Iterator[None]:
    """SIGTERM and SIGINT set ``watcher.stop`` (the current version finishes or is abandoned)."""

    def handler(signum: int, frame: Any) -> None:
        watcher.stop.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
