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

What changed and the flap hysteresis are in :mod:`ntp_opt.app.watch_diff`; the
journal and the files of ``DIR`` in :mod:`ntp_opt.app.watch_journal`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ntp_opt.app.watch_diff import (
    DEFAULT_FLAP_COUNT,
    DEFAULT_FLAP_HOLD_S,
    Diff,
    Flaps,
    diff,
    hosts_of,
    short_list,
)
from ntp_opt.app.watch_journal import (
    CURRENT,
    JOURNAL,
    STATUS,
    Journal,
    current_version,
    fsync_dir,
    lock_dir,
    next_version,
    version_name,
    write_atomic,
    write_synced,
)
from ntp_opt.model.files import instance_to_dict, load_instance, load_plan, plan_to_dict
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.megatron import megatron_order
from ntp_opt.rules.validate import evaluate
from ntp_opt.solve import solve
from ntp_opt.workflows.replan import ClusterEvent, Replanner, align, migration

#: Seconds the ``--on-change`` command may run before it is killed.
HOOK_TIMEOUT_S = 300.0


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
        self._lock = lock_dir(self.out)
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
        current = current_version(self.out)
        if current is not None and current > version:
            # killed after current was swapped but before the journal said so: the
            # launcher may already run it, so it is the running version
            self.journal.append(
                {
                    "kind": "publish",
                    "version": current,
                    "dir": version_name(current),
                    "recovered": True,
                }
            )
            version = current
        if not version:
            return
        vdir = self.out / version_name(version)
        instance = load_instance(vdir / "instance.json")
        plan = load_plan(vdir / "plan.json")
        self.running = Running(version, instance, plan)
        self.log(f"resumed: running {version_name(version)} ({vdir})")
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
        hosts = hosts_of(seen, idx)
        if held:
            until = max(self.flaps.up_since.get(g, now) for g in held) + self.flaps.hold
            self.log(
                f"{len(held)} GPUs ({short_list(hosts)}) are up again but held out: they failed "
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
        version = max(old.version + 1 if old is not None else 1, next_version(self.out))
        t2 = time.perf_counter()
        summary = self._summary(version, instance, plan, d, how, old)
        parts["summary_s"] = time.perf_counter() - t2
        try:
            published = self._publish(version, instance, plan, summary, parts, t0)
        finally:
            shutil.rmtree(self.out / f".{version_name(version)}.tmp", ignore_errors=True)
        if not published:
            self.replanner = None  # it moved on to the plan that was not published
            return
        self.running = Running(version, instance, plan)
        self.status.update(state="watching", events_pending=[], last_version=version_name(version))
        self._status()
        timing = " ".join(f"{k[:-2]} {1000 * v:.0f} ms" for k, v in parts.items())
        self.log(f"{self._summary_text(version)}; {how}; {timing}")
        if not plan.replicas:
            self.log(
                f"{version_name(version)}: the job is paused: no replica fits the healthy GPUs"
            )
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
        ticker = threading.Thread(target=self._progress, args=(done, cancel), daemon=True)
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

    def _progress(self, done: threading.Event, cancel: threading.Event) -> None:
        """A line every 10 s of a long solve until ``done``; a signal sets ``cancel``."""
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
            "version": version_name(version),
            "previous": version_name(old.version) if old is not None else None,
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

        name = version_name(version)
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
            write_synced(tmp / "instance.json", json.dumps(instance_to_dict(instance)) + "\n")
            write_synced(tmp / "plan.json", json.dumps(plan_to_dict(plan), indent=1) + "\n")
            if self.stop.is_set():  # a signal: abandon this version, current unchanged
                raise InterruptedError
            summary["timing_ms"] = {k[:-2]: round(1000 * v, 1) for k, v in parts.items()}
            write_synced(tmp / "summary.json", json.dumps(summary, indent=1) + "\n")
            fsync_dir(tmp)
            os.rename(tmp, final)
            link = self.out / f".{CURRENT}.tmp"
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            os.symlink(name, link)
            os.replace(link, self.out / CURRENT)
            fsync_dir(self.out)
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
            s = json.loads((self.out / version_name(version) / "summary.json").read_text())
        except (OSError, ValueError):
            return version_name(version)
        if s["previous"] is None:
            return f"{s['version']}: first plan, goodput {s['goodput_after']}"
        return (
            f"{s['version']}: {s['change']}; goodput {s['goodput_before']} -> "
            f"{s['goodput_after']}; {s['gpus_moved']} GPUs moved"
        )

    def _hook(self, version: int, summary: str) -> None:
        """Run the hook once for ``version`` (journalled before and after)."""
        name = version_name(version)
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
            self.status["last_version"] = version_name(self.running.version)
        write_atomic(self.out / STATUS, json.dumps(self.status, indent=1, sort_keys=True) + "\n")


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


def _stderr(line: str) -> None:
    import sys

    stamp = time.strftime("%H:%M:%S")
    print(f"{stamp} ntp-opt watch: {line}", file=sys.stderr, flush=True)


def _set_stop(stop: threading.Event, signum: int, frame: Any) -> None:
    """The signal handler of :func:`stop_on_signals`."""
    stop.set()


@contextlib.contextmanager
def stop_on_signals(watcher: Watcher) -> Iterator[None]:
    """SIGTERM and SIGINT set ``watcher.stop`` (the current version finishes or is abandoned)."""
    handler = functools.partial(_set_stop, watcher.stop)
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
