"""Not part of the package (that is fp_dcp/): Python reaches this file only
when it mistakes this repository for the package, i.e. `from fp_dcp import
FastPersistWriter` run in the directory that holds a clone named fp_dcp (the clone
is then a namespace package).  It says so, instead of "cannot import name
'FastPersistWriter' from 'fp_dcp' (unknown location)"; FastPersistReader.py and
FastPersistOptions.py beside it import this file for the same message."""

import os

_clone = os.path.dirname(os.path.abspath(__file__))
raise ImportError(
    f"'fp_dcp' here is the repository {_clone}, not the package ({_clone}/fp_dcp): "
    "Python found the clone in the current directory first. Run Python from another directory "
    f"(inside the clone works too), with the package installed once: pip install -e {_clone}",
    name="fp_dcp",
)
