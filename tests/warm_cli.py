"""A warm ``ntp-opt`` for tests/docs/test_docs.py: the documented shell commands run
the real command line without paying the interpreter's start and the imports
(about 0.6 CPU-s) for every one of them.

``--warm-serve SOCKET`` imports :func:`ntp_opt.app.cli.main` once and listens on a
Unix socket. The ``ntp-opt`` on the doc tests' ``PATH`` is ``client``: a bare
interpreter (``python -S``, standard library only) that sends its arguments,
working directory and environment, and passes its stdin, stdout and stderr
(the file descriptors themselves). For each client the server forks a child
that takes those descriptors as 0, 1 and 2, the directory and the environment,
runs ``main(argv)`` as ``python -m ntp_opt.app.cli`` would and sends back the
exit status, which the client exits with. Each command still runs in its own
process, on the shell's pipes and files; only the import is shared.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import signal
import socket
import sys
import traceback

#: environment variable naming the server's socket (set by the doc tests)
SOCKET_ENV = "NTP_OPT_WARM_CLI"
_LEN = 8  # bytes of the request's length prefix
#: Modules imported on first use (by :mod:`ntp_opt.planners.registry`), imported up front here.
REGISTRY_LAZY = (
    "ntp_opt.planners.exact.search",
    "ntp_opt.planners.megatron",
    "ntp_opt.planners.riskaware",
)


def client(argv: list[str]) -> int:
    """Run ``ntp-opt argv`` on the warm server; return its exit status."""
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(os.environ[SOCKET_ENV])
        socket.send_fds(sock, [len(request).to_bytes(_LEN, "big") + request], [0, 1, 2])
        reply = b""
        while chunk := sock.recv(64):
            reply += chunk
    if not reply:  # the child died without a status (a signal)
        print("ntp-opt (warm test client): the command ended without a status", file=sys.stderr)
        return 1
    return int(reply)


def _child(conn: socket.socket, fds: list[int], request: dict) -> None:
    """In the forked child: become the command, run it, report its status, exit."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [sys.argv[0], *request["argv"]]
    sys.path[0] = request["cwd"]  # as ``python -m``: the working directory first
    from ntp_opt.app.cli import main

    status = 1
    try:
        status = main(request["argv"])
    except SystemExit as exc:  # argparse's exits, as the interpreter reports them
        if exc.code is None or isinstance(exc.code, int):
            status = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        _flush()
    atexit._run_exitfuncs()  # what the interpreter does at exit, before os._exit skips it
    _flush()
    with contextlib.suppress(OSError):
        conn.sendall(str(status).encode())
    os._exit(status)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < _LEN or len(data) < _LEN + int.from_bytes(data[:_LEN], "big"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("short request")
        data += chunk
    return json.loads(data[_LEN:]), list(fds)


def serve(path: str) -> None:
    """Import the CLI, listen on ``path`` and fork a child per client until SIGTERM."""
    from ntp_opt.app.cli import build_parser

    build_parser()  # the point: every command's module imported once, before any fork
    for lazy in REGISTRY_LAZY:  # the planners the registry imports when first run
        importlib.import_module(lazy)

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    children: set[int] = set()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(16)
        print("ready", flush=True)
        try:
            while True:
                conn, _ = listener.accept()
                with conn:
                    request, fds = _read_request(conn)
                    pid = os.fork()
                    if pid == 0:
                        listener.close()
                        _child(conn, fds, request)
                    children.add(pid)
                    for fd in fds:
                        os.close(fd)
                while children:  # reap the finished ones (their CPU counts as ours)
                    done, _ = os.waitpid(-1, os.WNOHANG)
                    if not done:
                        break
                    children.discard(done)
        finally:
            for pid in children:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--warm-serve"]:
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1:]))
