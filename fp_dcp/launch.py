"""Run a training script with fp_dcp as the storage DCP picks, without
editing the script (it need not import fp_dcp)::

    python -m fp_dcp.launch train.py --its --args
    python -m fp_dcp.launch -m torchtitan.train --module llama3 --config llama3_debugmodel
    torchrun --nproc-per-node 8 -m fp_dcp.launch train.py --its --args

Turns the switch on (:func:`fp_dcp.use_as_default`; options from the
``FP_DCP_*`` environment variables), then runs the script or module as
``__main__`` with the remaining arguments.  Equivalent to setting
``FP_DCP_DEFAULT_STORAGE=1`` in a script that imports fp_dcp.
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    import fp_dcp

    fp_dcp.use_as_default()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("fp_dcp.launch: -m needs a module name")
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
