"""Compatibility path: the code lives in :mod:`ntp_opt.app.importers.nvidia_smi`."""

import sys

from ntp_opt.app.importers import nvidia_smi as _module
from ntp_opt.app.importers.nvidia_smi import *  # noqa: F403

sys.modules[__name__] = _module
