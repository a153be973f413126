"""Load on ``ntp-opt serve``: memory, responsiveness and shutdown (issue 18, item 3).

Starts a server on a free loopback port (default limits unless flags say
otherwise), then at once: ``--clients`` concurrent ``/validate`` requests of
the 32k-GPU paper instance with a plan for it, and three ~62 MiB bodies (one
with ``Content-Length``, one chunked, one chunked and slow). While that runs
it samples the resident memory of the server and every process under it
(``/proc``) and the latency of ``GET /health``. Then it starts a second burst,
sends SIGTERM while workers are busy, and times the exit.

    python benchmarks/service_load.py                       # the issue's load
    python benchmarks/service_load.py --clients 20 --retry  # every request answered

Status -413 in the counts: the server answered 413 and closed the connection
before the client had sent its body (httpx then reports a broken pipe).
Prints peak RSS (the sum over the process tree, an overestimate: pages shared
between the forkserver and its workers count once per process; and the
server process's own high-water mark), the /health latencies, the status
counts, and the seconds from SIGTERM to exit.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
INSTANCE = ROOT / "instances" / "paper-nvl32-32k-0.1pct.json.gz"
BIG = 62 * 1024**2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Sampler(threading.Thread):
    """Peak of the summed RSS of a process tree, every ``period`` seconds."""

    def __init__(self, pid: int, period: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.peak_kb = 0
        self.peak_procs = 0
        self.stop = threading.Event()

    def run(self) -> None:
        from ntp_opt.app.proctree import tree_rss_kb

        while not self.stop.is_set():
            total, procs = tree_rss_kb(self.pid)
            if total > self.peak_kb:
                self.peak_kb, self.peak_procs = total, procs
            time.sleep(self.period)


def _probe(base: str) -> int:
    """``--probe`` mode (its own process, so the load generator cannot delay it):
    GET /health every 0.1 s until stdin closes, then print the latencies as JSON."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    out: list[float] = []
    with httpx.Client(base_url=base, timeout=60) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get("/health").raise_for_status()
            out.append(time.perf_counter() - t0)
            stop.wait(0.1)
    print(json.dumps(out))
    return 0


async def _validate(c: httpx.AsyncClient, body: bytes, retry: bool) -> int:
    while True:
        try:
            r = await c.post(
                "/validate", content=body, headers={"content-type": "application/json"}
            )
        except httpx.TransportError:
            return -1
        if r.status_code == 503 and retry:
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
            continue
        return r.status_code


async def _big(c: httpx.AsyncClient, how: str) -> int:
    async def chunks(slow: bool):  # type: ignore[no-untyped-def]
        piece = b'{"kind":"gpu","id":"x"},' * 2730  # 64 KiB of dense GPU nodes
        yield b'{"plan":{},"instance":{"cluster":{"nodes":['
        for _ in range(BIG // len(piece)):
            yield piece
            if slow:
                await asyncio.sleep(0.01)
        yield b'{"kind":"gpu","id":"y"}]}}}'

    try:
        if how == "length":
            r = await c.post("/validate", content=b" " * BIG)
        else:
            r = await c.post("/validate", content=chunks(how == "slow"))
    except httpx.TransportError:
        return -413  # refused (413) and closed while the client was still sending
    return r.status_code


async def _load(base: str, body: bytes, clients: int, retry: bool, big: bool) -> Counter[int]:
    limits = httpx.Limits(max_connections=clients + 8)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as c:
        jobs = [_validate(c, body, retry) for _ in range(clients)]
        if big:
            jobs += [_big(c, "length"), _big(c, "chunked"), _big(c, "slow")]
        return Counter(await asyncio.gather(*jobs))


async def _main(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    from ntp_opt.app.proctree import status_kb, tree_rss_kb
    from ntp_opt.model.files import instance_from_dict, plan_to_dict
    from ntp_opt.solve import solve

    data = json.loads(gzip.decompress(INSTANCE.read_bytes()))
    plan = solve(instance_from_dict(data, str(INSTANCE)), "ntp").plan
    assert plan is not None
    body = json.dumps({"instance": data, "plan": plan_to_dict(plan)}).encode()
    print(f"body: {len(body) / 1e6:.1f} MB (/validate of {INSTANCE.name})")

    port = _free_port()
    cmd = [sys.executable, "-m", "ntp_opt.app.cli", "serve", "--port", str(port), *args.serve]
    log = open(args.log, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            print("server did not start; see", args.log)
            return 1
        time.sleep(0.1)
    idle_kb = tree_rss_kb(proc.pid)[0]
    sampler = Sampler(proc.pid)
    sampler.start()
    probe = subprocess.Popen(
        [sys.executable, __file__, "--probe", base],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    t0 = time.perf_counter()
    counts = await _load(base, body, args.clients, args.retry, big=True)
    load_s = time.perf_counter() - t0
    latencies: list[float] = json.loads(probe.communicate("")[0])
    hwm_kb = status_kb(proc.pid, "VmHWM")

    # second burst, SIGTERM while workers are busy
    burst = asyncio.create_task(_load(base, body, 8, False, big=False))
    async with httpx.AsyncClient(base_url=base, timeout=60) as c:
        for _ in range(600):
            if (await c.get("/health")).json()["workers_running"] > 0:
                break
            await asyncio.sleep(0.05)
    t_term = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    while proc.poll() is None:
        await asyncio.sleep(0.01)
        if time.perf_counter() - t_term > 60:
            proc.kill()
            break
    exit_s = time.perf_counter() - t_term
    burst_counts = await burst
    sampler.stop.set()
    sampler.join()
    log.close()
    tracebacks = Path(args.log).read_text().count("Traceback")

    print(f"server: {' '.join(cmd[3:])}")
    print(f"load: {args.clients} concurrent /validate + 3 x {BIG / 2**20:.0f} MiB bodies")
    print(f"  statuses: {dict(sorted(counts.items()))} in {load_s:.1f} s")
    print(
        f"  peak RSS, server tree (sum): {sampler.peak_kb / 1024:.0f} MiB over "
        f"{sampler.peak_procs} processes (idle {idle_kb / 1024:.0f} MiB)"
    )
    print(f"  peak RSS, server process (VmHWM): {hwm_kb / 1024:.0f} MiB")
    print(
        f"  /health during load: {len(latencies)} probes, max {max(latencies):.3f} s, "
        f"median {statistics.median(latencies):.3f} s"
    )
    print(
        f"SIGTERM with workers busy: exit {proc.returncode} after {exit_s:.2f} s; "
        f"burst statuses {dict(sorted(burst_counts.items()))}"
    )
    print(f"tracebacks in the server log: {tracebacks}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=120, help="concurrent /validate (default 120)")
    p.add_argument("--retry", action="store_true", help="retry 503s after Retry-After")
    p.add_argument("--log", default="/tmp/ntp-opt-service-load.log", help="server log file")
    p.add_argument("--probe", metavar="URL", help=argparse.SUPPRESS)
    p.add_argument(
        "serve",
        nargs="*",
        help="extra flags for ntp-opt serve (after --), e.g. -- --max-concurrent 1",
    )
    args = p.parse_args()
    if args.probe:
        return _probe(args.probe)
    return asyncio.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
