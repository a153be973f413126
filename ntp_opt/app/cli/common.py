"""Shared helpers of the ``ntp-opt`` command line (parser class, argument types, output, errors)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:  # imported by the commands that use them (the parser's own import is light)
    from pydantic import ValidationError
    from rich.console import Console

    from ntp_opt.model.instance import Instance

EPILOG = """\
examples:
  ntp-opt gen --builder nvl32 --gpus 4096 --fail-fraction 0.002 --tp 32 --pp 8 \\
      --global-batch 256 -o my.json       write an instance
  ntp-opt import slurm --topology topology.yaml --nodes nodes.txt \\
      --job job.json -o my.json           from a real cluster (also: import k8s)
  ntp-opt info my.json                       what is in it
  ntp-opt solve my.json --policy ntp-pw -o plan.json
  ntp-opt compare my.json                    every policy side by side
  ntp-opt validate my.json plan.json         exit 1 if the plan breaks a rule
  ntp-opt evaluate my.json plan.json --json  recomputed goodput
  ntp-opt schema instance                    the JSON Schema of instance files
  ntp-opt export --to megatron-ntp plan.json --instance my.json -o launch/
  ntp-opt serve --port 8000                  HTTP/JSON service on 127.0.0.1
  ntp-opt plot my.json plan.json -o plan.html  a picture of the plan
"""

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
    """A rich console for tables; 160 columns wide when stdout is not a terminal."""
    from rich.console import Console

    # Wide enough for the tables when the output is a file or a pipe.
    con = Console(highlight=False)
    if not con.is_terminal:
        con = Console(highlight=False, width=160)
    return con


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
        f"{s['name']}: {s['gpus']} GPUs in {s['domains']} domains / {s['racks']} racks, "
        f"{s['failed']} failed, {s['stragglers']} stragglers; job TP{s['tp']} x PP{s['pp']} "
        f"x DP{s['dp']}, global batch {s['global_batch']} ({s['batch_policy']})"
    )


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``ntp-opt: error: ...``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"ntp-opt: error: {message} (see '{self.prog} --help')\n")


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
