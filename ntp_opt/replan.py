"""Compatibility path: the code lives in :mod:`ntp_opt.workflows.replan`."""

import sys

from ntp_opt.workflows import replan as _module
from ntp_opt.workflows.replan import *  # noqa: F403

sys.modules[__name__] = _module
