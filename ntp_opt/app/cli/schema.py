"""The ``ntp-opt schema`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ntp_opt.model.files import (
    json_schema,
)


def run(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(args.kind), indent=2))
    return 0


def add_parser(sub: Any) -> None:
    """The ``ntp-opt schema`` subcommand."""
    sc = sub.add_parser("schema", help="print the JSON Schema of instance or plan files")
    sc.add_argument("kind", choices=["instance", "plan"])
    sc.set_defaults(func=run)
