"""Run PyTorch's own DCP tests with fp_dcp where they use DCP's defaults.

``install(mode)`` rebinds, in the running process:

- ``planners`` (and ``storage``): ``DefaultSavePlanner`` / ``DefaultLoadPlanner``
  where a test names them (``torch.distributed.checkpoint`` and its
  ``default_planner`` module) and where ``dcp.save`` / ``dcp.load`` make one
  for a call without ``planner=``: fp_dcp's planners.
- ``storage``: also ``FileSystemWriter`` / ``FileSystemReader`` where a test
  names them (``torch.distributed.checkpoint``) and where ``dcp.save`` /
  ``dcp.load`` pick them for a ``checkpoint_id`` (fp_dcp's default-storage
  switch): fp_dcp's writer and reader.
- ``stock``: nothing of DCP's (the reference run).

In every mode a test that asks for accelerators through ``skip_if_lt_x_gpu``
runs on the CPU with gloo where its helper allows it (``allow_cpu``).

Rank processes that the tests spawn start a fresh interpreter: the runner
puts ``tests/upstream/site`` on ``PYTHONPATH`` so that its
``sitecustomize`` calls :func:`install` there too, from
``DCP_UPSTREAM_SWAP``.  Loaded as a pytest plugin (``-p
tests.upstream.swap``) it also skips the tests listed in :data:`KNOWN` and
expects the failures listed in :data:`DIFFERENCES`.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "DCP_UPSTREAM_SWAP"
MODES = ("stock", "planners", "storage")

# (file, test name) -> why the test does not apply to a drop-in planner: skipped
KNOWN: dict[tuple[str, str], str] = {}
# (file, test name) -> (mode, what fp_dcp does differently): an expected
# failure in that mode, strict (once fixed, the entry must go)
DIFFERENCES: dict[tuple[str, str], tuple[str, str]] = {}

_installed: str | None = None


def _run_on_cpu() -> None:
    """Let ``skip_if_lt_x_gpu`` tests run on a machine without accelerators,
    through the helper's own ``allow_cpu`` (torch releases without it keep
    skipping them)."""
    import inspect

    import torch

    if torch.cuda.is_available():
        return
    try:
        from torch.testing._internal import common_distributed as cd
    except ImportError:  # PyTorch's test helpers need expecttest: no test of theirs runs here
        return

    stock = cd.skip_if_lt_x_gpu
    if "allow_cpu" not in inspect.signature(stock).parameters:
        return

    def skip_if_lt_x_gpu(x: int, **kwargs: Any) -> Any:
        return stock(x, allow_cpu=True)

    cd.skip_if_lt_x_gpu = skip_if_lt_x_gpu
    from torch.testing._internal.distributed._tensor import common_dtensor

    common_dtensor.skip_if_lt_x_gpu = skip_if_lt_x_gpu


def _storage_classes() -> tuple[type, type]:
    """fp_dcp's writer and reader under the stock classes' constructors."""
    from fp_dcp import FastPersistReader, FastPersistWriter

    class FileSystemWriter(FastPersistWriter):  # type: ignore[misc]
        """fp_dcp's writer at ``path``; the stock writer's tuning arguments
        (thread count, copy-ahead, file per rank, sync) have no meaning for it."""

        def __init__(self, path: Any, single_file_per_rank: bool = True, sync_files: bool = True,
                     thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                     cache_staged_state_dict: bool = False, overwrite: bool = True) -> None:
            super().__init__(path)

    class FileSystemReader(FastPersistReader):  # type: ignore[misc]
        """fp_dcp's reader at ``path``."""

        def __init__(self, path: Any) -> None:
            super().__init__(path)

    return FileSystemWriter, FileSystemReader


def install(mode: str) -> None:
    """Swap fp_dcp in as ``mode`` says (see the module documentation); a
    second call with the same mode does nothing."""
    global _installed
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: use one of {', '.join(MODES)}")
    if _installed is not None:
        if _installed != mode:
            raise RuntimeError(f"fp_dcp is already swapped in as {_installed!r}, not {mode!r}")
        return
    _installed = mode
    _run_on_cpu()
    if mode == "stock":
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import default_planner

    import fp_dcp
    from fp_dcp.planners import FastPersistLoadPlanner, FastPersistSavePlanner, install_as_default

    for mod in (dcp, default_planner):
        mod.DefaultSavePlanner = FastPersistSavePlanner  # type: ignore[attr-defined,misc]
        mod.DefaultLoadPlanner = FastPersistLoadPlanner  # type: ignore[attr-defined,misc]
    if mode == "storage":
        fp_dcp.use_as_default()  # planners too, for a call without planner=
        dcp.FileSystemWriter, dcp.FileSystemReader = _storage_classes()  # type: ignore[misc]
    else:
        skipped = install_as_default({})
        if skipped:
            raise RuntimeError(f"fp_dcp's planners are not DCP's default here: {skipped}")


def install_from_env() -> None:
    mode = os.environ.get(ENV, "")
    if mode:
        install(mode)


# ----------------------------------------------------------------- pytest plugin


def pytest_configure(config: Any) -> None:
    install_from_env()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    import pytest

    mode = os.environ.get(ENV, "stock")
    if mode == "stock":
        return
    for item in items:
        where = (os.path.basename(str(item.fspath)), item.name)
        reason = KNOWN.get(where)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"inspects DCP's own planner, not its plans: {reason}"))
        if where in DIFFERENCES and DIFFERENCES[where][0] == mode:
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"known difference: {DIFFERENCES[where][1]}"))
