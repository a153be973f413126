"""The ``ntp-opt serve`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
from typing import Any

from ntp_opt.app.cli.common import warn


def run(args: argparse.Namespace) -> int:
    try:
        from ntp_opt.app.service import serve
    except ImportError as err:
        raise ValueError(f"serve needs {err.name}: pip install 'ntp-opt[serve]'") from None
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        warn(f"listening on {args.host}, not loopback")
    from ntp_opt.app.service import DEFAULT_ALLOWED_HOSTS, Limits

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: {args.port} is not a port number (0-65535)")
    limits = Limits(
        max_body_bytes=int(args.max_body_mb * 1024**2),
        max_time_limit=args.max_time_limit,
        max_concurrent=args.max_concurrent,
        max_requests=args.max_requests,
        memory_bytes=int(args.max_memory_mb * 1024**2),
        body_timeout=args.body_timeout,
        request_timeout=args.request_timeout,
        solve_grace=args.solve_grace,
        allowed_hosts=tuple(args.allow_host or DEFAULT_ALLOWED_HOSTS),
    )
    serve(args.host, args.port, limits=limits)
    return 0


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in 0..65535, got {value}")
    return value


def add_parser(sub: Any) -> None:
    """The ``ntp-opt serve`` subcommand."""
    sv = sub.add_parser(
        "serve", help="HTTP/JSON service: solve, replan, validate, evaluate, export"
    )
    sv.add_argument("--host", default="127.0.0.1", help="address (default 127.0.0.1, loopback)")
    sv.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    sv.add_argument(
        "--max-body-mb", type=float, default=64.0, help="largest request body, MiB (default 64)"
    )
    sv.add_argument(
        "--max-time-limit",
        type=float,
        default=60.0,
        help="cap on a solve's time limit, seconds (default 60)",
    )
    sv.add_argument(
        "--max-concurrent",
        type=int,
        default=2,
        help="worker processes computing at once (default 2)",
    )
    sv.add_argument(
        "--max-requests",
        type=int,
        default=8,
        help="requests admitted at once; more get 503 with Retry-After (default 8)",
    )
    sv.add_argument(
        "--max-memory-mb",
        type=float,
        default=1024.0,
        help="memory budget: a quarter for bodies, the rest split between workers (default 1024)",
    )
    sv.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds to receive a request body; slower gets 408 (default 30)",
    )
    sv.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="seconds a non-solve request may take before its worker is killed (default 120)",
    )
    sv.add_argument(
        "--solve-grace",
        type=float,
        default=10.0,
        help="seconds a solve may run past --max-time-limit before it is killed (default 10)",
    )
    sv.add_argument(
        "--allow-host",
        action="append",
        metavar="NAME",
        help="Host header name to accept (repeatable; '*' any; default loopback names)",
    )
    sv.set_defaults(func=run)
