"""Compatibility path: the code lives in :mod:`ntp_opt.app.importers`."""

from ntp_opt.app.importers import *  # noqa: F403
