"""Compatibility path: the code lives in :mod:`ntp_opt.rules.expected`."""

import sys

from ntp_opt.rules import expected as _module
from ntp_opt.rules.expected import *  # noqa: F403

sys.modules[__name__] = _module
