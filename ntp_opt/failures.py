"""Compatibility path: the code lives in :mod:`ntp_opt.model.failures`."""

import sys

from ntp_opt.model import failures as _module
from ntp_opt.model.failures import *  # noqa: F403

sys.modules[__name__] = _module
