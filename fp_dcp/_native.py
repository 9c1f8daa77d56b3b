"""The only importer of the native extension (``fp_dcp._aio``, from
``cython_io/``): a broken build fails once, naming the fix.  Test hooks come
from :func:`testing`, only with ``FP_DCP_TEST_HOOKS=1`` (docs/NATIVE.md)."""

from __future__ import annotations

import importlib
import os
import types


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
DEFAULT_KEEP_POOL_BYTES = _ext.DEFAULT_KEEP_POOL_BYTES  # the most bytes of closed engines' bounce buffers kept
kept_pools = _ext.kept_pools
release_kept_pools = _ext.release_kept_pools
set_keep_limit = _ext.set_keep_limit
available_engines = _ext.available_engines
copy_gather = _ext.copy_gather
copy_scatter = _ext.copy_scatter
crc32c = _ext.crc32c
crc32c_blocks = _ext.crc32c_blocks
crc32c_combine = _ext.crc32c_combine
crc32c_many = _ext.crc32c_many
direct_io_supported = _ext.direct_io_supported
lock_pages = _ext.lock_pages
page_size = _ext.page_size
probe_alignment = _ext.probe_alignment
pull = _ext.pull
stats = _ext.stats


def testing() -> types.SimpleNamespace:
    """The extension's test hooks (fault injection, CRC implementation switches);
    RuntimeError unless the process started with FP_DCP_TEST_HOOKS=1."""
    if not _ext._test_hooks_enabled():
        raise RuntimeError("fp_dcp's test hooks are off in this process: start it with FP_DCP_TEST_HOOKS=1 "
                           "in the environment (tests/conftest.py does)")
    return types.SimpleNamespace(set_fault=_ext._set_fault, crc32c_impl=_ext._crc32c_impl,
                                 crc_copy_streams=_ext._crc_copy_streams, crc_nt_bytes=_ext._crc_nt_bytes)
