"""Suite-wide set-up: every random choice seeded, hypothesis deterministic,
and the native-leak fixture.

Random: before each test, Python's ``random``, numpy's global generator and
torch's are seeded (0), so a test that draws without its own generator (a
``torch.randn`` for data, a module's initial weights) draws the same values
every run; the rank processes of ``tests/_dist.py`` seed theirs by rank.

Hypothesis: the ``deterministic`` profile (the default) derandomizes every
``@given`` (its examples follow from the test's source, not from a clock) and
keeps no example database, so a run here and in CI tries the same examples.
``HYPOTHESIS_PROFILE=explore`` searches afresh each run (random, with the
local database) to look for new counterexamples; a failure found that way is
pinned with ``@example``.
"""

import gc
import os
import random

import numpy as np
import pytest
from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


@pytest.fixture(autouse=True)
def _seeded():
    """Seed the global generators (see the module docstring)."""
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield

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

    _native.release_kept_pools()  # (closed engines' bounce buffers, kept on purpose: not this test's)
    before = _native.stats()
    if any(before.values()):  # maybe garbage of an earlier test: collected first (else nothing can be, and
        gc.collect()  # a full collection with torch loaded is about 0.2 s a test)
        _native.release_kept_pools()
        before = _native.stats()
    yield
    hooks.set_fault("")
    _native.release_kept_pools()
    after = _native.stats()
    if after != before:  # maybe only garbage not yet collected
        gc.collect()
        _native.release_kept_pools()
        after = _native.stats()
    assert after == before, f"native resources leaked: before {before}, after {after}"
