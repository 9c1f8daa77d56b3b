"""fp_dcp: a torch.distributed.checkpoint storage backend that writes and reads
at the speed of the disk.

    dcp.save(state_dict, storage_writer=FastPersistWriter(path))
    dcp.load(state_dict, storage_reader=FastPersistReader(path))
"""

__version__ = "0.1.0"

from fp_dcp.options import FastPersistOptions  # noqa: E402
from fp_dcp.reader import FastPersistReader  # noqa: E402
from fp_dcp.writer import FastPersistWriter  # noqa: E402
from fp_dcp._dcp_hooks import default_storage, restore_default, use_as_default  # noqa: E402

__all__ = ["FastPersistWriter", "FastPersistReader", "FastPersistOptions", "__version__",
           "use_as_default", "restore_default", "default_storage"]

# FP_DCP_DEFAULT_STORAGE=1: fp_dcp becomes the storage DCP picks as soon as
# fp_dcp is imported (see fp_dcp/_dcp_hooks.py; python -m fp_dcp.launch
# imports it before a script that never does).
from fp_dcp._dcp_hooks import _from_environment  # noqa: E402

_from_environment()
