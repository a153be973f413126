"""Compatibility path: the code lives in :mod:`ntp_opt.planners.exact.model`."""

import sys

from ntp_opt.planners.exact import model as _module
from ntp_opt.planners.exact.model import *  # noqa: F403

sys.modules[__name__] = _module
