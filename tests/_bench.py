"""The ``bench`` fixture: benchmarks/bench_save_load.py loaded as a module
(benchmarks/ on the path while it is used), for the tests of its arithmetic
and rows.  A test module takes it with ``bench = _bench.bench``."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Iterator

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO, "benchmarks")


@pytest.fixture(scope="module")
def bench(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh copy of bench_save_load.py for each test module that uses it."""
    sys.path.insert(0, BENCHMARKS)
    try:
        name = "fp_dcp_bench_save_load_" + request.module.__name__.rsplit(".", 1)[-1]
        spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, "bench_save_load.py"))
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(BENCHMARKS)
