"""The worker processes: one fresh process per request, under a memory limit and a deadline.

:class:`WorkerPool` admits requests (request slots, body bytes), starts each
request's worker from a ``forkserver`` (:func:`forkserver_context`), waits for
its answer until the deadline and kills it then; :meth:`WorkerPool.kill_all`
stops every worker on shutdown.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import resource
import sys
import threading
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import anyio
import anyio.to_thread

from ntp_opt.app.service.errors import error_body
from ntp_opt.app.service.handlers import handle
from ntp_opt.app.service.limits import Limits

log = logging.getLogger("ntp_opt.service")

_MEMORY_MESSAGE = (
    "the request needs more memory than a worker's budget (the server's --max-memory-mb)"
)


def _data_limit(extra: int) -> None:
    """Cap this process's data segment at what it has now plus ``extra`` bytes."""
    vm_data = 0
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmData:"):
                    vm_data = int(line.split()[1]) * 1024
    except OSError:
        return
    if vm_data:
        limit = vm_data + extra
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _worker(
    endpoint: str, body: bytes, max_time_limit: float, memory: int, conn: Connection
) -> None:
    """Entry point of a worker process: one request, then exit."""
    try:
        os.nice(10)  # the server's event loop (/health, admission) goes first
        _data_limit(memory)
        try:
            status, payload = handle(endpoint, body, max_time_limit)
        except MemoryError:
            body = b""
            status, payload = 413, json.dumps(error_body(_MEMORY_MESSAGE)).encode()
        except RecursionError:
            status, payload = 422, json.dumps(error_body("input nested too deeply")).encode()
        conn.send((status, payload))
    except BaseException:  # a bug: the traceback goes to the server log only
        traceback.print_exc(file=sys.stderr)
        try:
            conn.send((500, json.dumps(error_body("internal error; see the server log")).encode()))
        except Exception:
            pass
    finally:
        conn.close()


_CONTEXT: Any = None


def forkserver_context() -> Any:
    """The ``forkserver`` context, with this module preloaded (fast, thread-safe forks)."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        _CONTEXT = ctx
    return _CONTEXT


@dataclass
class WorkerPool:
    """Admission (request slots, body bytes) and worker processes of one app."""

    limits: Limits
    requests: int = 0
    body_bytes: int = 0
    closing: bool = False
    children: set[Any] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    workers: anyio.Semaphore | None = None

    def admit(self, reserve: int) -> bool:
        """Take a request slot and ``reserve`` bytes of the body budget, if both are free."""
        with self.lock:
            if self.closing or self.requests >= self.limits.max_requests:
                return False
            if self.body_bytes + reserve > self.limits.body_budget:
                return False
            self.requests += 1
            self.body_bytes += reserve
            return True

    def release(self, reserve: int) -> None:
        """Give back what :meth:`admit` took."""
        with self.lock:
            self.requests -= 1
            self.body_bytes -= reserve

    def kill_all(self) -> None:
        """Stop admitting and kill every worker (on shutdown)."""
        with self.lock:
            self.closing = True
            children = list(self.children)
        for proc in children:
            try:
                proc.kill()
            except Exception:
                pass

    async def compute(self, endpoint: str, body: bytes, timeout: float) -> tuple[int, bytes] | None:
        """Wait for a free worker (at most ``limits.request_timeout``), then :meth:`run`.

        Returns
        -------
        (int, bytes) or None
            The HTTP status and JSON body, or ``None`` if no worker was free in time.
        """
        if self.workers is None:
            self.workers = anyio.Semaphore(self.limits.max_concurrent)
        try:
            with anyio.fail_after(self.limits.request_timeout):
                await self.workers.acquire()
        except TimeoutError:
            return None
        try:
            return await anyio.to_thread.run_sync(
                self.run, endpoint, body, timeout, abandon_on_cancel=True
            )
        finally:
            self.workers.release()

    def run(self, endpoint: str, body: bytes, timeout: float) -> tuple[int, bytes]:
        """Run one request in a fresh worker; blocking (called in a thread)."""
        if self.closing:
            return 503, json.dumps(error_body("the server is shutting down")).encode()
        ctx = forkserver_context()
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_worker,
            args=(endpoint, body, self.limits.max_time_limit, self.limits.worker_bytes, send),
            daemon=True,
        )
        try:
            proc.start()
        except OSError as err:  # out of processes or memory: a server-side limit
            log.error("could not start a worker: %s", err)
            send.close()
            recv.close()
            return 503, json.dumps(error_body("no worker could be started; retry later")).encode()
        with self.lock:
            self.children.add(proc)
            if self.closing:  # shutdown began while it started
                proc.kill()
        send.close()
        del body
        try:
            if not recv.poll(timeout):
                return 503, json.dumps(
                    error_body(f"stopped at the request deadline ({timeout:.0f} s); retry later")
                ).encode()
            try:
                status, payload = recv.recv()
            except (EOFError, OSError):
                proc.join(5)
                if self.closing:
                    return 503, json.dumps(error_body("the server is shutting down")).encode()
                if proc.exitcode == -9:  # the kernel's OOM killer
                    return 413, json.dumps(error_body(_MEMORY_MESSAGE)).encode()
                return 500, json.dumps(
                    error_body(f"worker exited with {proc.exitcode}; see the server log")
                ).encode()
            return int(status), bytes(payload)
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join()
            recv.close()
            with self.lock:
                self.children.discard(proc)
            proc.close()
