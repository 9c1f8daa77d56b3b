"""fp_dcp: a torch.distributed.checkpoint storage backend that writes and reads
at the speed of the disk.

    dcp.save(state_dict, storage_writer=FastPersistWriter(path))
    dcp.load(state_dict, storage_reader=FastPersistReader(path))
"""

__version__ = "0.1.0"

from fp_dcp.options import FastPersistOptions  # noqa: E402
from fp_dcp.reader import FastPersistReader  # noqa: E402
from fp_dcp.writer import FastPersistWriter  # noqa: E402

__all__ = ["FastPersistWriter", "FastPersistReader", "FastPersistOptions", "__version__"]
