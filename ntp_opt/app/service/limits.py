"""What the service may spend, and the checks made before a body reaches a worker.

:class:`Limits` (request slots, body bytes, worker memory, deadlines, allowed
hosts); :class:`Guard`, the middleware that checks the ``Host`` header and the
declared ``Content-Length``; then, per ``POST``: :func:`unsupported_media` (415
unless the body is sent as JSON), :func:`reservation` (the body bytes to admit,
413 over the cap), :func:`busy` (503 without room) and :func:`read_body`, which
reads the body under its size cap and deadline (413, 408). See
``docs/service.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from ntp_opt.app.service.errors import error_response
from ntp_opt.model.echo import echo

#: Defaults of :func:`create_app` (and of ``ntp-opt serve``).
DEFAULT_MAX_BODY_BYTES = 64 * 1024**2
DEFAULT_MAX_TIME_LIMIT = 60.0
DEFAULT_TIME_LIMIT = 10.0
DEFAULT_MAX_CONCURRENT = 2
DEFAULT_MAX_REQUESTS = 8
DEFAULT_MEMORY_BYTES = 1024 * 1024**2
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_REQUEST_TIMEOUT = 120.0
DEFAULT_ALLOWED_HOSTS = ("127.0.0.1", "localhost", "::1")
#: Open connections uvicorn serves at once (each costs little: bodies are
#: only read after admission); more get a plain 503.
MAX_CONNECTIONS = 512
#: Extra seconds a solve's worker gets beyond its time limit before it is killed.
SOLVE_GRACE_S = 10.0
#: Memory a worker may use per byte of body it parses (a real instance needs
#: about 8; the per-endpoint body cap is the worker's memory over this).
BYTES_PER_BODY_BYTE = 8


@dataclass(frozen=True)
class Limits:
    """What the service may spend (see ``docs/service.md``).

    Attributes
    ----------
    max_body_bytes
        Largest request body of any endpoint (413 above).
    max_time_limit
        Cap on a solve's time limit, seconds.
    max_concurrent
        Worker processes computing at once (requests wait for one).
    max_requests
        Requests admitted at once (reading, waiting or computing); more get 503.
    memory_bytes
        Memory budget for requests: a quarter holds request bodies in the
        server, the rest is split between the ``max_concurrent`` workers.
    body_timeout
        Seconds to receive a whole body (408 and the connection closed after).
    request_timeout
        Seconds a non-solve request may compute (and any request may wait
        for a worker) before its worker is killed (503).
    solve_grace
        Seconds a solve's worker may run past ``max_time_limit`` (reading,
        validating and answering) before it is killed (503).
    allowed_hosts
        ``Host`` header names accepted (port ignored); ``"*"`` accepts any.
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_time_limit: float = DEFAULT_MAX_TIME_LIMIT
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    max_requests: int = DEFAULT_MAX_REQUESTS
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    solve_grace: float = SOLVE_GRACE_S
    allowed_hosts: tuple[str, ...] = DEFAULT_ALLOWED_HOSTS

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.memory_bytes < 1:
            raise ValueError("max_body_bytes and memory_bytes must be positive")
        for name in ("max_time_limit", "body_timeout", "request_timeout", "solve_grace"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive and finite")
        if self.max_concurrent < 1 or self.max_requests < 1:
            raise ValueError("max_concurrent and max_requests must be at least 1")

    @property
    def body_budget(self) -> int:
        """Bytes of request bodies the server process holds at once."""
        return self.memory_bytes // 4

    @property
    def worker_bytes(self) -> int:
        """Memory one worker may allocate above what it inherits."""
        return (self.memory_bytes - self.body_budget) // self.max_concurrent

    @property
    def endpoint_body_bytes(self) -> int:
        """Largest body of a ``POST`` endpoint: the smallest of the caps."""
        return max(
            1,
            min(
                self.max_body_bytes,
                self.worker_bytes // BYTES_PER_BODY_BYTE,
                self.body_budget // 2,
            ),
        )


def _host_allowed(scope: Scope, allowed: tuple[str, ...]) -> bool:
    if "*" in allowed:
        return True
    host = ""
    for k, v in scope.get("headers") or []:
        if k == b"host":
            host = v.decode("latin-1").strip().lower()
            break
    if host.startswith("["):  # [::1]:8000
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host in allowed


class Guard:
    """ASGI middleware: ``Host`` allowlist (400) and the ``Content-Length`` cap (413)."""

    def __init__(self, app: ASGIApp, limits: Limits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not _host_allowed(scope, self.limits.allowed_hosts):
            msg = "Host header not allowed (the server's --allow-host)"
            await error_response(400, "bad Host header", [("Host", msg)])(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                over = int(length) > self.limits.max_body_bytes
            except ValueError:
                await error_response(400, "malformed Content-Length header")(scope, receive, send)
                return
            if over:
                await too_big(self.limits.max_body_bytes)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def too_big(cap: int) -> JSONResponse:
    """413: a body (declared or read) larger than ``cap`` bytes; the connection closes."""
    return error_response(
        413,
        f"request body larger than {cap} bytes (the server's --max-body-mb and --max-memory-mb)",
        headers={"Connection": "close"},
    )


#: Kept for callers of the previous version.
BodyLimit = Guard


def unsupported_media(request: Request) -> Response | None:
    """415 unless the body is sent as ``Content-Type: application/json``, else ``None``."""
    media = request.headers.get("content-type")
    if (media or "").split(";")[0].strip().lower() == "application/json":
        return None
    # a web page may POST text/plain, forms or a typeless body to a local
    # port without asking first (no CORS preflight); JSON needs the header
    got = "none" if media is None else repr(echo(media, 100))
    return error_response(
        415,
        "the body must be JSON sent as Content-Type: application/json",
        [("Content-Type", f"expected application/json, got {got}")],
    )


def reservation(request: Request, cap: int) -> int | None:
    """Body bytes to reserve before reading: the declared ``Content-Length`` (or ``cap``
    when none is declared); ``None`` when the declared length is over ``cap``."""
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit():
        return cap
    return int(declared) if int(declared) <= cap else None


def busy(limits: Limits) -> Response:
    """503 with ``Retry-After``: no request slot or no room in the body budget."""
    return error_response(
        503,
        f"busy: {limits.max_requests} requests or {limits.body_budget} bytes of bodies "
        "in progress; retry later",
        # no "Connection: close": a client that sends its whole body
        # before reading (no Expect: 100-continue) would see a broken
        # pipe instead of this answer; uvicorn discards the body
        headers={"Retry-After": "1"},
    )


async def read_body(request: Request, cap: int, timeout: float) -> bytes | Response:
    """The body, or the error response: 413 over ``cap`` bytes, 408 after ``timeout`` s."""
    buf = bytearray()
    try:
        with anyio.fail_after(timeout):
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > cap:
                    return too_big(cap)
    except TimeoutError:
        return error_response(
            408,
            f"request body not received within {timeout:g} s (the server's --body-timeout)",
            headers={"Connection": "close"},
        )
    except ClientDisconnect:
        return error_response(400, "client disconnected", headers={"Connection": "close"})
    return bytes(buf)
