"""Compatibility path: the code lives in :mod:`ntp_opt.workflows.simulate`."""

import sys

from ntp_opt.workflows import simulate as _module
from ntp_opt.workflows.simulate import *  # noqa: F403

sys.modules[__name__] = _module
