"""python -m fp_dcp: the fp-dcp command line (fp_dcp/cli.py)."""

import sys

from fp_dcp.cli import main

sys.exit(main())
