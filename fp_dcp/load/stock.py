"""Reading a *stock* DCP checkpoint without running its code:
:class:`SafeStockReader` unpickles the metadata with a bounded unpickler of
DCP's metadata classes, refuses data files outside the checkpoint and stream
transforms, and rebuilds bytes items with :mod:`fp_dcp.load.objects`."""

from __future__ import annotations

import os
import pathlib
import pickle
import stat
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlanner

from fp_dcp import files
from fp_dcp import format as fmt
from fp_dcp._dcp_hooks import logged_metadata_errors
from fp_dcp.load import objects

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["SafeStockReader", "MetadataBudgetError"]

# Every element a constructor of the metadata copies (a torch.Size's
# dimensions, a mapping's entries, a path's parts, an object's fields) is
# charged to a budget of this many per byte of the file (plus a floor): the
# pickle machine can hand one memoized list to any number of constructors, so
# a small file could otherwise expand without bound.  DCP's own metadata
# charges less than one per byte.
_ELEMENTS_PER_BYTE = 4
_ELEMENTS_FLOOR = 1 << 16
# A path longer than the system's PATH_MAX names no file.
_MAX_PATH_CHARS = 4096


class MetadataBudgetError(fmt.CheckpointFormatError):
    """A stock ``.metadata`` would expand far beyond its size on disk."""


class _Budget:
    def __init__(self, elements: int) -> None:
        self.left = elements

    def charge(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise MetadataBudgetError(
                "the metadata expands to far more objects than its size on disk holds (a crafted file: "
                "one list handed to many constructors); refusing to build it"
            )


def _bounded_dataclass(base: type[DataclassInstance], budget: _Budget) -> type:
    """``base`` (a DCP metadata dataclass) as the pickle machine builds it:
    created empty, then given only its own fields (``__setstate__``), then
    turned into a plain ``base`` object."""
    fields = frozenset(base.__dataclass_fields__)
    sizes = (5, 6) if "strides" in fields else (5,)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise pickle.UnpicklingError(f"the metadata calls {base.__name__}(...) itself, which DCP never writes")

    def __setstate__(self: Any, state: Any) -> None:
        if hasattr(base, "__setstate__"):  # TensorProperties: a 5-tuple, or 6 with the strides where torch has them
            if type(state) is not tuple or len(state) not in sizes or (len(state) == 6 and not _strides(state[5])):
                raise pickle.UnpicklingError(f"malformed {base.__name__} state")
            budget.charge(len(state) + (len(state[5] or ()) if len(state) == 6 else 0))
            object.__setattr__(self, "__class__", base)
            base.__setstate__(self, state)
            return
        if type(state) is not dict or not all(type(k) is str for k in state) or not fields.issuperset(state):
            raise pickle.UnpicklingError(f"malformed {base.__name__} state (fields {sorted(fields)})")
        budget.charge(len(state))
        object.__setattr__(self, "__class__", base)
        vars(self).update(state)

    return type(base.__name__, (base,), {"__slots__": (), "__init__": __init__, "__setstate__": __setstate__})


def _strides(value: Any) -> bool:
    """Whether ``value`` is what a ``TensorProperties`` records as its strides."""
    return value is None or (type(value) in (tuple, list, torch.Size) and all(type(v) is int for v in value))


class _MemoryFormatCode:
    """A ``_MEM_FORMAT_ENCODING`` value as ``TensorProperties.__setstate__``
    compares it, without handing the pickle machine the enum's own (shared,
    mutable) member."""

    __slots__ = ("member",)

    def __init__(self, member: Any) -> None:
        self.member = member

    def __eq__(self, other: object) -> bool:
        return self.member is other

    __hash__ = None  # type: ignore[assignment]


def _allowed(budget: _Budget) -> dict[tuple[str, str], Any]:
    """What the metadata may name: DCP's metadata classes (bounded), the
    copying constructors (charged to ``budget``), dtypes and layouts."""
    allowed: dict[tuple[str, str], Any] = {}
    dataclasses = [getattr(dcp_md, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                "StorageMeta")]
    for cls in dataclasses + [_StorageInfo]:
        allowed[(cls.__module__, cls.__name__)] = _bounded_dataclass(cls, budget)

    def counted(*args: Any) -> int:
        n = len(args)
        for a in args:
            if isinstance(a, (list, tuple, dict)):
                n += len(a)
        budget.charge(n)
        return n

    def size(*args: Any) -> torch.Size:
        counted(*args)
        return torch.Size(*args)

    def mapping(*args: Any) -> dict:  # an OrderedDict read as a dict (no attributes to set)
        counted(*args)
        return dict(*args)

    def path(*parts: Any) -> str:  # StorageMeta.checkpoint_id: a path object read as its text
        counted(*parts)
        if not all(type(p) is str for p in parts) or sum(map(len, parts)) > _MAX_PATH_CHARS:
            raise pickle.UnpicklingError("the metadata holds a path that is not a short text path")
        return str(pathlib.PurePosixPath(*parts))

    def mem_format(value: Any) -> _MemoryFormatCode:
        budget.charge(1)
        return _MemoryFormatCode(dcp_md._MEM_FORMAT_ENCODING(value))

    def layout(name: Any) -> Any:
        budget.charge(1)
        return torch.serialization._get_layout(name)

    allowed[("torch", "Size")] = size
    allowed[("collections", "OrderedDict")] = mapping
    # where each Python's pickle finds them: pathlib on 3.12 and before,
    # pathlib._local on 3.13 (a stock checkpoint records the saver's)
    for module in ("pathlib", "pathlib._local"):
        allowed[(module, "PosixPath")] = allowed[(module, "PurePosixPath")] = path
    allowed[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = mem_format
    allowed[("torch.serialization", "_get_layout")] = layout  # a look-up by name in a table
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """The full pickle machine, with globals limited to DCP's metadata types,
    and what they build bounded by the file's size (:class:`_Budget`)."""

    def __init__(self, file: Any, size_bytes: int) -> None:
        super().__init__(file)
        self._allowed = _allowed(_Budget(_ELEMENTS_FLOOR + _ELEMENTS_PER_BYTE * size_bytes))

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
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
        restricted = cast(LoadPlanner, _RestrictedObjects(planner, where, self.allow_pickle))  # a proxy of planner
        return super().read_data(plan, restricted)

    @logged_metadata_errors
    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        directory = os.fspath(self.path)
        path = os.path.join(directory, fmt.STOCK_METADATA_NAME)
        fd = files.open_regular(path, files.MAX_METADATA_BYTES)  # no link, FIFO or device; bounded
        with os.fdopen(fd, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, os.fstat(f.fileno()).st_size).load()
            except MetadataBudgetError as e:
                raise MetadataBudgetError(f"{path}: {e}") from None
            except Exception as e:  # noqa: BLE001 - any failure is a refused metadata file
                raise fmt.CheckpointFormatError(f"{path}: refusing this stock DCP metadata: {e}") from None
        # (an object the pickle machine created but never filled in lacks its fields: refused here)
        sd_md = getattr(metadata, "state_dict_metadata", None)
        if type(metadata) is not dcp_md.Metadata or not isinstance(getattr(metadata, "storage_data", None), dict) \
                or not isinstance(sd_md, dict):
            raise fmt.CheckpointFormatError(f"{path}: not a stock DCP checkpoint's metadata")
        for fqn, md in sd_md.items():
            if type(md) is dcp_md.TensorStorageMetadata:
                _check_tensor(path, fqn, md)
            elif isinstance(md, dcp_md.BytesStorageMetadata) and not vars(md):
                sd_md[fqn] = dcp_md.BytesStorageMetadata()  # fieldless: created, never given a state
            else:
                raise fmt.CheckpointFormatError(f"{path}: {str(fqn)[:200]!r}: malformed state dict entry")
        checked: dict[str, int] = {}  # each data file is lstat'ed once, not once per item: its size
        for index, info in metadata.storage_data.items():
            _check_storage_info(directory, index, info, checked)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = dcp_md.StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


def _check_storage_info(directory: str, index: Any, info: Any, checked: dict[str, int]) -> None:
    where = f"{directory}: {getattr(index, 'fqn', index)!r}"
    if type(info) is not _StorageInfo or not {"relative_path", "offset", "length"}.issubset(vars(info)):
        raise fmt.CheckpointFormatError(f"{where}: malformed storage entry")
    name = info.relative_path
    if not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", ".."):
        raise fmt.CheckpointFormatError(f"{where}: data file {str(name)[:200]!r} is not a file of the checkpoint")
    transforms = getattr(info, "transform_descriptors", None)
    if transforms:
        raise fmt.CheckpointFormatError(
            f"{where}: stream transforms {list(transforms)!r} (a compressed stock checkpoint) "
            f"are not read by fp_dcp's safe stock reader; load it with DCP's FileSystemReader if you trust it"
        )
    for field in (info.offset, info.length):
        if not isinstance(field, int) or isinstance(field, bool) or field < 0:
            raise fmt.CheckpointFormatError(f"{where}: malformed offset or length")
    if name not in checked:
        st = os.lstat(os.path.join(directory, name))
        if not stat.S_ISREG(st.st_mode):
            raise fmt.CheckpointFormatError(f"{where}: data file {name!r} is a symbolic link or not a regular file")
        checked[name] = st.st_size
    if info.offset + info.length > checked[name]:
        raise fmt.CheckpointFormatError(
            f"{where}: data file {os.path.join(directory, name)} is truncated ({checked[name]} bytes, the "
            f"metadata records bytes up to {info.offset + info.length}); the checkpoint is damaged"
        )


def _check_tensor(path: str, fqn: Any, md: dcp_md.TensorStorageMetadata) -> None:
    """A tensor entry whose chunks lie inside it and store it whole."""
    size, chunks = getattr(md, "size", None), getattr(md, "chunks", None)
    ok = type(getattr(md, "properties", None)) is dcp_md.TensorProperties and isinstance(size, torch.Size) \
        and isinstance(chunks, list) and all(
        type(c) is dcp_md.ChunkStorageMetadata and len(vars(c)) == 2 and isinstance(c.offsets, torch.Size)
        and isinstance(c.sizes, torch.Size) and len(c.offsets) == len(c.sizes) == len(size)
        and all(0 <= o and 0 <= n and o + n <= d for o, n, d in zip(c.offsets, c.sizes, size))
        for c in chunks
    )
    if not ok:
        raise fmt.CheckpointFormatError(f"{path}: {str(fqn)[:200]!r}: malformed tensor entry (a chunk outside it)")
    assert isinstance(chunks, list)  # ok: checked above
    try:
        fmt.check_chunks_cover(str(fqn), size, [(c.offsets, c.sizes) for c in chunks])
    except fmt.CheckpointFormatError as e:
        raise fmt.CheckpointFormatError(f"{path}: {e}") from None


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
