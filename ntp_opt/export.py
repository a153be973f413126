"""Compatibility path: the code lives in :mod:`ntp_opt.app.export`."""

import sys

from ntp_opt.app import export as _module
from ntp_opt.app.export import *  # noqa: F403

sys.modules[__name__] = _module
