"""Compatibility path: the code lives in :mod:`ntp_opt.planners.exact.backends`."""

import sys

from ntp_opt.planners.exact import backends as _module
from ntp_opt.planners.exact.backends import *  # noqa: F403

sys.modules[__name__] = _module
