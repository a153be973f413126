"""The ``ntp-opt`` command line: one module per sub-command.

Every sub-command reads and writes the JSON formats of :mod:`ntp_opt.files`.
Bad input ends with one line ``ntp-opt: error: FILE: FIELD: message`` and exit
status 2; an infeasible plan given to ``validate`` exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence

from pydantic import ValidationError

from ntp_opt.app.cli import (
    bench,
    compare,
    evaluate,
    export,
    gen,
    info,
    plot,
    replan,
    schema,
    serve,
    solve,
    validate,
)
from ntp_opt.app.cli.common import (
    EPILOG,
    INTERRUPTED_EXIT,
    Parser,
    Terminated,
    error_text,
    on_sigterm,
    validation_text,
)
from ntp_opt.app.cli.compare import EXACT_NAMES
from ntp_opt.app.cli.gen import MAX_NAME
from ntp_opt.app.cli.replan import load_events, parse_event
from ntp_opt.model import topology
from ntp_opt.model.files import InputError

__all__ = [
    "EPILOG",
    "EXACT_NAMES",
    "INTERRUPTED_EXIT",
    "MAX_NAME",
    "build_parser",
    "load_events",
    "main",
    "parse_event",
]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ntp-opt`` (exposed for docs and tests)."""
    parser = Parser(
        prog="ntp-opt",
        description=(
            "Plan LLM training with nonuniform tensor parallelism on a GPU cluster "
            "that has failed, slow or risky GPUs."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for add in (
        gen.add_parser,
        info.add_parser,
        solve.add_parser,
        replan.add_parser,
        compare.add_parser,
        validate.add_parser,
        evaluate.add_parser,
        schema.add_parser,
        bench.add_parser,
        export.add_parser,
        plot.add_parser,
        serve.add_parser,
    ):
        add(sub)

    from ntp_opt.multi.cli import add_parser as add_multi_parser

    add_multi_parser(sub)
    from ntp_opt.app.importers.cli import add_parser as add_import_parser

    add_import_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ntp-opt``; returns the exit status.

    SIGTERM and SIGINT end the command cleanly (exit 143 / 130): the
    temporary file of a save in progress is removed, no output is left
    half-written (``serve`` handles its own signals). A Ctrl-C that lands
    while the command is already cleaning up still exits 130, without a
    traceback.
    """
    try:
        return _run(argv)
    except KeyboardInterrupt:  # after _run's own handler: during its clean-up
        print("ntp-opt: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = None
    if args.command != "serve" and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        status: int = args.func(args)
        return status
    except BrokenPipeError:
        # the reader went away (`ntp-opt schema instance | head`): stop quietly, and
        # point stdout at /dev/null so that the exit flush does not complain either
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return 141  # 128 + SIGPIPE, as for a process killed by the signal
    except (InputError, topology.TopologyError) as err:
        if isinstance(err, InputError):
            first = str(err).splitlines()[0]
        else:
            first = f"invalid cluster topology: {err.problems[0] if err.problems else err}"
        n = len(err.problems)
        more = f" (and {n - 1} more problem{'s' if n > 2 else ''})" if n > 1 else ""
        print(f"ntp-opt: error: {first}{more}", file=sys.stderr)
        return 2
    except ValidationError as err:  # a model built from flags: no pydantic URLs
        print(f"ntp-opt: error: {validation_text(err)}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, OSError) as err:
        lines = error_text(err).splitlines() or [type(err).__name__]
        more = f" (and {len(lines) - 1} more lines)" if len(lines) > 1 else ""
        print(f"ntp-opt: error: {lines[0]}{more}", file=sys.stderr)  # always one line
        return 2
    except KeyboardInterrupt:
        print("ntp-opt: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    except Terminated:
        print("ntp-opt: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
