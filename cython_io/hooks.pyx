# hooks.pyx: the test hooks: fault and kill injection, the CRC implementation
# switch and its introspection.
# Part of fp_dcp._aio: included by _aio.pyx (see there), not compiled alone.
#
# They work only in a process started with FP_DCP_TEST_HOOKS=1 (read once, when
# the extension is imported: _TEST_HOOKS in _aio.pyx); otherwise each raises
# RuntimeError and the C side's fault checks are never armed (fpio_faults.c:
# one load and an untaken branch per completion). tests/conftest.py sets the
# variable; fp_dcp reaches these only through fp_dcp._native.testing().

cdef int _fault_open_direct = 0  # errno for every O_DIRECT open (files.pyx, Engine.open); 0: off


cdef _require_test_hooks(str name):
    if not _TEST_HOOKS:
        raise RuntimeError(f"fp_dcp._aio.{name} is a test hook, off in this process: start it with "
                           f"FP_DCP_TEST_HOOKS=1 in the environment (tests/conftest.py does)")


def _test_hooks_enabled():
    """Whether this process started with FP_DCP_TEST_HOOKS=1 (the hooks below work)."""
    return bool(_TEST_HOOKS)


def _set_fault(str what, int err=0, long after=0):
    """Fault injection for tests. what="io": the completion after `after`
    successful ones reports -err; what="short": the next `after` completions
    report half their bytes (short transfers); what="open_direct": every open
    with O_DIRECT fails with err (err=0 clears); what="kill": after `after`
    completions the process sends itself signal `err` (a crash mid-save;
    err=0 clears). what="" clears them all."""
    global _fault_open_direct
    _require_test_hooks("_set_fault")
    if what == "io":
        fpio_fault_set(err, after)
    elif what == "short":
        fpio_fault_short(after)
    elif what == "open_direct":
        _fault_open_direct = err
    elif what == "kill":
        fpio_fault_kill(err, after)
    elif what == "":
        fpio_fault_set(0, 0)
        fpio_fault_short(0)
        fpio_fault_kill(0, 0)
        _fault_open_direct = 0
    else:
        raise ValueError(f"unknown fault {what!r}: valid are 'io', 'short', 'open_direct', 'kill', ''")


def _crc32c_impl(which=None):
    """Tests: "hw" or "sw" forces the CRC implementation (process-wide); returns
    the one in use ("sw" where the CPU has no SSE4.2)."""
    _require_test_hooks("_crc32c_impl")
    if which not in (None, "hw", "sw"):
        raise ValueError(f"which must be None, 'hw' or 'sw', got {which!r}")
    return "hw" if fpio_crc32c_impl(-1 if which is None else (1 if which == "hw" else 0)) else "sw"


def _crc_copy_streams(uintptr_t dst, uintptr_t src, size_t length):
    """Tests: whether a fused copy + CRC-32C of ``length`` bytes from address
    ``src`` to address ``dst`` uses streaming (non-temporal) stores; and
    :func:`_crc_nt_bytes`, the bytes so copied in this process so far."""
    _require_test_hooks("_crc_copy_streams")
    return bool(fpio_crc_copy_streams(dst, src, length))


def _crc_nt_bytes():
    _require_test_hooks("_crc_nt_bytes")
    return fpio_crc_nt_bytes()
