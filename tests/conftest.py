import gc
import os

import pytest

# fp_dcp's test hooks (fault and kill injection: fp_dcp._native.testing()) work
# only in a process started with this set; set here, before anything imports
# the extension, and inherited by every process a test starts.
os.environ["FP_DCP_TEST_HOOKS"] = "1"

# The machine's own tuning record (fp-dcp tune) must not change the request
# shapes the tests expect; tests/test_tune.py sets its own record files.
os.environ["FP_DCP_TUNING_FILE"] = "none"


@pytest.fixture
def aio_no_leaks():
    """Fail the test if it leaves AlignedBuffers, engines, locked memory or
    requests in flight behind (fp_dcp._native.stats() back to its baseline)."""
    from fp_dcp import _native

    hooks = _native.testing()

    gc.collect()
    before = _native.stats()
    yield
    hooks.set_fault("")
    after = _native.stats()
    if after != before:  # maybe only garbage not yet collected
        gc.collect()
        after = _native.stats()
    assert after == before, f"native resources leaked: before {before}, after {after}"
