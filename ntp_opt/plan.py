"""Compatibility path: the code lives in :mod:`ntp_opt.model.plan`."""

import sys

from ntp_opt.model import plan as _module
from ntp_opt.model.plan import *  # noqa: F403

sys.modules[__name__] = _module
