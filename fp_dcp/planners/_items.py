"""DCP's plan objects (``WriteItem``, ``ReadItem``, ``MetadataIndex``, ...)
built without their dataclass ``__init__``.

DCP's dataclasses are plain (frozen) dataclasses without ``__slots__``: an
instance is its ``__dict__``.  Filling that dict directly is 3-4x faster than
the generated ``__init__`` (which goes through ``object.__setattr__`` once
per field) and gives an object equal to, and indistinguishable from, one
built the usual way.  :data:`FAST` says whether the installed torch's classes
still have that shape (checked once, by building each both ways and
comparing); where not, every builder here calls the classes' constructors.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from fp_dcp.gc_freeze import paused as gc_paused

__all__ = ["FAST", "paused", "index", "write_item", "read_item", "chunk", "zeros", "properties", "with_index_hint"]

_new = object.__new__


def paused(method: Callable) -> Callable:
    """Run a planning step with the cyclic garbage collector paused: it
    allocates many objects and frees none, and each full collection would
    walk every object of the process (tenths of a second with torch
    imported).  Back as it was after (:func:`fp_dcp.gc_freeze.paused`)."""

    @functools.wraps(method)
    def step(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return method(*args, **kwargs)

    return step
_ZEROS: dict[int, torch.Size] = {}
_PROPS: dict[tuple, TensorProperties] = {}
_STRIDES = "strides" in {f.name for f in dataclasses.fields(TensorProperties)}  # a torch that records them


def zeros(ndim: int) -> torch.Size:
    """A shared ``torch.Size([0] * ndim)``."""
    z = _ZEROS.get(ndim)
    if z is None:
        z = _ZEROS[ndim] = torch.Size([0] * ndim)
    return z


def properties(t: torch.Tensor) -> TensorProperties:
    """``TensorProperties.create_from_tensor(t)``, one shared (never mutated)
    object per distinct value: pickled once per message."""
    key = (t.dtype, t.layout, t.requires_grad, t.is_pinned(), t.stride() if _STRIDES else None)
    p = _PROPS.get(key)
    if p is None:
        p = _PROPS[key] = TensorProperties.create_from_tensor(t)
    return p


def _index_fast(fqn: str, offset: torch.Size | None, hint: int | None) -> MetadataIndex:
    m = _new(MetadataIndex)
    d = m.__dict__
    d["fqn"] = fqn
    d["index"] = hint
    if offset is not None:  # as MetadataIndex.__init__: None stays the class default
        d["offset"] = offset
    return m


def _chunk_fast(offsets: torch.Size, sizes: torch.Size) -> ChunkStorageMetadata:
    c = _new(ChunkStorageMetadata)
    d = c.__dict__
    d["offsets"] = offsets
    d["sizes"] = sizes
    return c


def _write_item_fast(idx: MetadataIndex, kind: WriteItemType, td: TensorWriteData | None) -> WriteItem:
    w = _new(WriteItem)
    d = w.__dict__
    d["index"] = idx
    d["type"] = kind
    d["bytes_io_data"] = None
    d["tensor_data"] = td
    return w


def _tensor_data_fast(ch: ChunkStorageMetadata, props: TensorProperties, size: torch.Size) -> TensorWriteData:
    t = _new(TensorWriteData)
    d = t.__dict__
    d["chunk"] = ch
    d["properties"] = props
    d["size"] = size
    return t


def _read_item_fast(kind: LoadItemType, dest: MetadataIndex, dest_offsets: torch.Size, storage: MetadataIndex,
                    storage_offsets: torch.Size, lengths: torch.Size) -> ReadItem:
    r = _new(ReadItem)
    d = r.__dict__
    d["type"] = kind
    d["dest_index"] = dest
    d["dest_offsets"] = dest_offsets
    d["storage_index"] = storage
    d["storage_offsets"] = storage_offsets
    d["lengths"] = lengths
    return r


def _with_hint_fast(item: WriteItem, hint: int) -> WriteItem:
    ix = item.index
    w = _new(WriteItem)
    d = w.__dict__
    d.update(item.__dict__)
    d["index"] = _index_fast(ix.fqn, ix.__dict__.get("offset"), hint)
    return w


# the constructors' way (a torch whose classes changed shape)
def _index_slow(fqn: str, offset: torch.Size | None, hint: int | None) -> MetadataIndex:
    return MetadataIndex(fqn, offset, hint)


def _chunk_slow(offsets: torch.Size, sizes: torch.Size) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=offsets, sizes=sizes)


def _write_item_slow(idx: MetadataIndex, kind: WriteItemType, td: TensorWriteData | None) -> WriteItem:
    return WriteItem(index=idx, type=kind, tensor_data=td)


def _tensor_data_slow(ch: ChunkStorageMetadata, props: TensorProperties, size: torch.Size) -> TensorWriteData:
    return TensorWriteData(chunk=ch, properties=props, size=size)


def _read_item_slow(kind, dest, dest_offsets, storage, storage_offsets, lengths) -> ReadItem:
    return ReadItem(type=kind, dest_index=dest, dest_offsets=dest_offsets, storage_index=storage,
                    storage_offsets=storage_offsets, lengths=lengths)


def _with_hint_slow(item: WriteItem, hint: int) -> WriteItem:
    return dataclasses.replace(item, index=dataclasses.replace(item.index, index=hint))


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b and vars(a) == vars(b)


def _fast_fits() -> bool:
    """Whether the direct builders make objects equal to the constructors'."""
    try:
        for cls in (MetadataIndex, ChunkStorageMetadata, WriteItem, TensorWriteData, ReadItem):
            if not dataclasses.is_dataclass(cls) or "__slots__" in cls.__dict__:
                return False
        s, z = torch.Size([3, 4]), torch.Size([0, 0])
        p = TensorProperties.create_from_tensor(torch.zeros(1))
        ch = _chunk_fast(z, s)
        td = _tensor_data_fast(ch, p, s)
        w = _write_item_fast(_index_fast("k", z, None), WriteItemType.TENSOR, td)
        r = _read_item_fast(LoadItemType.TENSOR, _index_fast("k", z, 0), z, _index_fast("k", z, 0), z, s)
        pairs = [
            (_index_fast("k", z, 1), MetadataIndex("k", z, 1)),
            (_index_fast("k", None, None), MetadataIndex("k")),
            (ch, ChunkStorageMetadata(offsets=z, sizes=s)),
            (td, TensorWriteData(chunk=ch, properties=p, size=s)),
            (w, WriteItem(index=MetadataIndex("k", z), type=WriteItemType.TENSOR, tensor_data=td)),
            (_with_hint_fast(w, 2), _with_hint_slow(w, 2)),
            (r, ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("k", z, 0), dest_offsets=z,
                         storage_index=MetadataIndex("k", z, 0), storage_offsets=z, lengths=s)),
        ]
        return all(_same(a, b) for a, b in pairs) and set(vars(BytesStorageMetadata())) == set() \
            and set(f.name for f in dataclasses.fields(TensorStorageMetadata)) == {"properties", "size", "chunks"}
    except Exception:  # noqa: BLE001 - any surprise: use the constructors
        return False


FAST = _fast_fits()
if FAST:
    index, chunk, write_item, tensor_data = _index_fast, _chunk_fast, _write_item_fast, _tensor_data_fast
    read_item, with_index_hint = _read_item_fast, _with_hint_fast
else:  # pragma: no cover - a torch whose plan classes changed shape
    index, chunk, write_item, tensor_data = _index_slow, _chunk_slow, _write_item_slow, _tensor_data_slow
    read_item, with_index_hint = _read_item_slow, _with_hint_slow
