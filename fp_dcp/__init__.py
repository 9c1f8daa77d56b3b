"""fp_dcp: a torch.distributed.checkpoint storage backend that writes and reads
at the speed of the disk.

    dcp.save(state_dict, storage_writer=FastPersistWriter(path))
    dcp.load(state_dict, storage_reader=FastPersistReader(path))

The exports are loaded on first use (module ``__getattr__``), so that
``import fp_dcp.cli`` (``fp-dcp --help``) and ``fp_dcp.options`` do not import
torch; ``from fp_dcp import FastPersistWriter`` works as usual.
"""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

_EXPORTS = {
    "FastPersistWriter": "fp_dcp.writer",
    "FastPersistReader": "fp_dcp.reader",
    "FastPersistOptions": "fp_dcp.options",
    "use_as_default": "fp_dcp._dcp_hooks",
    "restore_default": "fp_dcp._dcp_hooks",
    "default_storage": "fp_dcp._dcp_hooks",
}

__all__ = ["FastPersistWriter", "FastPersistReader", "FastPersistOptions", "__version__",
           "use_as_default", "restore_default", "default_storage"]


def _native_missing(error: ImportError) -> ImportError:
    """One message naming the fix, instead of a circular-import trace, when the
    native extension ``fp_dcp._aio`` is not built (a source checkout that was
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


def __getattr__(name: str):
    if name == "_aio":  # reached by `from fp_dcp import _aio` before the submodule is imported
        try:
            return importlib.import_module("fp_dcp._aio")
        except ImportError as e:
            raise _native_missing(e) from None
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fp_dcp' has no attribute {name!r}")
    if module != "fp_dcp.options":
        __getattr__("_aio")  # the clear message first, not a trace from deep in the import
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
