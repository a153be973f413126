"""The ``ntp-opt`` command line: one module per sub-command.

Every sub-command reads and writes the JSON formats of :mod:`ntp_opt.model.files`.
Bad input ends with one line ``ntp-opt: error: FILE: FIELD: message`` and exit
status 2; an infeasible plan given to ``validate`` exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ntp_opt.app.cli.common import (
    EPILOG,
    INTERRUPTED_EXIT,
    Parser,
    Terminated,
    error_line,
    error_text,
    loading,
    named_stdout,
    on_sigterm,
    validation_text,
)

if TYPE_CHECKING:
    from ntp_opt.app.cli.compare import EXACT_NAMES
    from ntp_opt.app.cli.gen import MAX_NAME
    from ntp_opt.app.cli.replan import load_events, parse_event

__all__ = [
    "COMMANDS",
    "EPILOG",
    "EXACT_NAMES",
    "INTERRUPTED_EXIT",
    "MAX_NAME",
    "build_parser",
    "load_events",
    "main",
    "parse_event",
]

#: Every sub-command, in the order of ``ntp-opt --help``: its name and the module
#: whose ``add_parser(sub)`` adds it (and whose ``run`` it calls). A command's module
#: is imported only when the command line names it or the full parser is built.
COMMANDS: dict[str, str] = {
    "gen": "ntp_opt.app.cli.gen",
    "info": "ntp_opt.app.cli.info",
    "solve": "ntp_opt.app.cli.solve",
    "replan": "ntp_opt.app.cli.replan",
    "compare": "ntp_opt.app.cli.compare",
    "validate": "ntp_opt.app.cli.validate",
    "evaluate": "ntp_opt.app.cli.evaluate",
    "schema": "ntp_opt.app.cli.schema",
    "bench": "ntp_opt.app.cli.bench",
    "export": "ntp_opt.app.cli.export",
    "plot": "ntp_opt.app.cli.plot",
    "serve": "ntp_opt.app.cli.serve",
    "multi": "ntp_opt.app.cli.multi",
    "import": "ntp_opt.app.importers.cli",
    "watch": "ntp_opt.app.cli.watch",
}

#: Names re-exported from the command modules (imported on first use, PEP 562).
_REEXPORTS = {
    "EXACT_NAMES": "ntp_opt.app.cli.compare",
    "MAX_NAME": "ntp_opt.app.cli.gen",
    "load_events": "ntp_opt.app.cli.replan",
    "parse_event": "ntp_opt.app.cli.replan",
}


def __getattr__(name: str) -> Any:
    if name in _REEXPORTS:
        value = getattr(importlib.import_module(_REEXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``ntp-opt`` (exposed for docs and tests).

    Parameters
    ----------
    only
        A command of :data:`COMMANDS`: only its module is imported and its
        sub-parser built; the others are placeholders without arguments or
        help (for a command line that names ``only``, which never reaches
        them). ``None``: every command, as ``ntp-opt --help`` lists them.
    """
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
    for name, module in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names first, if it names one before any option (else ``None``)."""
    return argv[0] if argv and argv[0] in COMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ntp-opt``; returns the exit status.

    SIGTERM and SIGINT end the command cleanly (exit 143 / 130): the
    temporary file of a save in progress is removed, no output is left
    half-written (``serve`` handles its own signals). During the search of
    ``solve`` and ``compare`` both stop the search instead, and the best plan
    found is still printed and written before that exit. A Ctrl-C that lands
    while the command is already cleaning up still exits 130, without a
    traceback.
    """
    thawed = gc.get_freeze_count() == 0
    try:
        return _run(argv)
    except KeyboardInterrupt:  # after _run's own handler: during its clean-up
        print("ntp-opt: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    finally:
        if thawed:  # what the command froze (common.loading) is the collector's again
            gc.unfreeze()


def _run(argv: Sequence[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    with loading():  # the modules: the command's, and those of the errors it may raise
        parser = build_parser(_command(argv))
        from pydantic import ValidationError

        from ntp_opt.model import topology
        from ntp_opt.model.files import InputError
    args = parser.parse_args(argv)
    previous = None
    if args.command != "serve" and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with named_stdout():
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
        print(f"{error_line(first)}{more}", file=sys.stderr)
        return 2
    except ValidationError as err:  # a model built from flags: no pydantic URLs
        print(error_line(validation_text(err)), file=sys.stderr)
        return 2
    except (ValueError, KeyError, OSError) as err:
        text = error_text(err) or type(err).__name__
        print(error_line(text), file=sys.stderr)  # always one printable line
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
