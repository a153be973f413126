"""Compatibility path: the code lives in :mod:`ntp_opt.app.plotting`."""

import sys

from ntp_opt.app import plotting as _module
from ntp_opt.app.plotting import *  # noqa: F403

sys.modules[__name__] = _module
