"""Compatibility path: the code lives in :mod:`ntp_opt.app.importers.slurm`."""

import sys

from ntp_opt.app.importers import slurm as _module
from ntp_opt.app.importers.slurm import *  # noqa: F403

sys.modules[__name__] = _module
