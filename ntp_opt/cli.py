"""Compatibility path: the code lives in :mod:`ntp_opt.app.cli`; ``python -m ntp_opt.cli`` works."""

import sys

from ntp_opt.app.cli import *  # noqa: F403
from ntp_opt.app.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
