"""The only importer of fp_dcp's native extension (``fp_dcp._aio``, built from
``cython_io/``).

Every module of the package reaches the extension through this one, so that a
missing or broken build fails once, with a message naming the fix, instead of
as a circular-import trace from deep inside a save.
"""

from __future__ import annotations

import importlib
import os


def _native_missing(error: ImportError) -> ImportError:
    """The error for an extension that is not built (a source checkout that was
    never installed) or does not load."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    in_clone = os.path.exists(os.path.join(root, "pyproject.toml"))
    if isinstance(error, ModuleNotFoundError) and error.name == "fp_dcp._aio":
        what = f"fp_dcp's native extension (fp_dcp._aio) is not built in {here}"
    else:
        what = f"fp_dcp's native extension (fp_dcp._aio) in {here} does not load ({error})"
    fix = (f"build it from the clone: cd {root} && pip install -e ." if in_clone
           else "reinstall the package: pip install --force-reinstall fp-dcp")
    return ImportError(f"{what}; {fix}  (it needs a C compiler and the Python headers)")


try:
    _ext = importlib.import_module("fp_dcp._aio")
except ImportError as _e:
    raise _native_missing(_e) from None

AlignedBuffer = _ext.AlignedBuffer
DEFAULT_BLOCK_SIZE = _ext.DEFAULT_BLOCK_SIZE  # an Engine's request size and depth when not given
DEFAULT_QUEUE_DEPTH = _ext.DEFAULT_QUEUE_DEPTH
Engine = _ext.Engine
ENGINES = _ext.ENGINES
copy_gather = _ext.copy_gather
crc32c_blocks = _ext.crc32c_blocks
crc32c_combine = _ext.crc32c_combine
direct_io_supported = _ext.direct_io_supported
page_size = _ext.page_size
probe_alignment = _ext.probe_alignment
pull = _ext.pull
