"""Compatibility path: the code lives in :mod:`ntp_opt.app.importers.k8s`."""

import sys

from ntp_opt.app.importers import k8s as _module
from ntp_opt.app.importers.k8s import *  # noqa: F403

sys.modules[__name__] = _module
