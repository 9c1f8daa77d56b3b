"""Whether a tensor's stored chunks hold every element of it exactly once
(a reader checks it again: chunks that miss part of a tensor would load as
zeros).  :func:`fp_dcp.format.check_chunks_cover` raises the named error.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["uncovered", "all_covered", "overlap", "separated", "CheckTooLarge",
           "MAX_SWEPT_PAIRS"]

# The most pairs of chunks :func:`overlap` compares in its sweep (the layouts
# neither one dimension orders nor a grid holds); past it, it raises
# CheckTooLarge instead of running for minutes on a crafted checkpoint.
MAX_SWEPT_PAIRS = 1 << 26


class CheckTooLarge(ValueError):
    """Chunks whose overlap would take more than MAX_SWEPT_PAIRS comparisons to decide."""


def uncovered(size: Sequence[int], chunks: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """None when the ``(offsets, sizes)`` chunks, each inside a tensor of
    shape ``size``, cover it exactly; else what is wrong, in words."""
    total = math.prod(size)
    stored = sum(math.prod(n) for _, n in chunks)
    if stored == total:
        try:
            if not overlap(chunks):
                return None
        except CheckTooLarge as e:
            return f"{e}: refused rather than checked"
        return "chunks that overlap (some elements stored twice, others not at all)"
    return "no stored chunks" if not chunks else f"chunks holding {stored:,} of its {total:,} elements"


def overlap(chunks: Sequence[tuple[Sequence[int], Sequence[int]]]) -> bool:
    """Whether two of the (in-bounds) chunks share an element.

    Without comparing every pair (a tensor sharded over a thousand ranks has
    a thousand chunks, and every rank of a restart decodes every tensor's):
    chunks that one dimension orders (FSDP's shards, each ending before the
    next starts) are disjoint; so are chunks on a grid (on each dimension
    the distinct intervals are disjoint: a 2-d mesh's shards, even or not)
    unless two of them take the same interval on every dimension.  Other
    layouts are swept along the first dimension, each chunk compared with
    the later ones that start before it ends there: :class:`CheckTooLarge`
    where those are more than ``MAX_SWEPT_PAIRS`` pairs."""
    if len(chunks) < 2:
        return False
    starts = np.array([list(o) for o, _ in chunks], dtype=np.int64).reshape(len(chunks), -1)
    ends = starts + np.array([list(n) for _, n in chunks], dtype=np.int64).reshape(len(chunks), -1)
    keep = (ends > starts).all(axis=1)  # an empty chunk holds nothing
    starts, ends = starts[keep], ends[keep]
    n, ndim = starts.shape
    if n < 2:
        return False
    if ndim == 0:
        return True  # two chunks of a 0-d tensor both hold its one element
    if separated(np.zeros(n, dtype=np.int64), list(starts.T), list(ends.T), np.ones(1, dtype=bool))[0]:
        return False
    ids = np.empty((n, ndim), dtype=np.int64)
    for d in range(ndim):
        intervals, which = np.unique(np.stack([starts[:, d], ends[:, d]], axis=1), axis=0, return_inverse=True)
        if (intervals[:-1, 1] > intervals[1:, 0]).any():
            break  # two distinct intervals overlap on this dimension: not a grid
        ids[:, d] = which.reshape(-1)
    else:
        return len(np.unique(ids, axis=0)) < n
    order = np.lexsort(starts.T[::-1])  # by the first dimension, then the others
    starts, ends = starts[order], ends[order]
    # the chunks after each that start before it ends along the first dimension
    later = np.searchsorted(starts[:, 0], ends[:, 0], side="left") - np.arange(1, n + 1)
    pairs = int(later[later > 0].sum())
    if pairs > MAX_SWEPT_PAIRS:
        raise CheckTooLarge(f"{n:,} chunks that no dimension orders and no grid holds, {pairs:,} pairs of which "
                            f"share a band of the first dimension (more than {MAX_SWEPT_PAIRS:,} to compare)")
    for i in np.flatnonzero(later > 0).tolist():
        k = int(later[i])
        if ((starts[i] < ends[i + 1:i + 1 + k]) & (starts[i + 1:i + 1 + k] < ends[i])).all(axis=1).any():
            return True
    return False


def all_covered(ndim: np.ndarray, size: np.ndarray, counts: np.ndarray, offs: np.ndarray,
                lens: np.ndarray) -> bool:
    """:func:`uncovered` is None for every tensor, the tensors given as int64
    columns: each tensor's rank, every tensor's dimensions one after the
    other, each tensor's chunk count, and every chunk's offsets and sizes one
    after the other (each as many as its tensor's rank; every chunk inside
    its tensor and every tensor's element count within int64: the caller
    checked).  The tensors one dimension orders the chunks of are told apart
    for all tensors of a rank (number of dimensions) at once; only the others
    are checked one by one."""
    n = len(ndim)
    rank = np.repeat(ndim, counts)  # each chunk's
    owner = np.repeat(np.arange(n), counts)
    totals = _products(size, ndim)
    volumes = _products(lens, rank)
    # a sum of volumes past int64 (chunks stored many times over) is seen in float first
    rough = np.zeros(n)
    np.add.at(rough, owner, volumes.astype(np.float64))
    if (rough > totals * 1.000001 + 1).any():
        return False
    stored = np.zeros(n, dtype=np.int64)
    np.add.at(stored, owner, volumes)
    if (stored != totals).any():
        return False
    first = np.cumsum(rank) - rank  # each chunk's first value
    left: list[int] = []
    for k in np.unique(ndim[counts > 1]).tolist():
        multi = (counts > 1) & (ndim == k)
        rows = np.flatnonzero(multi[owner])
        if k == 0:
            left.extend(np.flatnonzero(multi).tolist())
            continue
        at = first[rows][:, None] + np.arange(k)
        starts, ends = offs[at], offs[at] + lens[at]
        done = separated(owner[rows], list(starts.T), list(ends.T), multi)
        left.extend(np.flatnonzero(~done).tolist())
    chunk_at = (np.cumsum(counts) - counts).tolist()
    for t in left:
        a, b = int(first[chunk_at[t]]), int(first[chunk_at[t]] + counts[t] * ndim[t])
        k = int(ndim[t])
        starts, sizes = offs[a:b].tolist(), lens[a:b].tolist()
        chunks = [(starts[i:i + k], sizes[i:i + k]) for i in range(0, b - a, k)] if k else [((), ())] * int(counts[t])
        try:
            if overlap(chunks):
                return False
        except CheckTooLarge:
            return False  # the caller's per-tensor check names it
    return True


def _products(values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The product of each run of ``widths[i]`` values (1 for an empty run)."""
    out = np.ones(len(widths), dtype=np.int64)
    some = widths > 0
    if some.any():
        out[some] = np.multiply.reduceat(values, (np.cumsum(widths) - widths)[some])
    return out


def _disjoint_in_order(kid: np.ndarray, start: np.ndarray, end: np.ndarray, n_keys: int) -> np.ndarray:
    """Per key: whether its chunks, in the given order, each end before the
    next starts (along one dimension)."""
    bad = (kid[1:] == kid[:-1]) & (start[1:] < end[:-1])
    clash = np.zeros(n_keys, dtype=bool)
    clash[kid[1:][bad]] = True
    return ~clash


def separated(kid: np.ndarray, off: list[np.ndarray], end: list[np.ndarray], multi: np.ndarray) -> np.ndarray:
    """Per key: whether some dimension separates its chunks (sorted along
    it, each ends before the next starts), so that no two can overlap.
    ``off``, ``end``: a column per dimension.  The chunks' own order is
    tried first (a tensor's shards are usually saved in order); only the
    keys it does not settle are sorted."""
    n_keys = len(multi)
    done = ~multi
    for o, e in zip(off, end):
        if done.all():
            return done
        done |= _disjoint_in_order(kid, o, e, n_keys)
    for o, e in zip(off, end):
        if done.all():
            break
        rows = np.flatnonzero(~done[kid])
        k, o_r, e_r = kid[rows], o[rows], e[rows]
        order = np.lexsort((o_r, k))
        done |= _disjoint_in_order(k[order], o_r[order], e_r[order], n_keys)
    return done
