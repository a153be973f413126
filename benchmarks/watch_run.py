"""The recorded run of docs/watch.md: ``ntp-opt watch`` on a local 16-node Slurm.

Starts ``tests/slurm_cluster.py`` (16 DGX-like hosts of 8 GPUs, two leaf
switches) under a temporary directory, runs ``ntp-opt watch slurm`` at a 1 s
interval with a hook that fails for ``v0003``, and drives the cluster: five
drains and resumes (each timed from the return of ``scontrol update`` to
``DIR/current`` naming the new version), a node ``DOWN`` and one ``FAIL``, a
``kill -9`` of the watch while both come back, a restart, a flapping node,
SIGTERM. Prints the commands and the timings; the watch's log, hooks log,
journal and versions stay in ``DIR`` (``--dir``, default a temporary one).

    python benchmarks/watch_run.py [--dir DIR]

Needs Debian's slurmctld, slurmd, slurm-client and munge; about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.slurm_cluster import SlurmCluster  # noqa: E402

#: Bounded waits: polls 20 ms apart (a bound, not a tuned delay).
MAX_POLLS = 6000


def _until(what: str, cond: object) -> None:
    for _ in range(MAX_POLLS):
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise SystemExit(f"{what} never happened")


def main() -> None:
    """Run the scenario and print the transcript."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, help="where everything goes (default: a temporary dir)")
    d = (ap.parse_args().dir or Path(tempfile.mkdtemp(prefix="ntp-watch-"))).resolve()
    d.mkdir(parents=True, exist_ok=True)
    c = SlurmCluster(d / "slurm", nodes=16, gpus=8, spares=0, leaves=2, tag="dgx")
    c.start()
    try:
        _scenario(c, d)
    finally:
        c.stop()


def _scenario(c: SlurmCluster, d: Path) -> None:
    out = d / "out"
    (d / "job.json").write_text(
        json.dumps({"tp": 8, "pp": 2, "dp": 8, "global_batch": 64, "batch_policy": "elastic"})
    )
    hook = (
        f'echo "$NTP_WATCH_VERSION: $NTP_WATCH_SUMMARY" >> {d}/hooks.log; '
        'test "$NTP_WATCH_VERSION" != v0003'
    )
    env = {**c.env(), "PYTHONPATH": str(ROOT)}
    argv = [
        sys.executable, "-m", "ntp_opt.app.cli", "watch", "slurm", "--job", str(d / "job.json"),
        "--out", str(out), "--tdp-w", "700", "--interval", "1", "--on-change", hook,
        "--placeholder-hosts", "ph1,ph2,ph3",
    ]  # fmt: skip
    log = open(d / "watch.log", "w")

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, env=env, stderr=log, stdout=log)

    def versions() -> list[int]:
        path = out / "journal.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(ln)["version"] for ln in lines if '"publish"' in ln]

    def sc(node: str, state: str) -> None:
        cmd = ["scontrol", "update", f"nodename={c.tag}{node}", f"state={state}"]
        cmd += [] if state == "resume" else ["reason=demo"]
        print("$ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, env=env, check=True)

    def status() -> dict[str, object]:
        try:
            data: dict[str, object] = json.loads((out / "status.json").read_text())
            return data
        except (OSError, ValueError):
            return {}

    n = 1
    p = start()
    _until("v0001", lambda: 1 in versions())
    print("# v0001 published")
    times = []
    for node in ("n3", "n4", "n6", "n8", "n10"):
        for state in ("drain", "resume"):
            n += 1
            before = os.readlink(out / "current")
            sc(node, state)
            t0 = time.perf_counter()
            _until("current", lambda b=before: os.readlink(out / "current") != b)  # type: ignore[misc]
            times.append(time.perf_counter() - t0)
            print(f"# {state} {node} -> current {os.readlink(out / 'current')} "
                  f"after {times[-1]:.2f} s")  # fmt: skip
            _until(f"v{n}", lambda k=n: k in versions())  # type: ignore[misc]
    for node, state in (("n5", "down"), ("n9", "fail")):
        sc(node, state)
        n += 1
        _until(f"v{n}", lambda k=n: k in versions())  # type: ignore[misc]
    print("$ kill -9 <watch>")
    p.kill()
    p.wait()
    sc("n5", "resume")
    sc("n9", "resume")
    print("# restart")
    p = start()
    n += 1
    _until(f"v{n}", lambda k=n: k in versions())  # type: ignore[misc]
    print("# flapping n7")
    for state in ("drain", "resume", "drain"):
        sc("n7", state)
        n += 1
        _until(f"v{n}", lambda k=n: k in versions())  # type: ignore[misc]
    sc("n7", "resume")
    _until("held out", lambda: bool(status().get("held_out")))
    polls = int(status()["polls"])  # type: ignore[call-overload]
    _until("3 polls", lambda: int(status().get("polls", 0)) >= polls + 3)  # type: ignore[call-overload]
    print("$ kill -TERM <watch>")
    p.terminate()
    print("# exit", p.wait())
    print("drain/resume -> current (s):", " ".join(f"{t:.2f}" for t in times),
          "max", f"{max(times):.2f}")  # fmt: skip
    print(f"# log, hooks, journal and versions in {d}")


if __name__ == "__main__":
    main()
