"""Compatibility path: the code lives in :mod:`ntp_opt.app.importers.cli`."""

import sys

from ntp_opt.app.importers import cli as _module
from ntp_opt.app.importers.cli import *  # noqa: F403

sys.modules[__name__] = _module
