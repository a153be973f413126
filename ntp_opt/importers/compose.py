"""Compatibility path: the code lives in :mod:`ntp_opt.app.importers.compose`."""

import sys

from ntp_opt.app.importers import compose as _module
from ntp_opt.app.importers.compose import *  # noqa: F403

sys.modules[__name__] = _module
