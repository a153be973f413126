"""Compatibility path: the code lives in :mod:`ntp_opt.model.job`."""

import sys

from ntp_opt.model import job as _module
from ntp_opt.model.job import *  # noqa: F403

sys.modules[__name__] = _module
