"""Compatibility path: the code lives in :mod:`ntp_opt.model.safeio`."""

import sys

from ntp_opt.model import safeio as _module
from ntp_opt.model.safeio import *  # noqa: F403

sys.modules[__name__] = _module
