"""Put on ``PYTHONPATH`` by ``tests/test_upstream_planners.py`` only: every
interpreter started for a run of PyTorch's DCP tests (the rank processes
too) swaps fp_dcp in as ``DCP_UPSTREAM_SWAP`` says."""

import os

if os.environ.get("DCP_UPSTREAM_SWAP"):
    from tests.upstream import swap

    swap.install_from_env()
