"""Compatibility path: the code lives in :mod:`ntp_opt.app.service`."""

import sys

from ntp_opt.app import service as _module
from ntp_opt.app.service import *  # noqa: F403

sys.modules[__name__] = _module
