"""Compatibility path: the code lives in :mod:`ntp_opt.model.topology`."""

import sys

from ntp_opt.model import topology as _module
from ntp_opt.model.topology import *  # noqa: F403

sys.modules[__name__] = _module
