"""Compatibility path: the code lives in :mod:`ntp_opt.planners.exact.search`."""

import sys

from ntp_opt.planners.exact import search as _module
from ntp_opt.planners.exact.search import *  # noqa: F403

sys.modules[__name__] = _module
