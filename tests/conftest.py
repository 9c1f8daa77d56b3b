import gc
import os

import pytest

# The machine's own tuning record (fp-dcp tune) must not change the request
# shapes the tests expect; tests/test_tune.py sets its own record files.
os.environ["FP_DCP_TUNING_FILE"] = "none"


@pytest.fixture
def aio_no_leaks():
    """Fail the test if it leaves AlignedBuffers, engines, locked memory or
    requests in flight behind (fp_dcp._aio.stats() back to its baseline)."""
    from fp_dcp import _aio

    gc.collect()
    before = _aio.stats()
    yield
    _aio._set_fault("")
    after = _aio.stats()
    if after != before:  # maybe only garbage not yet collected
        gc.collect()
        after = _aio.stats()
    assert after == before, f"native resources leaked: before {before}, after {after}"
