# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
"""fp_dcp._aio: aligned page-locked buffers and an O_DIRECT I/O engine.

Private to fp_dcp: fp_dcp/_native.py is its only importer, and fp_dcp/_aio.pyi
lists its API. The engines (kernel AIO, io_uring, a pthread pool) and the
write/read pipelines are C (fpio*.c, fpio.h); this module holds Python's side
of them: buffers, validation, the GIL, and errors. See docs/NATIVE.md.

One extension built from one module, the uvloop way: this file holds the
module's state and `include`s one file per concern, so that calls between
them stay C calls:

    includes/fpio.pxi    extern declarations of the C core (fpio.h)
    includes/system.pxi  extern declarations of the libc calls made here
    errors.pyx    errno -> OSError (the only place)
    buffers.pyx   AlignedBuffer; views of callers' buffers
    files.pyx     page size, O_DIRECT alignment and support
    crc.pyx       CRC-32C of buffers
    copy.pyx      gather/scatter copies, pulls from a peer process
    engines.pyx   Engine: open, write, read
    hooks.pyx     test hooks (fault/kill injection, CRC switches)

Test hooks: only in a process started with FP_DCP_TEST_HOOKS=1 in its
environment, read once below when the module is imported. Without it the
hook functions raise RuntimeError and the C core's fault checks are never
armed; with it, they work as before (tests/conftest.py sets it, and the
processes tests start inherit it). fp_dcp itself never reads the hooks:
fp_dcp._native.testing() hands them to tests.
"""

from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE,
                             PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES)
from libc.errno cimport errno, EINVAL, EIO
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memset

import array
import os
import threading as _threading
import warnings

import numpy as np

include "includes/fpio.pxi"
include "includes/system.pxi"

ENGINES = ("aio", "uring", "threads")
cdef dict _KIND = {"aio": FPIO_AIO, "uring": FPIO_URING, "threads": FPIO_THREADS}

# Chosen from the measurements in docs/NATIVE.md (benchmarks/tune_engine.py).
_AUTO_ORDER = ("aio", "uring", "threads")
# The largest file offset a piece may reach (2^62): far past any file system,
# and every sum the pipeline forms from it (rounding up to an alignment, a
# window's end, a checksum origin plus a length) still fits an int64.
cdef int64_t _MAX_FILE_OFFSET = 1 << 62
# The built-in request shape when the caller (fp_dcp.engine.IOSession: the
# options, else an `fp-dcp tune` record) names none: 8 requests of 4 MiB,
# 32 MiB in flight. 4 MiB is the largest request most block devices take
# whole (max_sectors_kb); on this VM's disk `fp-dcp tune` found no shape of
# its grid faster by more than 10 % in every round (docs/NATIVE.md, "Per
# device"), and a faster device is tuned with that command.
DEFAULT_QUEUE_DEPTH = 8
DEFAULT_BLOCK_SIZE = 4 << 20
# Reads of one file closer than this are merged into one request: below
# 64 KiB the extra bytes cost less than one more request on any disk measured
# (FastPersistOptions.coalesce_gap_bytes, the same default, overrides it).
DEFAULT_COALESCE_GAP = 64 * 1024
# Bounds that reject nonsense (a typo'd option), not tuning: 4096 requests in
# flight and 1 GiB requests are far past any device's useful range.
_MAX_QUEUE_DEPTH = 4096
_MAX_BLOCK_SIZE = 1 << 30
# Transparent huge page size on x86-64 and arm64 (4 KiB base pages): buffers
# this large are aligned to it so the kernel can back them with huge pages.
_HUGE_PAGE = 2 << 20

# process-wide counters for leak tests (touched with the GIL held)
cdef Py_ssize_t _n_buffers = 0
cdef Py_ssize_t _locked_bytes = 0
cdef Py_ssize_t _n_engines = 0
cdef bint _mlock_warned = False

# The test hooks' switch (hooks.pyx), read once, here.
cdef bint _TEST_HOOKS = os.environ.get("FP_DCP_TEST_HOOKS") == "1"
if _TEST_HOOKS:
    fpio_test_hooks_enable()


def stats():
    """Process-wide live counters: buffers, locked_bytes, engines, inflight
    (buffers and locked_bytes count the bounce buffers kept from closed
    engines too: kept_pools)."""
    return {"buffers": _n_buffers, "locked_bytes": _locked_bytes,
            "engines": _n_engines, "inflight": fpio_inflight(), "kept_pools": len(_kept_pools)}


include "hooks.pyx"
include "errors.pyx"
include "buffers.pyx"
include "files.pyx"
include "crc.pyx"
include "copy.pyx"
include "engines.pyx"
