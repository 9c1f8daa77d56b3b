"""fp_dcp: a torch.distributed.checkpoint storage backend that writes and reads
at the speed of the disk.  Exports load on first use, so ``fp-dcp --help``
and ``fp_dcp.options`` do not import torch."""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

_EXPORTS = {
    "FastPersistWriter": "fp_dcp.save.writer",
    "FastPersistReader": "fp_dcp.load.reader",
    "FastPersistOptions": "fp_dcp.options",
    "use_as_default": "fp_dcp._dcp_hooks",
    "restore_default": "fp_dcp._dcp_hooks",
    "default_storage": "fp_dcp._dcp_hooks",
    "TierManager": "fp_dcp.tiers.manager",
    "export_hf": "fp_dcp.tools.export_hf",
    "FastPersistSavePlanner": "fp_dcp.planners",
    "FastPersistLoadPlanner": "fp_dcp.planners",
    "release_bounce_buffers": "fp_dcp.engine",
}

__all__ = ["FastPersistWriter", "FastPersistReader", "FastPersistOptions", "__version__",
           "use_as_default", "restore_default", "default_storage"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fp_dcp' has no attribute {name!r}")
    if module != "fp_dcp.options":
        importlib.import_module("fp_dcp._native")  # the clear message first, not a trace from deep in the import
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


# FP_DCP_DEFAULT_STORAGE=1: fp_dcp becomes the storage DCP picks as soon as
# fp_dcp is imported (see fp_dcp/_dcp_hooks.py; python -m fp_dcp.launch
# imports it before a script that never does).  Only then does importing
# fp_dcp import torch.
if os.environ.get("FP_DCP_DEFAULT_STORAGE", "").strip():
    importlib.import_module("fp_dcp._dcp_hooks")._from_environment()
