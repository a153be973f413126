"""Compatibility path: the code lives in :mod:`ntp_opt.app.plot`."""

import sys

from ntp_opt.app import plot as _module
from ntp_opt.app.plot import *  # noqa: F403

sys.modules[__name__] = _module
