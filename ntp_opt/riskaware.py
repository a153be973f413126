"""Compatibility path: the code lives in :mod:`ntp_opt.planners.riskaware`."""

import sys

from ntp_opt.planners import riskaware as _module
from ntp_opt.planners.riskaware import *  # noqa: F403

sys.modules[__name__] = _module
