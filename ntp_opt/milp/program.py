"""Compatibility path: the code lives in :mod:`ntp_opt.planners.exact.program`."""

import sys

from ntp_opt.planners.exact import program as _module
from ntp_opt.planners.exact.program import *  # noqa: F403

sys.modules[__name__] = _module
