"""Compatibility path: the code lives in :mod:`ntp_opt.rules.power`."""

import sys

from ntp_opt.rules import power as _module
from ntp_opt.rules.power import *  # noqa: F403

sys.modules[__name__] = _module
