"""Shared helpers of the ``ntp-opt`` command line (parser class, argument types, output, errors)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # imported by the commands that use them (the parser's own import is light)
    from pydantic import ValidationError
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from ntp_opt.model.instance import Instance

from ntp_opt.model.echo import echo

EPILOG = """\
examples:
  ntp-opt gen --builder nvl32 --gpus 4096 --fail-fraction 0.002 --tp 32 --pp 8 \\
      --global-batch 256 -o my.json       write an instance
  ntp-opt import slurm --topology topology.yaml --nodes nodes.txt \\
      --job job.json -o my.json           from a real cluster (also: import k8s)
  ntp-opt info my.json                       what is in it
  ntp-opt solve my.json --planner ntp-pw -o plan.json
  ntp-opt compare my.json                    every policy side by side
  ntp-opt validate my.json plan.json         exit 1 if the plan breaks a rule
  ntp-opt evaluate my.json plan.json --json  recomputed goodput
  ntp-opt schema instance                    the JSON Schema of instance files
  ntp-opt export --to megatron-ntp plan.json --instance my.json -o launch/
  ntp-opt serve --port 8000                  HTTP/JSON service on 127.0.0.1
  ntp-opt plot my.json plan.json -o plan.html  a picture of the plan
"""

#: Characters of an error or warning line shown before it is cut (its echoes are cut
#: shorter, :data:`ntp_opt.model.echo.MAX_ECHO`, where the message builds them).
MAX_LINE = 500

#: Exit status after Ctrl-C (128 + SIGINT); the best plan found is still written.
INTERRUPTED_EXIT = 130
#: Exit status after SIGTERM (128 + SIGTERM: ``scancel``, Slurm's time limit, a pod's
#: deletion); during a search the best plan found is still written, as after Ctrl-C.
TERMINATED_EXIT = 143


def interrupted_note() -> None:
    """Tell stderr that Ctrl-C stopped the search and the best plan found is kept."""
    print("ntp-opt: interrupted: the best plan found so far is kept", file=sys.stderr)


@contextlib.contextmanager
def stop_on_signals(cancel: threading.Event) -> Iterator[set[int]]:
    """While inside, SIGINT and SIGTERM set ``cancel``: the search stops with its best plan.

    Wrap a command's searches (``solve(..., cancel=cancel)``) in it; afterwards
    :func:`stopped_status` gives the exit status. Outside it, SIGTERM ends the
    command at once (:class:`Terminated`).

    Yields
    ------
    set of int
        The signals received (filled while inside).
    """
    from ntp_opt.model.control import signals_set

    with signals_set(cancel, (signal.SIGINT, signal.SIGTERM)) as received:
        yield received


def stopped_status(received: set[int]) -> int:
    """Print the note of a stopped search; its exit status (143 after SIGTERM, else 130)."""
    if signal.SIGTERM in received:
        print("ntp-opt: terminated: the best plan found so far is kept", file=sys.stderr)
        return TERMINATED_EXIT
    interrupted_note()
    return INTERRUPTED_EXIT


def make_console() -> Console:
    """A rich console for tables; 160 columns wide when stdout is not a terminal.

    Its ``print`` reads no markup and no emoji codes: a name holding ``[/]`` or
    ``:smile:`` is printed as it is (its control characters escaped by
    :func:`ntp_opt.model.echo.echo` where the command echoes it).
    """
    from rich.console import Console

    # Wide enough for the tables when the output is a file or a pipe.
    con = Console(highlight=False, markup=False, emoji=False)
    if not con.is_terminal:
        con = Console(highlight=False, markup=False, emoji=False, width=160)
    return con


def status_console() -> Console:
    """The rich console of live status lines: stderr (a terminal or not: ask ``is_terminal``)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, markup=False, emoji=False)


def progress_bar(
    disable: bool, *, transient: bool = False, terminal_only: bool = False
) -> Progress:
    """A rich progress bar (count, elapsed time, ETA) on stderr.

    Parameters
    ----------
    disable
        Show nothing.
    transient
        Clear the bar when it stops.
    terminal_only
        Show nothing either when stderr is not a terminal.

    Returns
    -------
    rich.progress.Progress
        Not started (use it as a context manager).
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=disable or (terminal_only and not console.is_terminal),
        transient=transient,
    )


def warn(message: str) -> None:
    """Print ``ntp-opt: warning: MESSAGE`` on stderr, as one printable line."""
    print(f"ntp-opt: warning: {echo(message, MAX_LINE)}", file=sys.stderr)


def error_line(message: str) -> str:
    """``ntp-opt: error: MESSAGE``: its first line, printable, cut, and how many lines more."""
    lines = message.splitlines() or [""]
    more = f" (and {len(lines) - 1} more lines)" if len(lines) > 1 else ""
    return f"ntp-opt: error: {echo(lines[0], MAX_LINE)}{more}"


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Load the command's inputs inside: they stay out of the garbage collector's work.

    Parsing a large file allocates a few hundred thousand containers that form
    no cycles and live until the command ends: the collector is paused while
    they are built (they would start hundreds of collections that free
    nothing), then they are frozen (:func:`gc.freeze`: never walked again).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def fmt(x: float | None, digits: int = 4) -> str:
    """Format ``x`` with ``digits`` decimals, ``-`` for None."""
    return "-" if x is None else f"{x:.{digits}f}"


def instance_line(instance: Instance) -> str:
    """One line summarising ``instance`` (name, GPUs, job)."""
    s = instance.summary()
    return (
        f"{echo(s['name'])}: {s['gpus']} GPUs in {s['domains']} domains / {s['racks']} racks, "
        f"{s['failed']} failed, {s['stragglers']} stragglers; job TP{s['tp']} x PP{s['pp']} "
        f"x DP{s['dp']}, global batch {s['global_batch']} ({s['batch_policy']})"
    )


def stream_name(stream: IO[Any], what: str) -> str:
    """Where ``stream`` goes: ``PATH (what)`` when the system tells, else ``what``."""
    try:
        target = os.readlink(f"/proc/self/fd/{stream.fileno()}")
    except (OSError, ValueError, AttributeError):
        return what
    return f"{target} ({what})" if target.startswith("/") else what


class NamedStream:
    """A text stream whose write errors name it (``OSError.filename``).

    ``print`` to a full disk raises ``OSError(ENOSPC)`` without a file name;
    through this wrapper the error names where the stream goes.
    """

    def __init__(self, stream: IO[str], what: str):
        self.stream = stream
        self.what = what

    def _named(self, err: OSError) -> OSError:
        if err.filename is not None:
            return err
        return type(err)(err.errno, err.strerror or str(err), stream_name(self.stream, self.what))

    def write(self, text: str) -> int:
        """Write ``text``; an error names the stream."""
        try:
            return self.stream.write(text)
        except OSError as err:
            raise self._named(err) from None

    def flush(self) -> None:
        """Flush; an error names the stream."""
        try:
            self.stream.flush()
        except OSError as err:
            raise self._named(err) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def named_stdout() -> Iterator[None]:
    """While inside, a failed write to stdout names where it goes; flushed at the end."""
    stream = sys.stdout
    proxy = NamedStream(stream, "standard output")
    sys.stdout = proxy
    try:
        yield
        proxy.flush()  # a full disk shows here, while the error can still be reported
    finally:
        if sys.stdout is proxy:
            sys.stdout = stream


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``ntp-opt: error: ...``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{error_line(message)} (see '{self.prog} --help')\n")


class Terminated(BaseException):
    """Raised by the SIGTERM handler so that every ``finally`` (temp files) runs."""


def on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM handler: raise :class:`Terminated`."""
    raise Terminated(signum)


def validation_text(err: ValidationError, flags: dict[str, str] | None = None) -> str:
    """One-line text of a pydantic error, fields renamed to their ``flags``."""
    problems = err.errors(include_url=False)
    first = problems[0]
    field = ".".join(str(x) for x in first["loc"])
    field = (flags or {}).get(field, field)
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{field}: {msg}{more}" if field else f"{msg}{more}"


def error_text(err: BaseException) -> str:
    """One-line text of an OS, key or value error."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    if isinstance(err, KeyError) and err.args:
        return str(err.args[0])
    return str(err)


#: ``--threads`` may ask for at most this many backend threads per core the process may use.
THREADS_PER_CORE = 4


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the system tells)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def threads_arg(text: str) -> int:
    """``--threads``: an integer from 1 to :data:`THREADS_PER_CORE` x the usable cores."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {echo(text, 40)!r}") from None
    cores = usable_cores()
    most = THREADS_PER_CORE * cores
    if not 1 <= value <= most:
        raise argparse.ArgumentTypeError(
            f"must be 1 to {most} ({THREADS_PER_CORE} x the {cores} core"
            f"{'s' if cores > 1 else ''} this process may use), got {value}"
        )
    return value


@dataclass(frozen=True)
class _Cells:
    """The widths :func:`fitted_tables` needs of its columns."""

    headers: Sequence[str]
    rows: Sequence[Sequence[str]]

    def need(self, i: int, whole_header: bool) -> int:
        """Width of column ``i``: its widest cell, and its header whole or its longest word."""
        h = self.headers[i]
        head = h if whole_header else max(h.split(), key=len)
        return max([len(head), *(len(r[i]) for r in self.rows)])

    def table_width(self, cols: list[int], whole: bool, edge: bool) -> int:
        """Width of a table of columns ``cols`` (``edge``: with the outer border)."""
        # padding 2 and one border per column, one more border with the outer edge
        return sum(self.need(i, whole) + 3 for i in cols) + (1 if edge else -1)


def fitted_tables(
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int,
    keep: int,
    left: Sequence[str] = (),
) -> list[Table]:
    """``rows`` as tables no wider than ``width``: columns dropped into stacked tables.

    Parameters
    ----------
    title
        Title of the first table.
    headers
        Column headers in priority order: the first ``keep`` are always in the
        first table (the first of them, the row's name, in every table), the
        others follow while they fit, and those left over go to further tables
        below, each with the name column.
    rows
        Cells (printable text), one list per row, in the order of ``headers``.
    width
        Columns of the terminal.
    keep
        How many leading columns must show.
    left
        Headers of the columns justified left (besides the name); others right.

    Returns
    -------
    list of rich.table.Table
        Each cell shown whole: a column is as wide as its widest cell (its
        header may wrap between words); the outer border is left out when the
        ``keep`` columns need its two columns; at a width too small even then,
        cells wrap rather than being cut.
    """
    from rich.table import Table

    cells = _Cells(headers, rows)
    groups: list[list[int]] = []
    pending = list(range(len(headers)))
    whole = cells.table_width(pending, True, True) <= width
    edge = cells.table_width(pending[:keep], False, True) <= width  # without it, 2 columns more
    while pending:
        group = pending[:keep] if not groups else [0]
        rest = [i for i in pending if i not in group]
        for i in rest:
            if cells.table_width([*group, i], whole, edge) <= width or (groups and len(group) == 1):
                group.append(i)
        groups.append(sorted(group))
        pending = [i for i in pending if i not in group]
    tables = []
    for n, group in enumerate(groups):
        t = Table(
            title=title if n == 0 else "(more columns)",
            title_justify="left",
            highlight=False,
            show_edge=edge,
        )
        for i in group:
            t.add_column(
                headers[i],
                justify="left" if i == 0 or headers[i] in left else "right",
                width=None if whole else cells.need(i, False),
                overflow="fold",
            )
        for r in rows:
            t.add_row(*(r[i] for i in group))
        tables.append(t)
    return tables
