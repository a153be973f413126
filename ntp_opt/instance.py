"""Compatibility path: the code lives in :mod:`ntp_opt.model.instance`."""

import sys

from ntp_opt.model import instance as _module
from ntp_opt.model.instance import *  # noqa: F403

sys.modules[__name__] = _module
