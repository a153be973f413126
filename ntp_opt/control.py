"""Compatibility path: the code lives in :mod:`ntp_opt.model.control`."""

import sys

from ntp_opt.model import control as _module
from ntp_opt.model.control import *  # noqa: F403

sys.modules[__name__] = _module
