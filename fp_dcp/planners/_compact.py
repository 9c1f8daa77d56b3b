"""Plan item lists that travel between ranks as columns.

DCP gathers every rank's plan on the coordinator and scatters the global
plans back with ``pickle``: each ``WriteItem`` / ``ReadItem`` is half a dozen
dataclasses and ``torch.Size`` objects, each pickled and rebuilt on its own,
with the garbage collector walking the heap as they pile up.
:class:`WriteItems` and :class:`ReadItems` are plain lists of DCP's items
(every use of a plan sees a list) that pickle as a few flat columns instead,
and are rebuilt from them with the collector paused.  What comes out equals
what went in, field for field (hints included).  A list holding anything
the columns cannot describe (a planner's own item subclass, ``bytes_io_data``)
pickles as an ordinary list.
"""

from __future__ import annotations

import array
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItem, WriteItemType

from fp_dcp.gc_freeze import paused as gc_paused
from fp_dcp.planners import _items

__all__ = ["WriteItems", "ReadItems"]

_W_KINDS = list(WriteItemType)
_R_KINDS = list(LoadItemType)
_NONE = -1


def _props_key(p: TensorProperties) -> tuple:
    return (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)


def _encode_write(items: list) -> tuple | None:
    kinds, fqns, hints, ndims, flat, props = [], [], [], [], [], []
    table: dict[tuple, int] = {}
    for it in items:
        if type(it) is not WriteItem or it.bytes_io_data is not None:
            return None
        ix = it.index
        td = it.tensor_data
        kinds.append(_W_KINDS.index(it.type))
        fqns.append(ix.fqn)
        hints.append(_NONE if ix.index is None else ix.index)
        if td is None:
            if ix.offset is not None:
                return None
            ndims.append(_NONE)
            props.append(_NONE)
            continue
        ch = td.chunk
        if ch is None or ix.offset != ch.offsets or type(td.properties) is not TensorProperties:
            return None
        nd = len(td.size)
        if len(ch.offsets) != nd or len(ch.sizes) != nd:
            return None
        ndims.append(nd)
        flat += ch.offsets
        flat += ch.sizes
        flat += td.size
        key = _props_key(td.properties)
        pi = table.get(key)
        if pi is None:
            pi = table[key] = len(table)
        props.append(pi)
    if any("\0" in f for f in fqns):
        return None
    return (bytes(kinds), "\0".join(fqns), _pack(hints), _pack(ndims), _pack(flat),
            [TensorProperties(*k) for k in table], _pack(props))


def _pack(ints: list) -> tuple[str, bytes]:
    """Python ints as one bytes object of the narrowest signed type that
    holds them: pickled and read back at C speed."""
    lo, hi = (min(ints), max(ints)) if ints else (0, 0)
    for code, bound in (("b", 1 << 7), ("h", 1 << 15), ("i", 1 << 31)):
        if -bound <= lo and hi < bound:
            return code, array.array(code, ints).tobytes()
    return "q", array.array("q", ints).tobytes()


def _unpack(packed: tuple[str, bytes]) -> list:
    a = array.array(packed[0])
    a.frombytes(packed[1])
    return a.tolist()


def _fqns(joined: str, n: int) -> list:
    return joined.split("\0") if n else []


def _decode_write(kinds: bytes, fqns: str, hints: tuple, ndims: tuple, flat: tuple, table: list,
                  props: tuple) -> "WriteItems":
    index, chunk, write_item, tensor_data = _items.index, _items.chunk, _items.write_item, _items.tensor_data
    size_of = torch.Size
    out = WriteItems()
    append = out.append
    pos = 0
    flat = _unpack(flat)
    with gc_paused():
        for k, fqn, h, nd, pi in zip(kinds, _fqns(fqns, len(kinds)), _unpack(hints), _unpack(ndims),
                                     _unpack(props)):
            hint = None if h == _NONE else h
            if nd == _NONE:
                append(write_item(index(fqn, None, hint), _W_KINDS[k], None))
                continue
            off = size_of(flat[pos:pos + nd])
            sizes = size_of(flat[pos + nd:pos + 2 * nd])
            size = size_of(flat[pos + 2 * nd:pos + 3 * nd])
            pos += 3 * nd
            append(write_item(index(fqn, off, hint), _W_KINDS[k], tensor_data(chunk(off, sizes), table[pi], size)))
    return out


class WriteItems(list):
    """A list of ``WriteItem`` that pickles as columns."""

    def __reduce__(self) -> Any:
        try:
            cols = _encode_write(self)
        except (OverflowError, TypeError):  # numbers beyond int64, or not numbers: an ordinary list
            cols = None
        return (list, (list(self),)) if cols is None else (_decode_write, cols)


def _encode_read(items: list) -> tuple | None:
    kinds, fqns, ints = [], [], []
    for it in items:
        if type(it) is not ReadItem:
            return None
        d, s = it.dest_index, it.storage_index
        if d.fqn != s.fqn:
            return None
        nd = len(it.lengths)
        kinds.append(_R_KINDS.index(it.type))
        fqns.append(d.fqn)
        parts = (d.offset, s.offset, it.dest_offsets, it.storage_offsets)
        if any(p is not None and len(p) != nd for p in parts):
            return None
        ints.append(nd)
        ints.append(_NONE if d.index is None else d.index)
        ints.append(_NONE if s.index is None else s.index)
        for p in parts[:2]:  # index offsets may be None
            if p is None:
                ints.append(0)
            else:
                ints.append(1)
                ints += p
        ints += it.dest_offsets
        ints += it.storage_offsets
        ints += it.lengths
    if any("\0" in f for f in fqns):
        return None
    return (bytes(kinds), "\0".join(fqns), _pack(ints))


def _decode_read(kinds: bytes, fqns: str, ints: tuple) -> "ReadItems":
    index, read_item = _items.index, _items.read_item
    size_of = torch.Size
    out = ReadItems()
    append = out.append
    pos = 0
    ints = _unpack(ints)
    with gc_paused():
        for k, fqn in zip(kinds, _fqns(fqns, len(kinds))):
            nd, dh, sh = ints[pos], ints[pos + 1], ints[pos + 2]
            pos += 3
            offs = []
            for _ in range(2):
                has = ints[pos]
                pos += 1
                if has:
                    offs.append(size_of(ints[pos:pos + nd]))
                    pos += nd
                else:
                    offs.append(None)
            dest = size_of(ints[pos:pos + nd])
            stor = size_of(ints[pos + nd:pos + 2 * nd])
            lengths = size_of(ints[pos + 2 * nd:pos + 3 * nd])
            pos += 3 * nd
            append(read_item(_R_KINDS[k], index(fqn, offs[0], None if dh == _NONE else dh), dest,
                             index(fqn, offs[1], None if sh == _NONE else sh), stor, lengths))
    return out


class ReadItems(list):
    """A list of ``ReadItem`` that pickles as columns."""

    def __reduce__(self) -> Any:
        try:
            cols = _encode_read(self)
        except (OverflowError, TypeError):  # numbers beyond int64, or not numbers: an ordinary list
            cols = None
        return (list, (list(self),)) if cols is None else (_decode_read, cols)
