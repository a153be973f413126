"""The service's bounds on memory and time (issue 18, items 3 and 5).

Real ``ntp-opt serve`` processes on loopback with small limits. No test
asserts wall-clock time: waits are for events (a status on ``/health``, a
response, a closed connection, a process exit) with generous hang guards.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ntp_opt.app.proctree import alive, descendants, status_kb

ROOT = Path(__file__).resolve().parents[2]
#: The header every POST of these tests sends (the service refuses other bodies: 415).
JSON = {"content-type": "application/json"}
HANG_GUARD = 60.0  # seconds: only to fail instead of hanging


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=HANG_GUARD)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=HANG_GUARD)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(tmp: Path, *args: str) -> Server:
    port = _free_port()
    log = tmp / f"server-{port}.log"
    cmd = [sys.executable, "-m", "ntp_opt.app.cli", "serve", "--port", str(port), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = Server(proc, port, log)
    wait_for(lambda: _healthy(server), f"server did not start:\n{log}")
    return server


def _healthy(server: Server) -> bool:
    if server.proc.poll() is not None:
        pytest.fail(f"server exited:\n{server.log.read_text()}")
    try:
        return httpx.get(server.base + "/health", timeout=HANG_GUARD).status_code == 200
    except httpx.TransportError:
        return False


def wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(what)
        time.sleep(0.05)


def health(server: Server) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(server.base + "/health", timeout=HANG_GUARD).json()
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # 64 MiB budget, 1 worker: bodies 16 MiB, the worker 48 MiB, endpoint cap
    # min(64 MiB, 48 MiB / 8, 16 MiB / 2) = 6 MiB; 2 requests at once
    s = start_server(
        tmp_path_factory.mktemp("limits"),
        "--max-memory-mb",
        "64",
        "--max-concurrent",
        "1",
        "--max-requests",
        "2",
        "--body-timeout",
        "1",
        "--max-time-limit",
        "5",
    )
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


@pytest.fixture(scope="module")
def tiny() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ROOT / "instances" / "tiny.json").read_text())
    return data


@pytest.fixture(scope="module")
def tiny_plan(server: Server, tiny: dict[str, Any]) -> dict[str, Any]:
    with server.client() as c:
        r = c.post("/solve", json={"instance": tiny, "solver": "fast"})
    assert r.status_code == 200, r.text
    plan: dict[str, Any] = r.json()["plan"]
    return plan


def _fields(r: httpx.Response) -> list[str]:
    return [p["field"] for p in r.json()["problems"]]


def _raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD)
    sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_limits_reported(server: Server) -> None:
    h = health(server)
    assert h["endpoint_body_bytes"] == 6 * 1024**2
    assert h["memory_bytes"] == 64 * 1024**2 and h["max_requests"] == 2


def test_host_allowlist(server: Server) -> None:
    with server.client() as c:
        r = c.get("/health", headers={"host": "attacker.example"})
        assert r.status_code == 400 and _fields(r) == ["Host"]
        r = c.get("/health", headers={"host": f"attacker.example:{server.port}"})
        assert r.status_code == 400
        for ok in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}"):
            assert c.get("/health", headers={"host": ok}).status_code == 200, ok


def test_non_finite_numbers_rejected_naming_the_field(
    server: Server, tiny: dict[str, Any], tiny_plan: dict[str, Any]
) -> None:
    body = json.dumps({"instance": tiny, "plan": tiny_plan})
    cases = [
        ('"builder"', '"x": NaN, "builder"', "instance.meta.x"),
        ('"seq_time_s": 1.0', '"seq_time_s": Infinity', "instance.job.seq_time_s"),
        ('"seq_time_s": 1.0', '"seq_time_s": 1e999', "instance.job.seq_time_s"),
        ('"power": 1.0', '"power": -Infinity', "plan.replicas[0].stages[0].power"),
    ]
    with server.client() as c:
        for old, new, where in cases:
            assert old in body
            r = c.post(
                "/validate",
                content=body.replace(old, new, 1),
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 422, (new, r.text)
            assert _fields(r) == [where], (new, r.json())


def test_item5_cases_are_4xx(
    server: Server, tiny: dict[str, Any], tiny_plan: dict[str, Any]
) -> None:
    with server.client() as c:
        for key in ("tp", "local_batch"):
            plan = copy.deepcopy(tiny_plan)
            plan["replicas"][0][key] = 10**400
            for endpoint in ("/validate", "/replan"):
                r = c.post(
                    endpoint,
                    content=json.dumps({"instance": tiny, "plan": plan}),
                    headers={"content-type": "application/json"},
                )
                assert r.status_code == 422, r.text
                assert _fields(r) == [f"plan.replicas[0].{key}"]
        for job in ({"tp_efficiency": {"3": 1e308}}, {"seq_time_s": 5e-324}):
            inst = copy.deepcopy(tiny)
            inst["job"].update(job)
            for solver in ("fast", "optimal"):
                r = c.post("/solve", json={"instance": inst, "solver": solver, "time_limit": 2})
                assert r.status_code < 500, (job, solver, r.text)
            r = c.post("/evaluate", json={"instance": inst, "plan": tiny_plan})
            assert r.status_code < 500, (job, r.text)
        inst = copy.deepcopy(tiny)
        inst["job"]["global_batch"] = inst["job"]["max_local_batch"] = 10**9
        r = c.post("/solve", json={"instance": inst, "solver": "optimal"})
        assert r.status_code == 422 and _fields(r) == ["instance.job.global_batch"]
        r = c.post("/validate", content=b"[" * 100_000 + b"]" * 100_000, headers=JSON)
        assert r.status_code == 400


def test_endpoint_body_cap(server: Server) -> None:
    cap = 6 * 1024**2
    with server.client() as c:
        r = c.post("/validate", content=b" " * (cap + 1), headers=JSON)
        assert r.status_code == 413

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted while reading
            for _ in range(cap // 65536 + 2):
                yield b" " * 65536

        r = c.post("/validate", content=chunks(), headers=JSON)
        assert r.status_code == 413


def test_body_needing_more_than_the_worker_budget_is_413(server: Server) -> None:
    # 5 MiB (under the 6 MiB cap) of tiny GPU nodes: parsing alone needs far
    # more than the worker's 48 MiB
    node = b'{"kind":"gpu","id":"g%07d"},'
    nodes = b"".join(node % i for i in range(5 * 1024**2 // len(node % 0)))
    body = b'{"plan":{},"instance":{"cluster":{"nodes":[' + nodes[:-1] + b"]}}}"
    with server.client() as c:
        r = c.post("/validate", content=body, headers=JSON)
        assert r.status_code == 413, r.text[:300]
        assert "memory" in r.json()["error"]
        assert c.get("/health").status_code == 200


def test_busy_slots_get_503_before_the_body_is_read(server: Server) -> None:
    # two requests hold both slots: their bodies never complete (held until
    # the body timeout; the /health count is the event to wait for)
    head = b"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n"
    head += b"Content-Type: application/json\r\n\r\n"
    holders = [_raw(server.port, head + b"{") for _ in range(2)]
    try:
        wait_for(lambda: health(server)["requests_in_progress"] == 2, "slots not taken")
        # this one announces a body it never sends: only a server that checks
        # for a slot before reading can answer it
        probe = _raw(server.port, head)
        answer = probe.recv(65536)
        probe.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b"retry-after: 1" in answer.lower()
    finally:
        for h in holders:
            h.close()
    wait_for(lambda: health(server)["requests_in_progress"] == 0, "slots not released")


def test_slow_body_is_dropped(server: Server) -> None:
    head = b"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n"
    head += b"Content-Type: application/json\r\n\r\n"
    sock = _raw(server.port, head + b'{"instance"')
    try:
        answer = _read_all(sock)  # returns when the server closes the connection
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    wait_for(lambda: health(server)["requests_in_progress"] == 0, "slot not released")


def test_bounded_rss_under_concurrent_validates(tmp_path: Path) -> None:
    # 20 concurrent /validate of a 2k-GPU instance against the default limits:
    # the server process never parses a body, so its peak RSS stays small
    import gzip

    inst = json.loads(
        gzip.decompress((ROOT / "instances" / "nvl32-2k-tp16-0.4pct-elastic.json.gz").read_bytes())
    )
    s = start_server(tmp_path, "--max-concurrent", "1")
    try:
        with s.client() as c:
            r = c.post("/solve", json={"instance": inst, "solver": "ntp"})
            assert r.status_code == 200, r.text[:300]
            body = json.dumps({"instance": inst, "plan": r.json()["plan"]}).encode()
        statuses: list[int] = []

        def one() -> None:
            with s.client() as c:
                statuses.append(c.post("/validate", content=body, headers=JSON).status_code)

        threads = [threading.Thread(target=one) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_GUARD)
        assert len(statuses) == 20 and set(statuses) <= {200, 503}, statuses
        assert 200 in statuses and 503 in statuses  # 8 admitted, the rest refused
        peak_kb = status_kb(s.proc.pid, "VmHWM")
        assert 0 < peak_kb < 400 * 1024, peak_kb  # bodies: 8 x 0.4 MB, in flight
    finally:
        s.stop()


def test_sigterm_stops_a_running_solve_and_exits(tmp_path: Path) -> None:
    import gzip

    name = "nvl32-8k-0.4pct-tight-elastic.json.gz"
    inst = json.loads(gzip.decompress((ROOT / "instances" / name).read_bytes()))
    s = start_server(tmp_path, "--max-time-limit", "600")
    answers: list[int] = []

    def long_solve() -> None:
        try:
            with s.client() as c:
                r = c.post(
                    "/solve", json={"instance": inst, "solver": "optimal", "time_limit": 600}
                )
                answers.append(r.status_code)
        except httpx.TransportError:
            answers.append(-1)

    t = threading.Thread(target=long_solve)
    t.start()
    try:
        wait_for(lambda: health(s)["workers_running"] == 1, "the solve did not start")
        children = descendants(s.proc.pid)
        assert children
        s.proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down, then re-raises the signal (the conventional exit status)
        assert s.proc.wait(timeout=HANG_GUARD) in (0, -signal.SIGTERM)
        t.join(HANG_GUARD)
        assert answers and answers[0] in (503, -1)
        wait_for(lambda: not any(alive(p) for p in children), "workers outlived the server")
    finally:
        s.stop()
    text = s.log.read_text()
    assert "Traceback" not in text and "Finished server process" in text


# --- fuzzing: mutated valid bodies get 2xx or 4xx, never 5xx ---------------------------

_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
_json = st.recursive(
    _json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _replace(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    doc = copy.copy(doc)
    doc[path[0]] = _replace(doc[path[0]], path[1:], value)
    return doc


@settings(
    # the profile's count (ci: 12, thorough: 150), or NTP_SERVICE_FUZZ
    max_examples=int(os.environ.get("NTP_SERVICE_FUZZ", settings.default.max_examples)),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    endpoint=st.sampled_from(
        ["/validate", "/evaluate", "/export/megatron-ntp", "/replan", "/solve"]
    ),
    pick=st.integers(min_value=0),
    value=_json,
    drop=st.booleans(),
)
def test_fuzz_mutated_bodies_never_5xx(
    server: Server,
    tiny: dict[str, Any],
    tiny_plan: dict[str, Any],
    endpoint: str,
    pick: int,
    value: Any,
    drop: bool,
) -> None:
    if endpoint == "/solve":
        doc: Any = {"instance": tiny, "solver": "fast"}
    else:
        doc = {"instance": tiny, "plan": tiny_plan}
    paths = _paths(doc)
    path = paths[pick % len(paths)]
    if drop and path and isinstance(path[-1], str):
        parent = _replace(doc, (), doc)
        target = parent
        for p in path[:-1]:
            target[p] = copy.copy(target[p])
            target = target[p]
        del target[path[-1]]
        doc = parent
    else:
        doc = _replace(doc, path, value)
    body = json.dumps(doc, allow_nan=True).encode()
    with server.client() as c:
        r = c.post(endpoint, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (endpoint, path, value, r.text[:500])
    if r.status_code >= 400:
        assert r.json()["error"]


def test_serve_bad_port_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from ntp_opt.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", "99999"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "ntp-opt: error: argument --port: a port is in 0..65535, got 99999 "
        "(see 'ntp-opt serve --help')"
    ]


def test_a_number_under_an_empty_key_is_named_not_a_crash() -> None:
    """A body whose path starts with the key ``""`` gets 422 naming it (it was a 500:
    the service's own copy of the field-path formatter indexed an empty string)."""
    from ntp_opt.app.service import handle

    status, payload = handle("validate", b'{"": {"gpu": NaN}}', 10.0)
    assert status == 422
    assert json.loads(payload)["problems"] == [
        {"field": ".gpu", "message": "NaN is not a finite number"}
    ]
