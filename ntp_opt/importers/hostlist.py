"""Compatibility path: the code lives in :mod:`ntp_opt.app.importers.hostlist`."""

import sys

from ntp_opt.app.importers import hostlist as _module
from ntp_opt.app.importers.hostlist import *  # noqa: F403

sys.modules[__name__] = _module
