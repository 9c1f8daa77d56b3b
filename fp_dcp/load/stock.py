"""Reading a *stock* DCP checkpoint (``FileSystemWriter``'s) without running its code.

``fp-dcp convert --from-dcp`` reads checkpoints fp_dcp did not write.  The
stock ``FileSystemReader`` unpickles ``.metadata`` with the full unpickler,
opens whatever ``relative_path`` the metadata names (``../x`` included), and
its planner ``torch.load``\\ s every bytes item with ``weights_only=False``.
:class:`SafeStockReader` keeps the stock reader's data path but

* unpickles the metadata with an unpickler that knows only DCP's metadata
  classes, ``torch.Size``, dtypes and plain containers;
* refuses a data file that is not a plain name of a regular file in the
  checkpoint directory, and stream transforms (compression extensions);

and rebuilds the bytes items with the restricted unpickler
(:mod:`fp_dcp.load.objects`) before the caller's planner sees them.  fp-dcp
convert --from-dcp reads with it, and so does ``dcp.load`` of a stock
checkpoint while fp_dcp's default-storage switch is on.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import stat
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from fp_dcp import files
from fp_dcp import format as fmt
from fp_dcp.load import objects

__all__ = ["SafeStockReader"]

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_md, name)
    for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",  # an Enum
    )
}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("collections", "OrderedDict")] = __import__("collections").OrderedDict
# StorageMeta.checkpoint_id may be a path object
_ALLOWED[("pathlib", "PosixPath")] = pathlib.PosixPath
_ALLOWED[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
# how torch pickles a layout: a look-up by name in a table (KeyError otherwise)
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
for _name, _value in vars(torch).items():
    if isinstance(_value, (torch.dtype, torch.layout, torch.memory_format)):
        _ALLOWED[("torch", _name)] = _value


class _MetadataUnpickler(pickle.Unpickler):
    """The full pickle machine, with globals limited to DCP's metadata types."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"the metadata names {module}.{name}, which is not a DCP metadata type"
            ) from None


class SafeStockReader(FileSystemReader):
    """``FileSystemReader`` whose metadata cannot run code or name files
    outside, and whose objects are rebuilt by the restricted unpickler
    (unless ``allow_pickle``; ``None``: ``FP_DCP_ALLOW_PICKLE``)."""

    def __init__(self, path: Any, *args: Any, allow_pickle: bool | None = None, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        if allow_pickle is None:
            from fp_dcp.options import FastPersistOptions

            allow_pickle = FastPersistOptions.from_env().allow_pickle
        self.allow_pickle = allow_pickle

    def read_data(self, plan: Any, planner: Any) -> Any:
        where = os.fspath(self.path)
        objects.check_bytes_targets(plan.items, planner, where)  # before any byte is read
        return super().read_data(plan, _RestrictedObjects(planner, where, self.allow_pickle))

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        directory = os.fspath(self.path)
        path = os.path.join(directory, fmt.STOCK_METADATA_NAME)
        fd = files.open_regular(path, files.MAX_METADATA_BYTES)  # no link, FIFO or device; bounded
        with os.fdopen(fd, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except Exception as e:  # noqa: BLE001 - any failure is a refused metadata file
                raise fmt.CheckpointFormatError(f"{path}: refusing this stock DCP metadata: {e}") from None
        if not isinstance(metadata, dcp_md.Metadata) or not isinstance(metadata.storage_data, dict):
            raise fmt.CheckpointFormatError(f"{path}: not a stock DCP checkpoint's metadata")
        checked: set[str] = set()  # each data file is lstat'ed once, not once per item
        for index, info in metadata.storage_data.items():
            _check_storage_info(directory, index, info, checked)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_storage_info(directory: str, index: Any, info: Any, checked: set[str]) -> None:
    where = f"{directory}: {getattr(index, 'fqn', index)!r}"
    if not isinstance(info, _StorageInfo):
        raise fmt.CheckpointFormatError(f"{where}: malformed storage entry")
    name = info.relative_path
    if not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", ".."):
        raise fmt.CheckpointFormatError(f"{where}: data file {str(name)[:200]!r} is not a file of the checkpoint")
    if getattr(info, "transform_descriptors", None):
        raise fmt.CheckpointFormatError(
            f"{where}: stream transforms {list(info.transform_descriptors)!r} (a compressed stock checkpoint) "
            f"are not read by fp_dcp's safe stock reader; load it with DCP's FileSystemReader if you trust it"
        )
    for field in (info.offset, info.length):
        if not isinstance(field, int) or isinstance(field, bool) or field < 0:
            raise fmt.CheckpointFormatError(f"{where}: malformed offset or length")
    if name in checked:
        return
    if not stat.S_ISREG(os.lstat(os.path.join(directory, name)).st_mode):
        raise fmt.CheckpointFormatError(f"{where}: data file {name!r} is a symbolic link or not a regular file")
    checked.add(name)


class _RestrictedObjects:
    """The caller's planner, except that ``load_bytes`` gets objects rebuilt
    by the restricted unpickler (:func:`fp_dcp.load.objects.deliver_object`)."""

    def __init__(self, planner: Any, where: str, allow_pickle: bool) -> None:
        self._planner, self._where, self._allow_pickle = planner, where, allow_pickle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        data = value.read()
        obj = objects.load_object(data, read_item.storage_index.fqn, self._where, self._allow_pickle)
        objects.deliver_object(self._planner, read_item, obj, data)
