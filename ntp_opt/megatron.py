"""Compatibility path: the code lives in :mod:`ntp_opt.planners.megatron`."""

import sys

from ntp_opt.planners import megatron as _module
from ntp_opt.planners.megatron import *  # noqa: F403

sys.modules[__name__] = _module
