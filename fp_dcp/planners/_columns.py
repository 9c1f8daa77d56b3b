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

__all__ = ["plan"]

_W_KINDS = list(WriteItemType)
TABLE_CELLS = 1 << 22  # the most shared keys x ranks the dedup counts in one table
_SHARD, _BYTE_IO = _W_KINDS.index(WriteItemType.SHARD), _W_KINDS.index(WriteItemType.BYTE_IO)


class _All:
    """Every plan's columns, concatenated (one row per item)."""

    def __init__(self, cols: list[_compact.WriteColumns]) -> None:
        self.cols = cols
        self.counts = np.array([len(c.kinds) for c in cols], dtype=np.int64)
        self.rank = np.repeat(np.arange(len(cols), dtype=np.int64), self.counts)
        self.kinds = np.concatenate([c.kinds for c in cols]).astype(np.int64)
        self.ndims = np.concatenate([c.ndims for c in cols])
        self.fid = self._name_ids(cols)
        self.width = max(int(self.ndims.max()) if len(self.ndims) else 0, 0)
        self.off_num, self.n_off = np.zeros(0, dtype=np.int64), 1  # numbered by _keys
        n = len(self.kinds)
        # per item: offsets, sizes and global size, padded with zeros
        self.off, self.len, self.size = (np.zeros((n, self.width), dtype=np.int64) for _ in range(3))
        flat = np.concatenate([c.flat for c in cols])
        present = np.bincount(np.maximum(self.ndims, 0), minlength=1)
        present[0] = 0
        for nd in np.flatnonzero(present).tolist():
            r = np.flatnonzero(self.ndims == nd)
            if len(r) == int(np.count_nonzero(self.ndims > 0)):  # one kind of tensor: flat is its rows
                block = flat.reshape(-1, 3 * nd)
            else:
                flat_base = np.cumsum([len(c.flat) for c in cols]) - np.array([len(c.flat) for c in cols])
                starts = np.concatenate([c.starts + b for c, b in zip(cols, flat_base.tolist())])
                block = flat[starts[r][:, None] + np.arange(3 * nd)]
            self.off[r, :nd] = block[:, :nd]
            self.len[r, :nd] = block[:, nd:2 * nd]
            self.size[r, :nd] = block[:, 2 * nd:]
        itemsizes = [np.array([p.dtype.itemsize for p in c.table] or [0], dtype=np.int64) for c in cols]
        self.itemsize = np.concatenate([s[c.props.clip(0)] for s, c in zip(itemsizes, cols)]) if n else \
            np.zeros(0, dtype=np.int64)

    def _name_ids(self, cols: list[_compact.WriteColumns]) -> np.ndarray:
        """Per item: the number of its fqn, numbered in the order first seen
        (``self.names``).  A plan naming the same keys as the one before it
        (every rank of a sharded model) reuses its numbers."""
        ids: dict[str, int] = {}
        out: list[np.ndarray] = []
        last_fqns: Any = None
        last = np.zeros(0, dtype=np.int64)
        for c in cols:
            if c.fqns != last_fqns:
                fresh = [f for f in dict.fromkeys(c.fqns) if f not in ids]
                ids.update(zip(fresh, range(len(ids), len(ids) + len(fresh))))
                last = np.fromiter(map(ids.__getitem__, c.fqns), dtype=np.int64, count=len(c.fqns))
                last_fqns = c.fqns
            out.append(last)
        self.names = list(ids)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _row_numbers(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(one row of each distinct row, each row's number among them)."""
    if not len(rows):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    lo, hi = rows.min(axis=0), rows.max(axis=0)
    span = [int(high) - int(low) + 1 for low, high in zip(lo.tolist(), hi.tolist())]
    if np.prod(np.array(span, dtype=float)) >= 2.0 ** 62:  # not one number per row
        _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
        return first, inverse.reshape(-1)
    code = np.zeros(len(rows), dtype=np.int64)
    for d, n in enumerate(span):
        code = code * n + (rows[:, d] - lo[d])
    return _numbered(code, int(np.prod(np.array(span, dtype=object))))


def _keys(a: _All) -> np.ndarray:
    """Per item: the number of its (fqn, offset) key (its offsets' number
    kept in ``a.off_num``, ``a.n_off`` of them)."""
    _, off_num = _row_numbers(np.concatenate([a.ndims[:, None], a.off], axis=1))
    n_off = int(off_num.max()) + 1 if len(off_num) else 1
    a.off_num, a.n_off = off_num, n_off
    return _numbered(a.fid * n_off + off_num, len(a.names) * n_off)[1]


def _weights(a: _All, at: Any) -> np.ndarray:
    """DCP's dedup weight of the items ``at``: their tensor's bytes, or 1."""
    dims = np.arange(a.width) < a.ndims[at, None]
    weight = np.maximum(np.prod(np.where(dims, a.size[at], 1), axis=1) * a.itemsize[at], 1)
    weight[a.kinds[at] == _BYTE_IO] = 1
    return weight


def _dedup(a: _All, key: np.ndarray, lowest: bool) -> np.ndarray | None:
    """``dedup_save_plans`` as a mask of the items kept; None where a key is
    twice in one plan."""
    keep = np.ones(len(key), dtype=bool)
    holders = np.bincount(key)
    shared = holders[key] > 1
    rows = np.flatnonzero(shared)
    if not len(rows):
        return keep
    rows = rows[np.argsort(key[rows], kind="stable")]  # each shared key's items, in plan order
    ks, rs = key[rows], a.rank[rows]
    if ((ks[1:] == ks[:-1]) & (rs[1:] == rs[:-1])).any():
        return None
    reps = np.flatnonzero(holders > 1)
    ends = np.cumsum(holders[reps])
    starts = ends - holders[reps]
    rep_weight = _weights(a, rows[ends - 1]).tolist()  # DCP weighs a shared key by its last item
    firsts = rows[starts]  # each shared key's first item
    # only the items before the last shared key's first one count towards a choice
    limit = int(firsts.max()) + 1
    weight = _weights(a, slice(0, limit))
    shared = shared[:limit]
    visit = np.argsort(firsts, kind="stable")  # DCP visits keys in the order first seen
    # the bytes of the one-rank items each rank holds before each shared key's first item
    lone_w = np.where(shared, 0, weight)
    lone_before = None
    if len(reps) * len(a.cols) <= TABLE_CELLS:  # one row per shared key, one column per rank
        cum = np.concatenate([[0], np.cumsum(lone_w)])
        base = np.cumsum(a.counts) - a.counts
        at = np.minimum(np.clip(firsts[:, None], base, base + a.counts), limit)
        lone_before = cum[at] - cum[np.minimum(base, limit)]
    held = a.rank[rows].tolist()
    starts_l, ends_l, firsts_l = starts.tolist(), ends.tolist(), firsts.tolist()
    assigned = [0] * len(a.cols)
    sel_of = np.empty(len(reps), dtype=np.int64)
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
    keep[rows] = a.rank[rows] == np.repeat(sel_of, holders[reps])
    return keep


def plan(all_plans: list[SavePlan], lowest: bool) -> tuple[list[SavePlan], Metadata, Any] | None:
    """(global plans, Metadata, per-item columns for validation) as DCP's
    dedup and default global plan make them, or None."""
    maybe = [p.items.columns() if type(p.items) is _compact.WriteItems else None for p in all_plans]
    cols = [c for c in maybe if c is not None]
    if not cols or len(cols) != len(maybe):
        return None
    a = _All(cols)
    tensor = a.ndims >= 0
    if ((a.kinds == _BYTE_IO) == tensor).any():  # bytes with tensor data, or a tensor without
        return None
    keep = _dedup(a, _keys(a), lowest)
    if keep is None:
        return None
    kept = np.flatnonzero(keep)
    fid = a.fid[kept]
    n_names = len(a.names)
    per_name = np.bincount(fid, minlength=n_names)
    lone = np.zeros(n_names, dtype=bool)
    lone[fid[a.kinds[kept] != _SHARD]] = True
    if (lone & (per_name > 1)).any():  # DCP's global plan refuses it
        return None
    # index hints: each tensor item's place among its tensor's chunks
    by_name = _stable_order(fid, n_names)
    ends = np.cumsum(per_name)
    place = np.empty(len(kept), dtype=np.int64)
    place[by_name] = np.arange(len(kept)) - np.repeat(ends - per_name, per_name)
    hints = np.concatenate([c.hints for c in cols])[kept]
    tensor_kept = tensor[kept]
    hints[tensor_kept] = place[tensor_kept]
    first = np.full(n_names, -1, dtype=np.int64)
    named = per_name > 0
    first[named] = kept[by_name[(ends - per_name)[named]]]  # each key's first kept item
    order = kept[by_name]  # the kept items, grouped by tensor, each group in plan order
    tens = order[a.ndims[order] >= 0]
    boxes = (tens, a.off[tens], a.len[tens])  # the tensor items' chunks, gathered once for both
    plans, metadata = _global_plans(all_plans, a, kept, hints), _metadata(a, order, by_name, per_name, boxes)
    return plans, metadata, (a, first, boxes)


def _global_plans(all_plans: list[SavePlan], a: _All, kept: np.ndarray, hints: np.ndarray) -> list[SavePlan]:
    bounds = np.searchsorted(kept, np.cumsum(a.counts) - a.counts)
    bounds = np.append(bounds, len(kept))
    base = np.cumsum(a.counts) - a.counts
    out = []
    for r, (p, c) in enumerate(zip(all_plans, a.cols)):
        rows = kept[bounds[r]:bounds[r + 1]] - base[r]
        if len(rows) == len(c.kinds):
            flat = c.flat
            fqns = c.fqns
        else:  # the rank's items dedup moved to other ranks left out
            mask = np.zeros(len(c.kinds), dtype=bool)
            mask[rows] = True
            flat = c.flat[np.repeat(mask, 3 * np.maximum(c.ndims, 0))]
            fqns = list(itertools.compress(c.fqns, mask.tolist()))
        new = _compact.WriteColumns(c.kinds[rows], fqns, hints[bounds[r]:bounds[r + 1]], c.ndims[rows], flat,
                                    c.table, c.props[rows])
        out.append(dataclasses.replace(p, items=_compact.WriteItems.of_columns(new)))
    return out


def _stable_order(values: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(values, kind="stable")`` for values in ``range(bound)``
    (a radix sort where they fit 16 bits)."""
    if bound <= 1 << 16:
        return np.argsort(values.astype(np.uint16), kind="stable")
    return np.argsort(values, kind="stable")


def _numbered(code: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """(a row holding each distinct value of ``code``, in value order; each
    row's number among them) for codes in ``range(span)``."""
    if span <= 4 * len(code) + 1024:  # a table, not a sort
        seen = np.zeros(span, dtype=bool)
        seen[code] = True
        present = np.flatnonzero(seen)
        number = np.empty(span, dtype=np.int64)
        number[present] = np.arange(len(present))
        number = number[code]
    else:
        present, number = np.unique(code, return_inverse=True)
        number = number.reshape(-1)
    some = np.empty(len(present), dtype=np.int64)
    some[number] = np.arange(len(code))  # any row of each value will do
    return some, number


def _chunks(nds: np.ndarray, off: np.ndarray, ln: np.ndarray, off_num: np.ndarray, n_off: int) -> np.ndarray:
    """One ``ChunkStorageMetadata`` per row, as an object array; equal rows
    share one (never mutated) object, as equal offsets and sizes share one
    ``torch.Size``.  ``off_num``: each row's number of (ndim, offsets), of
    ``n_off``."""
    _, len_num = _row_numbers(np.concatenate([nds[:, None], ln], axis=1))
    n_len = int(len_num.max()) + 1 if len(len_num) else 1
    if float(n_off) * n_len < 2.0 ** 62:
        first, number = _numbered(off_num * n_len + len_num, n_off * n_len)
    else:  # not one number per pair
        first, number = _row_numbers(np.stack([off_num, len_num], axis=1))
    made = np.empty(len(first), dtype=object)
    chunk, size_of = _items.chunk, torch.Size
    made[:] = [chunk(size_of(o[:n]), size_of(s[:n]))
               for n, o, s in zip(nds[first].tolist(), off[first].tolist(), ln[first].tolist())]
    return made[number]


def _metadata(a: _All, order: np.ndarray, by_name: np.ndarray, per_name: np.ndarray, boxes: tuple) -> Metadata:
    tens, off, ln = boxes
    chunks = _chunks(a.ndims[tens], off, ln, a.off_num[tens], a.n_off)
    first_at = np.cumsum(per_name) - per_name
    firsts = order[first_at[per_name > 0]]
    names_in_order = np.flatnonzero(per_name > 0)
    # Metadata keeps the keys in the order the plans first name them
    seen = np.argsort(by_name[first_at[per_name > 0]], kind="stable")
    groups: dict[int, Any] = {}
    base = np.cumsum(a.counts) - a.counts
    pos = 0
    for name, first in zip(names_in_order.tolist(), firsts.tolist()):
        count = int(per_name[name])
        if a.ndims[first] < 0:
            groups[name] = BytesStorageMetadata()
        else:
            c = a.cols[int(a.rank[first])]
            local = first - int(base[a.rank[first]])
            nd = int(a.ndims[first])
            groups[name] = TensorStorageMetadata(properties=c.table[int(c.props[local])],
                                                 size=torch.Size(a.size[first, :nd].tolist()),
                                                 chunks=chunks[pos:pos + count].tolist())
            pos += count
    md = {a.names[name]: groups[name] for name in names_in_order[seen].tolist()}
    return Metadata(md)


def suspects(state: Any, n_plans: int) -> tuple[bool, list[str]]:
    """(whether validation certainly finds an error, keys whose chunks need
    DCP's overlap sweep), from the columns :func:`plan` returned: the
    checks of :func:`fp_dcp.planners._global.validate`."""
    from fp_dcp.planners._global import _separated

    a, first, (t, off, ln) = state  # tensor items, grouped by key, each group in plan order
    if not len(t):
        return False, []
    kid = a.fid[t]
    nd_md = a.ndims[first[kid]]
    if (a.ndims[t] != nd_md).any():  # a chunk with more or fewer dimensions than its tensor
        return True, []
    some = nd_md > 0
    if not some.all():
        t, kid, off, ln = t[some], kid[some], off[some], ln[some]
    nd = nd_md[some] if not some.all() else nd_md
    if not len(t):
        return False, []
    size = a.size[first[kid]]
    end = off + ln
    if (off < 0).any() or (ln < 0).any() or (end > size).any():
        return True, []
    starts = np.flatnonzero(np.r_[True, kid[1:] != kid[:-1]])
    counts = np.diff(np.r_[starts, len(kid)])
    if n_plans > 1:
        pad = np.arange(a.width) >= nd[:, None]
        volume = np.add.reduceat(np.prod(np.where(pad, 1, ln), axis=1), starts)
        tensor_volume = np.prod(np.where(pad, 1, size), axis=1)[starts]
        if (volume != tensor_volume).any():
            return True, []
    multi = np.zeros(len(a.names), dtype=bool)
    multi[kid[starts[counts > 1]]] = True
    if not multi.any():
        return False, []
    end = np.where(np.arange(a.width) >= nd[:, None], 1, end)  # a missing dimension separates nothing
    sep = _separated(kid, off, end, multi)
    return False, [a.names[k] for k in np.flatnonzero(multi & ~sep).tolist()]
