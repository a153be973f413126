"""Compatibility path: the code lives in :mod:`ntp_opt.rules.recourse`."""

import sys

from ntp_opt.rules import recourse as _module
from ntp_opt.rules.recourse import *  # noqa: F403

sys.modules[__name__] = _module
