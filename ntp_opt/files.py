"""Compatibility path: the code lives in :mod:`ntp_opt.model.files`."""

import sys

from ntp_opt.model import files as _module
from ntp_opt.model.files import *  # noqa: F403

sys.modules[__name__] = _module
