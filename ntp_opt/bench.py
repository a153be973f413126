"""Compatibility path: the code lives in :mod:`ntp_opt.app.bench`."""

import sys

from ntp_opt.app import bench as _module
from ntp_opt.app.bench import *  # noqa: F403

sys.modules[__name__] = _module
