"""Compatibility path: the code lives in :mod:`ntp_opt.rules.validate`."""

import sys

from ntp_opt.rules import validate as _module
from ntp_opt.rules.validate import *  # noqa: F403

sys.modules[__name__] = _module
