"""Progress reports, cancellation and Ctrl-C for a running solve.

:func:`ntp_opt.solve.solve` takes ``callback=`` (called with a
:class:`SolveProgress` at every improvement of the incumbent or of the bound)
and ``cancel=`` (a :class:`threading.Event`; once set, every planner stops at
its next check and returns its best plan with ``limit="interrupted"``).
While :func:`~ntp_opt.solve.solve` runs in the main thread, SIGINT (Ctrl-C)
sets the same event instead of raising :class:`KeyboardInterrupt`, and the
previous handler is restored afterwards (see ``docs/api.md``).

Nothing here prints: progress also goes to the ``ntp_opt`` loggers
(``logging.getLogger("ntp_opt")``), which have no handlers in the library.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SolveProgress:
    """One progress report of a running solve.

    Attributes
    ----------
    planner
        Planner name.
    elapsed
        Seconds since :func:`~ntp_opt.solve.solve` started.
    incumbent
        Goodput (sequences/s) of the best plan found so far, checked by the
        validator; ``None`` before the first plan.
    bound
        Best proven upper bound on goodput so far, or ``None``.
    gap
        ``(bound - incumbent) / bound``, or ``None`` without both.
    final
        True for the last report, made with the returned result.
    """

    planner: str
    elapsed: float
    incumbent: float | None
    bound: float | None
    gap: float | None
    final: bool = False


Callback = Callable[[SolveProgress], None]


class Control:
    """The callback, cancel token and clock of one solve (internal).

    Reports are monotone: the incumbent only rises and the bound only falls;
    a report that improves neither is not passed on.

    Parameters
    ----------
    planner
        Planner name, copied into every report.
    callback
        Called with each :class:`SolveProgress`, or ``None``.
    cancel
        Cancel token; a new (never set) one when ``None``.
    """

    def __init__(
        self,
        planner: str,
        callback: Callback | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.planner = planner
        self.callback = callback
        self.cancel = cancel if cancel is not None else threading.Event()
        self.start = time.perf_counter()
        self.incumbent: float | None = None
        self.bound: float | None = None

    @property
    def cancelled(self) -> bool:
        """Whether the cancel token is set."""
        return self.cancel.is_set()

    def report(
        self, incumbent: float | None = None, bound: float | None = None, *, final: bool = False
    ) -> None:
        """Record an incumbent goodput and/or a proven bound; report improvements."""
        changed = final
        if incumbent is not None and (self.incumbent is None or incumbent > self.incumbent):
            self.incumbent = incumbent
            changed = True
        if (
            bound is not None
            and math.isfinite(bound)
            and (self.bound is None or bound < self.bound)
        ):
            self.bound = bound
            changed = True
        if not changed:
            return
        gap = None
        if self.incumbent is not None and self.bound is not None:
            gap = 0.0 if self.bound <= 0 else max(0.0, (self.bound - self.incumbent) / self.bound)
        progress = SolveProgress(
            self.planner,
            time.perf_counter() - self.start,
            self.incumbent,
            self.bound,
            gap,
            final,
        )
        logger.info(
            "%s: %.2f s, incumbent %s, bound %s, gap %s%s",
            self.planner,
            progress.elapsed,
            "-" if progress.incumbent is None else f"{progress.incumbent:.9g}",
            "-" if progress.bound is None else f"{progress.bound:.9g}",
            "-" if gap is None else f"{100 * gap:.4f} %",
            " (final)" if final else "",
        )
        if self.callback is not None:
            self.callback(progress)


@dataclass(frozen=True)
class Deadline:
    """A ``time.perf_counter()`` deadline and the cancel token of a :class:`Control`.

    Attributes
    ----------
    control
        Its :attr:`Control.cancelled` stops the work too.
    at
        ``time.perf_counter()`` value by which to stop (``None``: no limit).
    """

    control: Control
    at: float | None

    def remaining(self) -> float | None:
        """Seconds left (``None``: no limit; at most 0 once passed)."""
        return None if self.at is None else self.at - time.perf_counter()

    def stopped(self) -> bool:
        """Whether the cancel token is set or the deadline has passed."""
        left = self.remaining()
        return self.control.cancelled or (left is not None and left <= 0)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def sigint_sets(event: threading.Event) -> Iterator[None]:
    """While inside, SIGINT sets ``event`` instead of raising KeyboardInterrupt.

    Only in the main thread (elsewhere, and when SIGINT is ignored, nothing
    changes). The previous Python handler is restored on exit. A watcher
    thread reads the signal wake-up file descriptor, so the event is set
    even while the main thread is blocked inside a solver's C++ code (where
    Python handlers cannot run); when another wake-up fd is already in use
    (an asyncio loop, or an enclosing :func:`signals_set`) only the
    Python-level handler sets the event (the enclosing watcher sees the
    signal too).
    """
    with signals_set(event, (signal.SIGINT,)):
        yield


@contextlib.contextmanager
def signals_set(
    event: threading.Event, signals: tuple[int, ...] = (signal.SIGINT,)
) -> Iterator[set[int]]:
    """While inside, each of ``signals`` sets ``event`` instead of its usual action.

    As :func:`sigint_sets` for several signals (the command line passes
    SIGINT and SIGTERM, so that ``scancel`` or a pod's deletion keeps the
    best plan as Ctrl-C does). A signal that is ignored is left alone.

    Parameters
    ----------
    event
        The cancel token to set.
    signals
        The signal numbers to catch.

    Yields
    ------
    set of int
        The signals received so far (filled while inside).
    """
    received: set[int] = set()
    if not _in_main_thread():
        yield received
        return
    previous = {s: signal.getsignal(s) for s in signals}
    caught = tuple(s for s in signals if previous[s] != signal.SIG_IGN)
    if not caught:
        yield received
        return
    catcher = _Catcher(event, caught, received)
    for s in caught:
        signal.signal(s, catcher.handler)
    reader, writer = socket.socketpair()
    reader.setblocking(True)
    writer.setblocking(False)
    watching = _own_wakeup_fd(writer)
    stop = threading.Event()
    watcher = threading.Thread(
        target=catcher.watch, args=(reader, stop), name="ntp_opt-signals", daemon=True
    )
    if watching:
        watcher.start()
    try:
        yield received
    finally:
        if watching:
            signal.set_wakeup_fd(-1)
        for s in caught:
            signal.signal(s, previous[s])
        stop.set()
        with contextlib.suppress(OSError):
            writer.send(b"\0")  # wake the watcher up
        if watching:
            watcher.join()
        reader.close()
        writer.close()


@dataclass(frozen=True, eq=False)
class _Catcher:
    """What :func:`signals_set`'s handler and watcher thread share."""

    event: threading.Event
    caught: tuple[int, ...]
    received: set[int]

    def handler(self, signum: int, frame: object) -> None:
        """The Python-level signal handler: record the signal, set the event."""
        self.received.add(signum)
        self.event.set()

    def watch(self, reader: socket.socket, stop: threading.Event) -> None:
        """Read the wake-up fd until ``stop``: set the event on a caught signal."""
        while not stop.is_set():
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            hit = [s for s in self.caught if s in data]
            if hit:
                self.received.update(hit)
                self.event.set()


def _own_wakeup_fd(writer: socket.socket) -> bool:
    """Make ``writer`` the signal wake-up fd unless another one is in use (then keep it)."""
    try:
        old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        if old_fd != -1:  # someone else's wake-up fd: keep it
            signal.set_wakeup_fd(old_fd)
        else:
            return True
    except (ValueError, OSError):  # pragma: no cover - not the main thread / no fd
        pass
    return False


def restore_sigint(previous: object) -> None:
    """Reinstall the SIGINT handler ``previous`` (main thread only).

    After a CP-SAT solve OR-Tools can leave SIGINT at its C default action
    (the process dies on Ctrl-C) while :func:`signal.getsignal` still names
    the Python handler; :func:`signal.signal` puts it back in place.
    """
    if _in_main_thread() and (callable(previous) or previous in (signal.SIG_DFL, signal.SIG_IGN)):
        signal.signal(signal.SIGINT, previous)  # type: ignore[arg-type]


__all__ = [
    "Callback",
    "Control",
    "Deadline",
    "SolveProgress",
    "restore_sigint",
    "sigint_sets",
    "signals_set",
]
