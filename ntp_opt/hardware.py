"""Compatibility path: the code lives in :mod:`ntp_opt.model.hardware`."""

import sys

from ntp_opt.model import hardware as _module
from ntp_opt.model.hardware import *  # noqa: F403

sys.modules[__name__] = _module
