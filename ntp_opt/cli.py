"""Compatibility path: the code lives in :mod:`ntp_opt.app.cli`; ``python -m ntp_opt.cli`` works."""

import sys

from ntp_opt.app import cli as _module
from ntp_opt.app.cli import *  # noqa: F403

if __name__ == "__main__":  # pragma: no cover
    sys.exit(_module.main())
sys.modules[__name__] = _module
