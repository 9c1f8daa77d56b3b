"""python -m fp_dcp: the fp-dcp command line (fp_dcp/tools/cli.py)."""

import sys

from fp_dcp.tools.cli import main

sys.exit(main())
