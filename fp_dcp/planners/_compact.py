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
from collections import ChainMap
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItem, WriteItemType

from fp_dcp.gc_freeze import paused as gc_paused
from fp_dcp.planners import _items

__all__ = ["WriteItems", "WriteColumns", "ReadItems", "FlatMappings", "merged"]

_W_KINDS = list(WriteItemType)
_R_KINDS = list(LoadItemType)
_NONE = -1


def _props_key(p: TensorProperties) -> tuple:
    return tuple(vars(p).values())  # every field this torch has (strides too, where it has them)


def _encode_write(items: list) -> tuple | None:
    kinds: list[int] = []
    fqns: list[str] = []
    hints: list = []
    ndims: list[int] = []
    flat: list[int] = []
    props: list = []
    table: dict[tuple, int] = {}
    objs: list = []
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
            objs.append(td.properties)
        props.append(pi)
    if any("\0" in f for f in fqns):
        return None
    return (bytes(kinds), _joined(fqns), _pack(hints), _pack(ndims), _pack(flat),
            objs, _pack(props))


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


_last_split: tuple[str, list] = ("", [])
_last_joined = ""


def _joined(names: Any) -> str:
    """``names`` joined by NULs (a string already joined: itself), as the
    very string object made last time where equal: a plan's items and its
    ``planner_data`` name the same keys, and pickle then sends them once."""
    global _last_joined
    out = names if type(names) is str else "\0".join(names)
    if out == _last_joined:
        return _last_joined
    _last_joined = out
    return out


def _fqns(joined: str, n: int) -> list:
    """``joined`` split at NULs, as a new list.  The plans of a sharded
    model name the same keys on every rank: the last split is copied."""
    global _last_split
    if not n:
        return []
    last = _last_split
    if last[0] == joined and len(last[1]) == n:  # ("" is no key and one empty key alike)
        return list(last[1])
    names = joined.split("\0")
    _last_split = (joined, names)
    return list(names)


class WriteColumns:
    """One plan's write items as columns: ``kinds`` (index into
    ``WriteItemType``), ``fqns``, ``hints`` (-1: None), ``ndims`` (-1: no
    tensor data), ``flat`` (per tensor item: offsets, sizes, global size),
    ``starts`` (each item's place in ``flat``), ``table`` (the distinct
    ``TensorProperties``) and ``props`` (index into it).  The integer
    columns keep the narrowest type that holds them (read-only where
    unpickled)."""

    __slots__ = ("kinds", "fqns", "hints", "ndims", "flat", "table", "props")

    def __init__(self, kinds: np.ndarray, fqns: list, hints: np.ndarray, ndims: np.ndarray, flat: np.ndarray,
                 table: list, props: np.ndarray) -> None:
        self.kinds, self.fqns, self.hints, self.ndims = kinds, fqns, hints, ndims
        self.flat, self.table, self.props = flat, table, props

    @property
    def starts(self) -> np.ndarray:
        width = 3 * np.maximum(self.ndims.astype(np.int64), 0)
        return np.cumsum(width) - width

    @classmethod
    def unpacked(cls, kinds: bytes, fqns: str, hints: tuple, ndims: tuple, flat: tuple, table: list,
                 props: tuple) -> "WriteColumns":
        return cls(np.frombuffer(kinds, dtype=np.uint8), _fqns(fqns, len(kinds)), _array(hints), _array(ndims),
                   _array(flat), table, _array(props))

    def packed(self) -> tuple:
        return (self.kinds.astype(np.uint8).tobytes(), _joined(self.fqns), _pack_array(self.hints),
                _pack_array(self.ndims), _pack_array(self.flat), self.table, _pack_array(self.props))

    def items(self) -> list:
        index, chunk, write_item, tensor_data = _items.index, _items.chunk, _items.write_item, _items.tensor_data
        size_of = torch.Size
        out: list = []
        append = out.append
        pos = 0
        flat = self.flat.tolist()
        table = self.table
        with gc_paused():
            for k, fqn, h, nd, pi in zip(self.kinds.tolist(), self.fqns, self.hints.tolist(), self.ndims.tolist(),
                                         self.props.tolist()):
                hint = None if h == _NONE else h
                if nd == _NONE:
                    append(write_item(index(fqn, None, hint), _W_KINDS[k], None))
                    continue
                off = size_of(flat[pos:pos + nd])
                sizes = size_of(flat[pos + nd:pos + 2 * nd])
                size = size_of(flat[pos + 2 * nd:pos + 3 * nd])
                pos += 3 * nd
                append(write_item(index(fqn, off, hint), _W_KINDS[k],
                                  tensor_data(chunk(off, sizes), table[pi], size)))
        return out


def _array(packed: tuple[str, bytes]) -> np.ndarray:
    """The packed numbers, read-only, in the type they were packed in."""
    return np.frombuffer(packed[1], dtype=np.dtype(packed[0]))


def _pack_array(a: np.ndarray) -> tuple[str, bytes]:
    lo, hi = (int(a.min()), int(a.max())) if len(a) else (0, 0)
    for code, bound in (("b", 1 << 7), ("h", 1 << 15), ("i", 1 << 31)):
        if -bound <= lo and hi < bound:
            return code, a.astype(np.dtype(code)).tobytes()
    return "q", a.astype(np.int64).tobytes()


def _decode_write(kinds: bytes, fqns: str, hints: tuple, ndims: tuple, flat: tuple, table: list,
                  props: tuple, lazy: bool = False) -> "WriteItems":
    cols = WriteColumns.unpacked(kinds, fqns, hints, ndims, flat, table, props)
    # made into items when first read as a list: a global plan's items are
    # not read by a storage that keeps the rank's local items (fp_dcp's)
    out = WriteItems.of_columns(cols)
    out.lazy = lazy  # a local plan on the coordinator: planned from its columns
    return out


def _filled(name: str) -> Any:
    base = getattr(list, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._cols is not None:
            self._fill()
        return base(self, *args, **kwargs)

    method.__name__ = name
    return method


# every list method that reads or changes the items: each fills them in first
_LIST_METHODS = ("__iter__", "__len__", "__getitem__", "__contains__", "__eq__", "__ne__", "__lt__", "__le__",
                 "__gt__", "__ge__", "__repr__", "__reversed__", "__add__", "__mul__", "__rmul__", "__iadd__",
                 "__imul__", "__setitem__", "__delitem__", "__sizeof__", "append", "extend", "insert", "pop",
                 "remove", "index", "count", "copy", "sort", "reverse", "clear")


class WriteItems(list):
    """A list of ``WriteItem`` that pickles as columns.

    One made by :meth:`of_columns` holds only the columns until something
    reads it as a list (every list method makes the items first): the
    coordinator plans a save from the columns of the gathered plans
    (:mod:`fp_dcp.planners._columns`) without making millions of items.
    ``lazy`` (set on a local plan): unpickled that way."""

    _cols: WriteColumns | None = None
    lazy = False

    @classmethod
    def of_columns(cls, cols: WriteColumns) -> "WriteItems":
        out = cls()
        out._cols = cols
        return out

    def columns(self) -> WriteColumns | None:
        """The items as columns (None: they cannot be)."""
        if self._cols is not None:
            return self._cols
        try:
            packed = _encode_write(self)
        except (OverflowError, TypeError):
            return None
        return None if packed is None else WriteColumns.unpacked(*packed)

    def _fill(self) -> None:
        cols, self._cols = self._cols, None
        assert cols is not None  # _fill runs only while the columns are held
        list.extend(self, cols.items())

    def __reduce__(self) -> Any:
        if self._cols is not None:
            return (_decode_write, (*self._cols.packed(), self.lazy))
        try:
            cols = _encode_write(self)
        except (OverflowError, TypeError):  # numbers beyond int64, or not numbers: an ordinary list
            cols = None
        return (list, (list(self),)) if cols is None else (_decode_write, (*cols, self.lazy))


for _name in _LIST_METHODS:
    setattr(WriteItems, _name, _filled(_name))
WriteItems.__hash__ = None  # type: ignore[assignment]


def _encode_read(items: list) -> tuple | None:
    """(kinds, fqns, ndims, hints (dest, storage per item), whether each
    index has an offset (2 per item), the numbers: per item the index
    offsets it has, then dest offsets, storage offsets, lengths)."""
    kinds: list[int] = []
    fqns: list[str] = []
    nds: list[int] = []
    hints: list[int] = []
    has: list[int] = []
    flat: list[int] = []
    kind_of = {k: i for i, k in enumerate(_R_KINDS)}
    for it in items:
        if type(it) is not ReadItem:
            return None
        d, s = it.dest_index, it.storage_index
        if d.fqn != s.fqn:
            return None
        lengths = it.lengths
        nd = len(lengths)
        do, so = d.offset, s.offset
        if len(it.dest_offsets) != nd or len(it.storage_offsets) != nd or \
                (do is not None and len(do) != nd) or (so is not None and len(so) != nd):
            return None
        kinds.append(kind_of[it.type])
        fqns.append(d.fqn)
        nds.append(nd)
        hints.append(_NONE if d.index is None else d.index)
        hints.append(_NONE if s.index is None else s.index)
        if do is None:
            has.append(0)
        else:
            has.append(1)
            flat += do
        if so is None:
            has.append(0)
        else:
            has.append(1)
            flat += so
        flat += it.dest_offsets
        flat += it.storage_offsets
        flat += lengths
    if any("\0" in f for f in fqns):
        return None
    return (bytes(kinds), "\0".join(fqns), _pack(nds), _pack(hints), bytes(has), _pack(flat))


def _read_items(kinds: bytes, fqns: str, nds: tuple, hints: tuple, has: bytes, flat: tuple,
                rows: list | None = None) -> list:
    """The items (``rows``: only those, in that order)."""
    index, read_item = _items.index, _items.read_item
    size_of = torch.Size
    names = _fqns(fqns, len(kinds))
    nd_l, hint_l, values = _unpack(nds), _unpack(hints), _unpack(flat)
    starts = None
    if rows is not None:
        nd_a = np.array(nd_l, dtype=np.int64)
        has_a = np.frombuffer(has, dtype=np.uint8).reshape(-1, 2).sum(axis=1, dtype=np.int64)
        width = nd_a * (has_a + 3)
        starts = (np.cumsum(width) - width).tolist()
    out: list = []
    append = out.append
    pos = 0
    with gc_paused():
        for i in range(len(kinds)) if rows is None else rows:
            if starts is not None:
                pos = starts[i]
            nd = nd_l[i]
            offs: list[torch.Size | None] = [None, None]
            for j in (0, 1):
                if has[2 * i + j]:
                    offs[j] = size_of(values[pos:pos + nd])
                    pos += nd
            dest = size_of(values[pos:pos + nd])
            stor = size_of(values[pos + nd:pos + 2 * nd])
            lengths = size_of(values[pos + 2 * nd:pos + 3 * nd])
            pos += 3 * nd
            dh, sh = hint_l[2 * i], hint_l[2 * i + 1]
            fqn = names[i]
            append(read_item(_R_KINDS[kinds[i]], index(fqn, offs[0], None if dh == _NONE else dh), dest,
                             index(fqn, offs[1], None if sh == _NONE else sh), stor, lengths))
    return out


# (columns, items) of the last ReadItems this process pickled: a plan that
# comes back unchanged (DCP's default global load plan) is those items again
_last_sent: tuple[tuple, tuple] | None = None
_TENSOR_KIND = _R_KINDS.index(LoadItemType.TENSOR)


def _decode_read(*cols: Any) -> "ReadItems":
    out = ReadItems()
    out._cols = cols  # made into items when first read as a list
    return out


class ReadItems(list):
    """A list of ``ReadItem`` that pickles as columns.  Unpickled, it holds
    the columns until something reads it as a list (the coordinator of a
    load passes the gathered plans on unread); a plan that comes back to
    the process that sent it, unchanged, is made of the items it sent
    (frozen objects, equal field for field)."""

    _cols: tuple | None = None

    def _fill(self) -> None:
        cols, self._cols = self._cols, None
        assert cols is not None  # _fill runs only while the columns are held
        last = _last_sent
        list.extend(self, last[1] if last is not None and last[0] == cols else _read_items(*cols))

    def tensor_reads(self, min_ndim: int) -> list:
        """The tensor items of at least ``min_ndim`` dimensions, in order;
        where the columns are still held, only those are made."""
        cols = self._cols
        if cols is None:
            return [r for r in self if r.type == LoadItemType.TENSOR and len(r.lengths) >= min_ndim]
        if self._sent_back():
            self._fill()
            return self.tensor_reads(min_ndim)
        kind_a = np.frombuffer(cols[0], dtype=np.uint8)
        rows = np.flatnonzero((kind_a == _TENSOR_KIND) & (_array(cols[2]) >= min_ndim)).tolist()
        kinds_b, fqns_s, nds, hints, has, flat = cols
        return _read_items(kinds_b, fqns_s, nds, hints, has, flat, rows) if rows else []

    def _sent_back(self) -> bool:
        last = _last_sent
        return last is not None and last[0] == self._cols

    def __reduce__(self) -> Any:
        global _last_sent
        if self._cols is not None:
            return (_decode_read, self._cols)
        try:
            cols = _encode_read(self)
        except (OverflowError, TypeError):  # numbers beyond int64, or not numbers: an ordinary list
            cols = None
        if cols is None:
            return (list, (list(self),))
        _last_sent = (cols, tuple(self))
        return (_decode_read, cols)


for _name in _LIST_METHODS:
    setattr(ReadItems, _name, _filled(_name))
ReadItems.__hash__ = None  # type: ignore[assignment]


_last_mappings: tuple[str, dict] = ("", {})


def _flat_mappings(keys: str | tuple, n: int) -> "FlatMappings":
    global _last_mappings
    if type(keys) is tuple:  # (the plan's items' keys, the rest)
        keys = "\0".join(keys)
    assert type(keys) is str  # as pickled
    last = _last_mappings
    if last[0] == keys and len(last[1]) == n:  # (the tuples are shared: immutable)
        keys, base = last  # one string for every plan that names these keys
    else:
        names = _fqns(keys, n)
        base = dict(zip(names, zip(names)))
        _last_mappings = (keys, base)
    out = FlatMappings(base)
    out._keys = keys
    return out


def _sent_keys(keys: str) -> str | tuple:
    """``keys`` as pickled: the last joined string itself where equal (the
    plan's items, pickled just before, name the same keys: pickle sends
    them once), or that string and the rest where ``keys`` extends it
    (items dedup moved to other ranks)."""
    last = _last_joined
    if keys == last:
        return last
    if last and len(keys) > len(last) and keys[len(last)] == "\0" and keys.startswith(last):
        return (last, keys[len(last) + 1:])
    return keys


def _dropping_keys(name: str) -> Any:
    base = getattr(dict, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._keys = None
        return base(self, *args, **kwargs)

    method.__name__ = name
    return method


class FlatMappings(dict):
    """A save plan's ``planner_data`` (DCP's flattening mappings): where every
    key maps to ``(key,)`` (a flat state dict), pickled as the keys alone;
    otherwise pickled as a dict.  Unpickled from the keys, it remembers
    them (until changed) to pickle again at once and to be merged with
    others at once (:func:`merged`)."""

    _keys: str | None = None  # the keys joined by NULs, while every value is (key,)

    def __reduce__(self) -> Any:
        if self._keys is not None:
            return (_flat_mappings, (_sent_keys(self._keys), len(self)))
        if all(type(k) is str and type(v) is tuple and len(v) == 1 and type(v[0]) is str and v[0] == k
               for k, v in self.items()):
            joined = "\0".join(self)
            if joined.count("\0") == max(len(self) - 1, 0):
                return (_flat_mappings, (_sent_keys(joined), len(self)))
        return (dict, (dict(self),))


for _name in ("__setitem__", "__delitem__", "__ior__", "update", "pop", "popitem", "clear", "setdefault"):
    setattr(FlatMappings, _name, _dropping_keys(_name))


def merged(maps: list) -> dict:
    """``dict(ChainMap(*maps))``: DCP's merge of the plans' ``planner_data``;
    at once where every map is the same unchanged unpickled key list."""
    first = maps[0] if maps else None
    if type(first) is FlatMappings and first._keys is not None and \
            all(type(m) is FlatMappings and m._keys == first._keys for m in maps):
        return dict(first)
    return dict(ChainMap(*maps))
