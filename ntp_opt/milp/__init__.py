"""Compatibility path: the code lives in :mod:`ntp_opt.planners.exact`."""

from ntp_opt.planners.exact import *  # noqa: F403
