"""``python -m fp_dcp``: the ``fp-dcp`` command line (see :mod:`fp_dcp.cli`)."""

import sys

from fp_dcp.cli import main

sys.exit(main())
