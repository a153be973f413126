"""Compatibility path: the code lives in :mod:`ntp_opt.planners.exact.bounds`."""

import sys

from ntp_opt.planners.exact import bounds as _module
from ntp_opt.planners.exact.bounds import *  # noqa: F403

sys.modules[__name__] = _module
