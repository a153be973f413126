"""``python -m ntp_opt``: the ``ntp-opt`` command line."""

import sys

from ntp_opt.app.cli import main

sys.exit(main())
