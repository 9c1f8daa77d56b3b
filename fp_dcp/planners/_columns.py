"""The coordinator's share of a save's planning (dedup, global plan,
``Metadata``, validation), computed from the plans' columns.

Every rank's local plan reaches the coordinator as columns
(:class:`fp_dcp.planners._compact.WriteColumns`); :func:`plan` dedups and
numbers them with numpy, hands the global plans back as columns (scattered as
they are) and makes, as real objects, only the ``Metadata`` the storage
writes.  The result equals what ``dedup_save_plans`` followed by
``create_default_global_save_plan`` make.  It returns None where the
plans hold anything it does not decide the way DCP does (an item without
tensor data, a key twice in one plan, a non-shard key on several ranks
after dedup, ...): the caller then plans from the items
(:mod:`fp_dcp.planners._global`), which hands those to DCP's own code.

Millions of items pass through here at scale, so each pass over them
counts: the numbers are kept in 32 bits where they are small enough, a
tensor item's offsets, sizes and global size are read in place from the
gathered columns where every tensor has the same number of dimensions, and
per-tensor checks reduce over each tensor's chunks instead of gathering
the tensor's figures for every chunk.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from fp_dcp.planners import _compact, _items

__all__ = ["plan", "suspects"]

_W_KINDS = list(WriteItemType)
TABLE_CELLS = 1 << 22  # the most shared keys x ranks the dedup counts in one table
NARROW = 1 << 30  # offsets and sizes below this (in magnitude) are kept in 32 bits: sums of two still fit
_SHARD, _BYTE_IO = _W_KINDS.index(WriteItemType.SHARD), _W_KINDS.index(WriteItemType.BYTE_IO)


class _All:
    """Every plan's columns, concatenated: per item ``rank``, ``kinds``,
    ``ndims`` and ``fid`` (its key's number); per tensor item (the rows
    ``t``, in order) ``toff``, ``tlen``, ``tsize`` (offsets, sizes, global
    size; zero-padded to ``width`` where the tensors differ in dimensions,
    ``uniform`` where they do not) and ``tnd`` (dimensions)."""

    def __init__(self, cols: list[_compact.WriteColumns]) -> None:
        self.cols = cols
        self.counts = np.array([len(c.kinds) for c in cols], dtype=np.int64)
        self.base = np.cumsum(self.counts) - self.counts
        self.n = n = int(self.counts.sum())
        self.rank = np.repeat(np.arange(len(cols), dtype=np.int32), self.counts)
        self.kinds = np.concatenate([c.kinds for c in cols])
        self.ndims = np.concatenate([c.ndims for c in cols])
        self.fid = self._name_ids(cols)
        self.tensor = self.ndims >= 0
        self.t = np.flatnonzero(self.tensor)
        self.all_tensors = len(self.t) == n
        self.tnd = self.ndims if self.all_tensors else self.ndims[self.t]
        nds = np.flatnonzero(np.bincount(self.tnd, minlength=1)) if len(self.t) else np.zeros(0, dtype=np.int64)
        self.width = int(nds.max()) if len(nds) else 0
        self.uniform = len(nds) <= 1
        self.off_num, self.n_off = np.zeros(0, dtype=np.int64), 1  # numbered by _shared
        self._tpos: np.ndarray | None = None
        self._more: dict[str, np.ndarray] = {}
        self._boxes(cols, nds)

    def _boxes(self, cols: list[_compact.WriteColumns], nds: np.ndarray) -> None:
        small = all(c.flat.dtype.itemsize <= 2 or not len(c.flat)
                    or (-NARROW < int(c.flat.min()) and int(c.flat.max()) < NARROW) for c in cols)
        kind = np.int32 if small else np.int64
        nt, w = len(self.t), self.width
        flat = np.concatenate([c.flat for c in cols], dtype=kind) if cols else np.zeros(0, dtype=kind)
        if self.uniform and w:  # flat is the tensor items' rows: read in place
            block = flat.reshape(nt, 3 * w)
            self.toff, self.tlen, self.tsize = block[:, :w], block[:, w:2 * w], block[:, 2 * w:]
            return
        self.toff, self.tlen, self.tsize = (np.zeros((nt, w), dtype=kind) for _ in range(3))
        width = 3 * self.tnd.astype(np.int64)
        starts = np.cumsum(width) - width
        for nd in nds.tolist():
            if not nd:
                continue
            r = np.flatnonzero(self.tnd == nd)
            block = flat[starts[r][:, None] + np.arange(3 * nd)]
            self.toff[r, :nd], self.tlen[r, :nd], self.tsize[r, :nd] = \
                block[:, :nd], block[:, nd:2 * nd], block[:, 2 * nd:]

    def _name_ids(self, cols: list[_compact.WriteColumns]) -> np.ndarray:
        """Per item: the number of its fqn, numbered in the order first seen
        (``self.names``).  A plan naming the same keys as the one before it
        (every rank of a sharded model) reuses its numbers."""
        ids: dict[str, int] = {}
        out: list[np.ndarray] = []
        last_fqns: Any = None
        last = np.zeros(0, dtype=np.int32)
        for c in cols:
            if c.fqns != last_fqns:
                fresh = [f for f in dict.fromkeys(c.fqns) if f not in ids]
                ids.update(zip(fresh, range(len(ids), len(ids) + len(fresh))))
                last = np.fromiter(map(ids.__getitem__, c.fqns), dtype=np.int32, count=len(c.fqns))
                last_fqns = c.fqns
            out.append(last)
        self.names = list(ids)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)

    def tidx(self, rows: np.ndarray) -> np.ndarray:
        """The tensor items ``rows`` (row numbers) as positions in ``t``."""
        if self.all_tensors:
            return rows
        if self._tpos is None:
            self._tpos = np.cumsum(self.tensor, dtype=np.int64) - 1
        return self._tpos[rows]

    def column(self, name: str) -> np.ndarray:
        """Every plan's ``hints`` or ``props``, concatenated (made once)."""
        got = self._more.get(name)
        if got is None:
            got = self._more[name] = np.concatenate([getattr(c, name) for c in self.cols])
        return got

    def properties(self, rows: np.ndarray) -> tuple[list, np.ndarray]:
        """(every plan's ``TensorProperties`` table, concatenated; the tensor
        items ``rows``' positions in it)."""
        lens = np.array([len(c.table) for c in self.cols], dtype=np.int64)
        table = list(itertools.chain.from_iterable(c.table for c in self.cols))
        return table, (np.cumsum(lens) - lens)[self.rank[rows]] + self.column("props")[rows]

    def itemsize(self, rows: np.ndarray) -> np.ndarray:
        """The element size of the tensor items ``rows``."""
        table, at = self.properties(rows)
        return np.array([p.dtype.itemsize for p in table], dtype=np.int64)[at]


def _code(columns: list[np.ndarray], n: int) -> tuple[np.ndarray, int] | None:
    """One number per row of the equal-length ``columns``, equal for equal
    rows, in ``range(span)``: (numbers, span); None where they do not fit
    63 bits."""
    code = np.zeros(n, dtype=np.int64)
    span = 1
    for col in columns:
        if not n:
            break
        lo, hi = int(col.min()), int(col.max())
        count = hi - lo + 1
        if count == 1:  # the same in every row: tells no row apart
            continue
        if span * count >= 1 << 62:
            return None
        if span > 1:
            code *= count
        code += col
        if lo:
            code -= lo
        span *= count
    return code, span


def _row_numbers(columns: list[np.ndarray], n: int, rows: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
    """(one row of each distinct row of ``columns`` (None unless ``rows``),
    each row's number among them, numbered in value order)."""
    coded = _code(columns, n)
    if coded is None:  # not one number per row
        stacked = np.stack([c.astype(np.int64) for c in columns], axis=1)
        _, first, inverse = np.unique(stacked, axis=0, return_index=True, return_inverse=True)
        return first, inverse.reshape(-1)
    return _numbered(*coded, rows=rows)


def _numbered(code: np.ndarray, span: int, rows: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
    """(a row holding each distinct value of ``code``, in value order (None
    unless ``rows``); each row's number among them) for codes in
    ``range(span)``."""
    if span == 1:  # one value
        return (np.zeros(min(len(code), 1), dtype=np.int64) if rows else None), np.zeros(len(code), dtype=np.int32)
    if span <= 4 * len(code) + 1024:  # a table, not a sort
        seen = np.zeros(span, dtype=bool)
        seen[code] = True
        present = np.flatnonzero(seen)
        table: np.ndarray = np.empty(span, dtype=np.int32 if len(code) < 1 << 31 else np.int64)
        table[present] = np.arange(len(present))
        number = table[code]
    else:
        present, number = np.unique(code, return_inverse=True)
        number = number.reshape(-1)
    if not rows:
        return None, number
    some = np.empty(len(present), dtype=np.int64)
    some[number] = np.arange(len(code))  # any row of each value will do
    return some, number


def _shared(a: _All) -> tuple[np.ndarray, np.ndarray]:
    """Per item: a number for its (fqn, offset) key, and whether another
    item has the same key.  Each tensor item's offsets' number is kept in
    ``a.off_num`` (``a.n_off`` of them)."""
    columns = [a.toff[:, d] for d in range(a.width)]
    if not a.uniform:
        columns.insert(0, a.tnd)
    _, off_num = _row_numbers(columns, len(a.t), rows=False)
    a.n_off = n_off = int(off_num.max()) + 1 if len(off_num) else 1
    a.off_num = off_num
    code = a.fid.astype(np.int64)
    code *= n_off + 1  # (an item without tensor data: the offset number n_off, its None)
    if a.all_tensors:
        code += off_num
    else:
        extra = np.full(a.n, n_off, dtype=np.int64)
        extra[a.t] = off_num
        code += extra
    span = len(a.names) * (n_off + 1)
    if span <= 4 * a.n + 1024:  # counted in a table, not sorted
        holders = np.bincount(code, minlength=span)
        return code, holders[code] > 1
    _, inverse, counts = np.unique(code, return_inverse=True, return_counts=True)
    return code, counts[inverse.reshape(-1)] > 1


def _weights(a: _All, at: np.ndarray) -> np.ndarray:
    """DCP's dedup weight of the items ``at``: their tensor's bytes, or 1."""
    weight = np.ones(len(at), dtype=np.int64)
    is_t = a.tensor[at]
    rows = at[is_t]
    size = a.tsize[a.tidx(rows)]
    nd = a.ndims[rows]
    w = np.ones(len(rows), dtype=np.int64)
    for d in range(a.width):
        w *= np.where(nd > d, size[:, d], 1)
    weight[is_t] = np.maximum(w * a.itemsize(rows), 1)
    return weight


def _dedup(a: _All, code: np.ndarray, shared: np.ndarray, lowest: bool) -> np.ndarray | None:
    """``dedup_save_plans`` as a mask of the items kept; None where a key is
    twice in one plan.  ``code``: each item's key number; ``shared``:
    whether another item has its key."""
    keep = np.ones(a.n, dtype=bool)
    rows = np.flatnonzero(shared)
    if not len(rows):
        return keep
    rows = rows[np.argsort(code[rows], kind="stable")]  # each shared key's items, in plan order
    ks, rs = code[rows], a.rank[rows]
    if ((ks[1:] == ks[:-1]) & (rs[1:] == rs[:-1])).any():
        return None
    starts = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
    ends = np.r_[starts[1:], len(rows)]
    holders = ends - starts
    rep_weight = _weights(a, rows[ends - 1]).tolist()  # DCP weighs a shared key by its last item
    firsts = rows[starts]  # each shared key's first item
    # only the items before the last shared key's first one count towards a choice
    limit = int(firsts.max()) + 1
    weight = _weights(a, np.arange(limit))
    shared = shared[:limit]
    visit = np.argsort(firsts, kind="stable")  # DCP visits keys in the order first seen
    # the bytes of the one-rank items each rank holds before each shared key's first item
    lone_w = np.where(shared, 0, weight)
    lone_before = None
    if len(starts) * len(a.cols) <= TABLE_CELLS:  # one row per shared key, one column per rank
        cum = np.concatenate([[0], np.cumsum(lone_w)])
        at = np.minimum(np.clip(firsts[:, None], a.base, a.base + a.counts), limit)
        lone_before = cum[at] - cum[np.minimum(a.base, limit)]
    held = a.rank[rows].tolist()
    starts_l, ends_l, firsts_l = starts.tolist(), ends.tolist(), firsts.tolist()
    assigned = [0] * len(a.cols)
    sel_of = np.empty(len(starts), dtype=np.int64)
    if lone_before is None:  # many keys x ranks: the one-rank items counted as the visit reaches them
        plan_size = assigned
        done = 0
        for i in visit.tolist():
            at_i = firsts_l[i]
            if at_i > done:
                m = ~shared[done:at_i]
                acc = np.zeros(len(a.cols), dtype=np.int64)
                np.add.at(acc, a.rank[done:at_i][m], weight[done:at_i][m])
                for p in np.flatnonzero(acc).tolist():
                    plan_size[p] += int(acc[p])
                done = at_i
            cands = set(held[starts_l[i]:ends_l[i]])  # in rank order, as DCP's set
            sel = min(cands) if lowest else min(cands, key=plan_size.__getitem__)
            plan_size[sel] += rep_weight[i]
            sel_of[i] = sel
    else:
        lone = lone_before.tolist()
        for i in visit.tolist():
            cands = set(held[starts_l[i]:ends_l[i]])  # in rank order, as DCP's set
            if lowest:
                sel = min(cands)
            else:
                before = lone[i]
                sel = min(cands, key=lambda p: assigned[p] + before[p])  # noqa: B023 - used at once
            assigned[sel] += rep_weight[i]
            sel_of[i] = sel
    keep[rows] = a.rank[rows] == np.repeat(sel_of, holders)
    return keep


def plan(all_plans: list[SavePlan], lowest: bool) -> tuple[list[SavePlan], Metadata, Any] | None:
    """(global plans, Metadata, per-item columns for validation) as DCP's
    dedup and default global plan make them, or None."""
    maybe = [p.items.columns() if type(p.items) is _compact.WriteItems else None for p in all_plans]
    cols = [c for c in maybe if c is not None]
    if not cols or len(cols) != len(maybe):
        return None
    a = _All(cols)
    if ((a.kinds == _BYTE_IO) == a.tensor).any():  # bytes with tensor data, or a tensor without
        return None
    keep = _dedup(a, *_shared(a), lowest)
    if keep is None:
        return None
    kept = np.arange(a.n) if keep.all() else np.flatnonzero(keep)
    fid = a.fid[kept]
    n_names = len(a.names)
    per_name = np.bincount(fid, minlength=n_names)
    odd = np.flatnonzero(a.kinds != _SHARD)
    lone = np.zeros(n_names, dtype=bool)
    lone[a.fid[odd[keep[odd]]]] = True
    if (lone & (per_name > 1)).any():  # DCP's global plan refuses it
        return None
    # index hints: each tensor item's place among its tensor's chunks
    by_name = _stable_order(fid, n_names)
    del fid
    starts = np.cumsum(per_name) - per_name
    hints = np.empty(len(kept), dtype=np.int64)
    hints[by_name] = np.arange(len(kept)) - np.repeat(starts, per_name)
    others = np.flatnonzero(~a.tensor[kept])
    hints[others] = a.column("hints")[kept[others]]  # an item without tensor data keeps its own
    first = np.full(n_names, -1, dtype=np.int64)
    named = per_name > 0
    first[named] = kept[by_name[starts[named]]]  # each key's first kept item
    order = kept[by_name]  # the kept items, grouped by key, each group in plan order
    tensor_names = np.flatnonzero(named & a.tensor[first])  # every kept item of these has tensor data
    tp = a.tidx(order if a.all_tensors else order[a.tensor[order]])
    # the tensor items' chunks (a column per dimension), gathered once for the Metadata and the validation
    boxes = (tp, [_gathered(a.toff[:, d], tp) for d in range(a.width)],
             [_gathered(a.tlen[:, d], tp) for d in range(a.width)], tensor_names)
    plans, metadata = _global_plans(all_plans, a, kept, hints), _metadata(a, order, by_name, per_name, boxes)
    return plans, metadata, (a, first, per_name, boxes)


def _gathered(column: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``column[at]``; where every row holds the same number, that number
    repeated without a copy (read-only)."""
    if len(column) and int(column.min()) == int(column.max()):
        return np.broadcast_to(column[:1], (len(at),))
    return column[at]


def _global_plans(all_plans: list[SavePlan], a: _All, kept: np.ndarray, hints: np.ndarray) -> list[SavePlan]:
    bounds = np.append(np.searchsorted(kept, a.base), len(kept)).tolist()
    out = []
    for r, (p, c) in enumerate(zip(all_plans, a.cols)):
        lo, hi = bounds[r], bounds[r + 1]
        h = hints[lo:hi]
        if hi - lo == len(c.kinds):
            new = _compact.WriteColumns(c.kinds, c.fqns, h, c.ndims, c.flat, c.table, c.props)
            out.append(dataclasses.replace(p, items=_compact.WriteItems.of_columns(new)))
            continue
        rows = kept[lo:hi] - int(a.base[r])  # the rank's items dedup moved to other ranks left out
        width = 3 * np.maximum(c.ndims.astype(np.int64), 0)
        if len(rows) and int(rows[-1]) - int(rows[0]) + 1 == len(rows):  # a run of items: slices
            r0, r1 = int(rows[0]), int(rows[-1]) + 1
            f0 = int(width[:r0].sum())
            f1 = f0 + int(width[r0:r1].sum())
            new = _compact.WriteColumns(c.kinds[r0:r1], c.fqns[r0:r1], h, c.ndims[r0:r1], c.flat[f0:f1],
                                        c.table, c.props[r0:r1])
        else:
            mask = np.zeros(len(c.kinds), dtype=bool)
            mask[rows] = True
            new = _compact.WriteColumns(c.kinds[rows], list(itertools.compress(c.fqns, mask.tolist())), h,
                                        c.ndims[rows], c.flat[np.repeat(mask, width)], c.table, c.props[rows])
        out.append(dataclasses.replace(p, items=_compact.WriteItems.of_columns(new)))
    return out


def _stable_order(values: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(values, kind="stable")`` for values in ``range(bound)``
    (a radix sort where they fit 16 bits)."""
    if bound <= 1 << 16:
        return np.argsort(values.astype(np.uint16), kind="stable")
    return np.argsort(values, kind="stable")


def _chunks(a: _All, tp: np.ndarray, lens: list[np.ndarray]) -> np.ndarray:
    """One ``ChunkStorageMetadata`` per tensor item ``tp`` (of sizes
    ``lens``, a column per dimension), as an object array; equal chunks
    share one (never mutated) object, as equal offsets and sizes share one
    ``torch.Size``."""
    columns = list(lens)
    nds = a.tnd[tp] if not a.uniform else None
    if nds is not None:
        columns.insert(0, nds)
    _, len_num = _row_numbers(columns, len(tp), rows=False)
    n_len = int(len_num.max()) + 1 if len(len_num) else 1
    off_num = a.off_num[tp]
    if float(a.n_off) * n_len < 2.0 ** 62:
        pair = off_num.astype(np.int64)
        pair *= n_len
        pair += len_num
        first, number = _numbered(pair, a.n_off * n_len)
    else:  # not one number per pair
        first, number = _row_numbers([off_num, len_num], len(tp))
    assert first is not None  # asked for
    made = np.empty(len(first), dtype=object)
    chunk, size_of = _items.chunk, torch.Size
    at = tp[first]
    made_nds = a.tnd[at].tolist() if nds is not None else [a.width] * len(first)
    made[:] = [chunk(size_of(o[:n]), size_of(s[:n]))
               for n, o, s in zip(made_nds, a.toff[at].tolist(), a.tlen[at].tolist())]
    return made[number]


def _metadata(a: _All, order: np.ndarray, by_name: np.ndarray, per_name: np.ndarray, boxes: tuple) -> Metadata:
    tp, _, lens, _ = boxes
    chunks = _chunks(a, tp, lens)
    first_at = np.cumsum(per_name) - per_name
    named = per_name > 0
    firsts = order[first_at[named]]
    names_in_order = np.flatnonzero(named)
    # Metadata keeps the keys in the order the plans first name them
    seen = np.argsort(by_name[first_at[named]], kind="stable")
    is_t = a.tensor[firsts]
    t_firsts = firsts[is_t]
    size_of = torch.Size
    sizes = [size_of(s[:n]) for s, n in zip(a.tsize[a.tidx(t_firsts)].tolist(), a.ndims[t_firsts].tolist())]
    table, at = a.properties(t_firsts)  # each tensor's: its first item's
    props = list(map(table.__getitem__, at.tolist()))
    # each tensor's chunks: consecutive in ``chunks``, per_name of them
    flat = chunks.tolist()
    counts = per_name[names_in_order[is_t]]
    if (counts == 1).all():
        grouped = list(map(list, zip(flat)))
    else:
        ends = np.cumsum(counts).tolist()
        grouped = [flat[e - n:e] for e, n in zip(ends, counts.tolist())]
    made = iter(map(TensorStorageMetadata, props, sizes, grouped))
    groups = {name: next(made) if tensor else BytesStorageMetadata()
              for name, tensor in zip(names_in_order.tolist(), is_t.tolist())}
    md = {a.names[name]: groups[name] for name in names_in_order[seen].tolist()}
    return Metadata(md)


def suspects(state: Any, n_plans: int) -> tuple[bool, list[str]]:
    """(whether validation certainly finds an error, keys whose chunks need
    DCP's overlap sweep), from the columns :func:`plan` returned: the
    checks of :func:`fp_dcp.planners._global.validate`."""
    from fp_dcp.coverage import separated

    a, first, per_name, (tp, offs, lens, names) = state  # tensor items, grouped by key, each in plan order
    counts = per_name[names]
    size = a.tsize[a.tidx(first[names])]  # each key's global size
    nd_key = a.ndims[first[names]].astype(np.int64)
    if not a.uniform and (a.tnd[tp] != np.repeat(nd_key, counts)).any():
        return True, []  # a chunk with more or fewer dimensions than its tensor
    some = nd_key > 0  # a 0-d tensor's chunks are not checked
    if not some.all():
        rows = np.repeat(some, counts)
        offs, lens = [o[rows] for o in offs], [n[rows] for n in lens]
        names, counts, size, nd_key = names[some], counts[some], size[some], nd_key[some]
    if not len(names):
        return False, []
    if any(int(c.min()) < 0 for c in offs + lens):
        return True, []
    ends = [o + n for o, n in zip(offs, lens)]
    starts = np.cumsum(counts) - counts
    if any((np.maximum.reduceat(e, starts) > size[:, d]).any() for d, e in enumerate(ends)):
        return True, []
    row_nd = None if a.uniform else np.repeat(nd_key, counts)
    if n_plans > 1:
        volume = np.ones(len(offs[0]), dtype=np.int64)
        tensor_volume = np.ones(len(names), dtype=np.int64)
        for d, n in enumerate(lens):
            volume *= n if row_nd is None else np.where(row_nd > d, n, 1)
            tensor_volume *= np.where(nd_key > d, size[:, d], 1)
        if (np.add.reduceat(volume, starts) != tensor_volume).any():
            return True, []
    multi = np.zeros(len(a.names), dtype=bool)
    multi[names[counts > 1]] = True
    if not multi.any():
        return False, []
    if row_nd is not None:  # a missing dimension separates nothing
        ends = [np.where(row_nd > d, e, 1) for d, e in enumerate(ends)]
    sep = separated(np.repeat(names, counts), offs, ends, multi)
    return False, [a.names[k] for k in np.flatnonzero(multi & ~sep).tolist()]
