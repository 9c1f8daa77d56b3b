"""Pure planning of a load's reads: which byte ranges of which files to read,
into which memory, and where the planner (not the engine) allows over-read.
Plain numbers and numpy arrays in and out; :mod:`fp_dcp.load.jobs` turns the
result into jobs."""

# The model.  A ReadItem needs a box of a stored row-major chunk and lands it in
# a box of a target tensor.  box_grid describes that as a grid of equal runs:
# byte ranges contiguous both in the stored chunk and in the target, laid out
# along a few outer dimensions with a source and a destination stride each
# (dimensions contiguous on both sides are merged, so a dim-0 slice is one run
# and a last-dim slice of a matrix is one run per row).
#
# A run is read straight into the target when it is large, or when the gaps
# between runs hold whole alignment blocks (reading them would cost disk
# bytes).  When the gaps are smaller than one alignment block, the blocks under
# a gap are read anyway, so free_merge_level lets whole sub-grids be read as
# one range into a bounded temporary and copied out with one strided copy: one
# request and one Python object per sub-grid instead of one per run.
#
# Across items, plan_fillers decides which gaps between the pieces of one
# engine call are read through (a filler piece into scratch memory): the free
# ones (no whole block in the gap, so the blocks are read anyway and the engine
# must not read them twice), then the cheapest paid ones while the over-read
# stays within a budget.  The engine is called with coalesce_gap=0, so it
# merges exactly the pieces the planner made contiguous.
#
# Cooperative reads.  When several ranks need interleaved parts of the same
# stored rows (a load that moves the sharded dimension: each rank needs a
# column band of every row), interleaved_slabs cuts the rows into slabs (dim-0
# ranges of the bounding box of what the ranks need: contiguous bytes), each
# read whole by one owner (assign_owners) and split into each rank's part;
# fp_dcp.load.sharing moves the parts between ranks.

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

__all__ = [
    "check_box",
    "box_runs",
    "Grid",
    "box_grid",
    "free_merge_level",
    "merge_level",
    "level_span",
    "unit_starts",
    "split_runs",
    "map_ranges",
    "plan_fillers",
    "split_box",
    "strides_non_overlapping",
    "CoopSlab",
    "interleaved_slabs",
    "assign_owners",
]

_I64 = np.int64


def check_box(chunk_sizes: Sequence[int], box_offsets: Sequence[int], box_lengths: Sequence[int]) -> int:
    """Raise ValueError unless the box lies inside the chunk; its rank."""
    ndim = len(chunk_sizes)
    if len(box_offsets) != ndim or len(box_lengths) != ndim:
        raise ValueError("box and chunk ranks differ")
    for o, n, s in zip(box_offsets, box_lengths, chunk_sizes):
        if o < 0 or n < 0 or o + n > s:
            raise ValueError(f"box {list(box_offsets)}+{list(box_lengths)} outside chunk {list(chunk_sizes)}")
    return ndim


def box_runs(
    chunk_sizes: Sequence[int],
    box_offsets: Sequence[int],
    box_lengths: Sequence[int],
    element_size: int,
) -> tuple[np.ndarray, int]:
    """Byte runs ``(starts, run_length)`` of the sub-box ``box_offsets`` +
    ``box_lengths`` of a row-major chunk of shape ``chunk_sizes``, in row-major
    order of the box (run ``i`` lands at byte ``i * run_length`` of it)."""
    ndim = check_box(chunk_sizes, box_offsets, box_lengths)
    if any(n == 0 for n in box_lengths):
        return np.zeros(0, dtype=np.int64), 0
    strides = [element_size] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * chunk_sizes[d + 1]
    # k: the outermost dim from which the box is a contiguous block of the chunk.
    k = ndim
    while k > 0 and box_lengths[k - 1] == chunk_sizes[k - 1]:
        k -= 1
    if k == 0:  # the whole chunk (or a 0-d tensor)
        return np.zeros(1, dtype=np.int64), math.prod(chunk_sizes) * element_size
    run_length = box_lengths[k - 1] * strides[k - 1]
    base = sum(o * s for o, s in zip(box_offsets, strides))
    starts = np.full(1, base, dtype=np.int64)
    for d in range(k - 1):
        starts = (starts[:, None] + np.arange(box_lengths[d], dtype=np.int64)[None, :] * strides[d]).reshape(-1)
    return starts, run_length


@dataclasses.dataclass(frozen=True)
class Grid:
    """Runs of ``run`` bytes at ``src_base + sum(i_d * src_strides[d])`` of the
    source and ``dst_base + sum(i_d * dst_strides[d])`` of the destination, for
    every index ``i`` of the outer dimensions ``counts`` (outermost first; each
    count > 1).  ``run == 0`` means the box is empty."""

    counts: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]
    run: int
    src_base: int = 0
    dst_base: int = 0

    @property
    def n_runs(self) -> int:
        return math.prod(self.counts) if self.run else 0

    @property
    def nbytes(self) -> int:
        return self.n_runs * self.run


def row_major_strides(sizes: Sequence[int], element_size: int) -> list[int]:
    strides = [element_size] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(int(sizes[d + 1]), 1)
    return strides


def box_grid(
    chunk_sizes: Sequence[int],
    box_offsets: Sequence[int],
    box_lengths: Sequence[int],
    element_size: int,
    dst_strides: Sequence[int] | None = None,
) -> Grid:
    """The run grid of a sub-box of a row-major chunk landing in a destination of
    strides ``dst_strides`` (elements; ``None``: packed).  Source offsets are
    bytes; destination offsets ``element_size``-scaled elements."""
    ndim = check_box(chunk_sizes, box_offsets, box_lengths)
    src = row_major_strides(chunk_sizes, element_size)
    if dst_strides is None:
        dst = row_major_strides(box_lengths, element_size)
    else:
        if len(dst_strides) != ndim:
            raise ValueError("destination strides and box ranks differ")
        dst = [int(s) * element_size for s in dst_strides]
    base = sum(int(o) * s for o, s in zip(box_offsets, src))
    if any(int(n) == 0 for n in box_lengths):
        return Grid((), (), (), 0, base, 0)
    dims = [(int(n), s, d) for n, s, d in zip(box_lengths, src, dst) if int(n) != 1]
    run = element_size
    while dims and dims[-1][1] == run and dims[-1][2] == run:
        run *= dims.pop()[0]
    merged: list[tuple[int, int, int]] = []
    for n, s, d in dims:
        if merged and merged[-1][1] == n * s and merged[-1][2] == n * d:
            merged[-1] = (merged[-1][0] * n, s, d)
        else:
            merged.append((n, s, d))
    return Grid(
        tuple(m[0] for m in merged), tuple(m[1] for m in merged), tuple(m[2] for m in merged), run, base, 0
    )


def level_span(grid: Grid, level: int) -> int:
    """Bytes of the source spanned by one sub-grid over dimensions
    ``level..`` (``level == len(counts)``: one run)."""
    span = grid.run
    for d in range(len(grid.counts) - 1, level - 1, -1):
        span += (grid.counts[d] - 1) * grid.src_strides[d]
    return span


def free_merge_level(grid: Grid, alignment: int, max_paid_fraction: float = 0.0) -> int:
    """The outermost level whose sub-grids' gaps are each shorter than one
    alignment block (or add at most ``max_paid_fraction`` of the needed bytes);
    ``len(counts)`` when none.  Needs a row-major source."""
    return merge_level(grid, alignment, max_paid_fraction)[0]


def merge_level(grid: Grid, alignment: int, max_paid_fraction: float = 0.0) -> tuple[int, int]:
    """:func:`free_merge_level` and the bytes of the paid gaps it reads
    through (gaps of a block or more), over the whole grid."""
    g = len(grid.counts)
    level = g
    span = needed = grid.run
    paid = 0
    for d in range(g - 1, -1, -1):
        gap = grid.src_strides[d] - span
        if gap < 0:
            break
        new_span = (grid.counts[d] - 1) * grid.src_strides[d] + span
        new_needed = grid.counts[d] * needed
        if gap >= alignment:
            if new_span - new_needed > max_paid_fraction * new_needed:
                break
            paid += gap * (grid.counts[d] - 1) * math.prod(grid.counts[:d])
        level, span, needed = d, new_span, new_needed
    return level, paid


def _outer_offsets(counts: Sequence[int], strides: Sequence[int], base: int) -> np.ndarray:
    out = np.full(1, base, dtype=_I64)
    for n, s in zip(counts, strides):
        out = (out[:, None] + np.arange(n, dtype=_I64)[None, :] * s).reshape(-1)
    return out


def unit_starts(grid: Grid, level: int, slab: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sub-grids over dimensions ``level..`` in row-major order: source starts,
    destination starts and indices of dimension ``level`` covered (at most
    ``slab`` with ``slab``)."""
    g = len(grid.counts)
    src = _outer_offsets(grid.counts[:level], grid.src_strides[:level], grid.src_base)
    dst = _outer_offsets(grid.counts[:level], grid.dst_strides[:level], grid.dst_base)
    if level == g:
        return src, dst, np.ones(len(src), dtype=_I64)
    n = grid.counts[level]
    step = n if slab is None else max(1, min(int(slab), n))
    firsts = np.arange(0, n, step, dtype=_I64)
    cnt = np.minimum(step, n - firsts)
    k = len(firsts)
    src = (src[:, None] + firsts[None, :] * grid.src_strides[level]).reshape(-1)
    dst = (dst[:, None] + firsts[None, :] * grid.dst_strides[level]).reshape(-1)
    return src, dst, np.tile(cnt, len(src) // k)


def split_runs(
    starts: np.ndarray, dests: np.ndarray, length: int, max_length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut runs of ``length`` bytes (at ``starts`` / ``dests``) into pieces of at
    most ``max_length`` bytes.  Returns starts, dests and lengths."""
    if length <= max_length or len(starts) == 0:
        return starts, dests, np.full(len(starts), length, dtype=_I64)
    k = -(-length // max_length)
    cuts = np.arange(k, dtype=_I64) * max_length
    lens = np.minimum(max_length, length - cuts)
    return (
        (starts[:, None] + cuts[None, :]).reshape(-1),
        (dests[:, None] + cuts[None, :]).reshape(-1),
        np.tile(lens, len(starts)),
    )


def map_ranges(
    starts: np.ndarray,
    lengths: np.ndarray,
    ext_item_offsets: np.ndarray,
    ext_lengths: np.ndarray,
    ext_files: np.ndarray,
    ext_file_offsets: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut byte ranges of an item (``[starts[i], starts[i] + lengths[i])``) at
    its extents' boundaries.  The extents must be sorted by item offset and
    tile the item.  Returns, per piece: the range it belongs to, its offset
    from that range's start, its file, its file offset and its length."""
    starts = np.asarray(starts, dtype=_I64)
    lengths = np.asarray(lengths, dtype=_I64)
    ext_item_offsets = np.asarray(ext_item_offsets, dtype=_I64)
    if len(ext_item_offsets) == 1 or len(starts) == 0:
        n = len(starts)
        delta = int(ext_file_offsets[0]) - int(ext_item_offsets[0]) if len(ext_item_offsets) else 0
        f = int(ext_files[0]) if len(ext_files) else 0
        return (
            np.arange(n, dtype=_I64),
            np.zeros(n, dtype=_I64),
            np.full(n, f, dtype=_I64),
            starts + delta,
            lengths,
        )
    ends = starts + lengths
    first = np.searchsorted(ext_item_offsets, starts, side="right") - 1
    last = np.searchsorted(ext_item_offsets, ends - 1, side="right") - 1
    count = last - first + 1
    rng = np.repeat(np.arange(len(starts), dtype=_I64), count)
    # position of each piece within its range's group of extents
    within = np.arange(len(rng), dtype=_I64) - np.repeat(np.cumsum(count) - count, count)
    j = first[rng] + within
    e_start = ext_item_offsets[j]
    e_end = e_start + np.asarray(ext_lengths, dtype=_I64)[j]
    a = np.maximum(starts[rng], e_start)
    b = np.minimum(ends[rng], e_end)
    return (rng, a - starts[rng], np.asarray(ext_files, dtype=_I64)[j],
            np.asarray(ext_file_offsets, dtype=_I64)[j] + (a - e_start), b - a)


def plan_fillers(
    files: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    alignment: int,
    budget_bytes: int,
    max_gap_bytes: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Gaps to read through, for pieces sorted by (file, offset): every gap with
    no whole aligned block, then others, cheapest first, within ``budget_bytes``
    and ``max_gap_bytes``.  Returns their files, offsets, lengths and paid bytes."""
    n = len(offsets)
    if n < 2:
        z = np.zeros(0, dtype=_I64)
        return z, z, z, 0
    files = np.asarray(files, dtype=_I64)
    offsets = np.asarray(offsets, dtype=_I64)
    ends = offsets + np.asarray(lengths, dtype=_I64)
    # running end of everything before, restarted at each file
    shift = files << 52
    prev_end = np.maximum.accumulate(ends + shift)[:-1] - shift[1:]
    same = files[1:] == files[:-1]
    nxt = offsets[1:]
    gap = nxt - prev_end
    valid = same & (gap > 0)
    a = alignment
    first_block = -(-prev_end // a) * a
    paid = (nxt // a) * a - first_block  # bytes of whole blocks inside the gap
    free = valid & (paid <= 0)
    cand = np.flatnonzero(valid & ~free & (gap <= max_gap_bytes))
    chosen = np.zeros(len(gap), dtype=bool)
    chosen[free] = True
    used = 0
    if len(cand) and budget_bytes > 0:
        order = cand[np.argsort(paid[cand], kind="stable")]
        total = np.cumsum(paid[order])
        k = int(np.searchsorted(total, budget_bytes, side="right"))
        chosen[order[:k]] = True
        used = int(total[k - 1]) if k else 0
    idx = np.flatnonzero(chosen)
    return files[1:][idx], prev_end[idx], gap[idx], used


def split_box(lengths: Sequence[int], element_size: int, max_bytes: int) -> list[tuple[list[int], list[int]]]:
    """Cut a box (``lengths``) into sub-boxes (offsets, lengths) of at most
    ``max_bytes`` each (a single element may exceed it), outermost dimension
    first, in row-major order."""
    lengths = [int(n) for n in lengths]
    total = math.prod(lengths) * element_size
    big = [i for i, n in enumerate(lengths) if n > 1]
    if total <= max_bytes or total == 0 or not big:
        return [([0] * len(lengths), lengths)]
    d = big[0]
    inner = math.prod(lengths[d + 1 :]) * element_size
    out = []
    if inner <= max_bytes:
        rows = max(1, max_bytes // inner)
        for r in range(0, lengths[d], rows):
            offs = [0] * len(lengths)
            offs[d] = r
            lens = list(lengths)
            lens[d] = min(rows, lengths[d] - r)
            out.append((offs, lens))
        return out
    sub = split_box(lengths[d + 1 :], element_size, max_bytes)
    for r in range(lengths[d]):
        for so, sl in sub:
            out.append(([0] * d + [r] + so, lengths[:d] + [1] + sl))
    return out


def strides_non_overlapping(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """True when no two indices of a tensor with these sizes and strides share
    an element (a sufficient check: sorted by stride, each stride clears the
    extent of the dimensions below it)."""
    dims = sorted((int(st), int(n)) for n, st in zip(sizes, strides) if int(n) > 1)
    extent = 1
    for st, n in dims:
        if st < extent:
            return False
        extent = st * (n - 1) + extent
    return all(int(st) >= 0 for st in strides)


# --------------------------------------------------------------------------
# cooperative (interleaved) reads


@dataclasses.dataclass(frozen=True)
class CoopSlab:
    """A box of a stored chunk (``offsets`` / ``lengths``: a dim-0 range of
    the bounding box of the boxes that need it) read by one rank, and the
    ``parts`` it holds: ``(box index, sub-box offsets, sub-box lengths)``, in
    chunk coordinates, each the intersection of the slab with one box."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    nbytes: int
    parts: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]


def interleaved_slabs(
    chunk_sizes: Sequence[int],
    element_size: int,
    boxes: Sequence[tuple[int, Sequence[int], Sequence[int]]],
    slab_bytes: int,
    *,
    run_max_bytes: int = 64 << 10,
    max_extra: float = 0.05,
) -> list[CoopSlab]:
    """Slabs that read the ``boxes`` (``(rank, offsets, lengths)``) of one stored
    chunk cooperatively, or ``[]`` when that does not pay.  Each dim-0 band's
    bounding box is cut into slabs of at most ``slab_bytes`` (whole rows); the
    parts tile every box exactly once."""
    ndim = len(chunk_sizes)
    live = [(i, r, tuple(int(x) for x in o), tuple(int(x) for x in n))
            for i, (r, o, n) in enumerate(boxes) if len(n) == ndim and all(int(x) > 0 for x in n)]
    if ndim < 2 or len({r for _, r, _, _ in live}) < 2:
        return []
    fragmented = False
    for _, _, o, n in live:
        g = box_grid(chunk_sizes, o, n, element_size)
        if g.counts and g.run < run_max_bytes:
            fragmented = True
            break
    if not fragmented:
        return []
    cuts = sorted({o[0] for _, _, o, _ in live} | {o[0] + n[0] for _, _, o, n in live})
    bands = []
    read = 0
    need = sum(math.prod(n) for _, _, _, n in live) * element_size
    for a, b in zip(cuts, cuts[1:]):
        active = [(i, o, n) for i, _, o, n in live if o[0] <= a and o[0] + n[0] >= b]
        if not active:
            continue
        lo = tuple(min(o[d] for _, o, _ in active) for d in range(1, ndim))
        hi = tuple(max(o[d] + n[d] for _, o, n in active) for d in range(1, ndim))
        row = math.prod(h - low for low, h in zip(lo, hi)) * element_size
        if row > slab_bytes:
            return []
        read += (b - a) * row
        bands.append((a, b, lo, hi, row, active))
    if read > (1 + max_extra) * need:
        return []
    slabs = []
    for a, b, lo, hi, row, active in bands:
        # at least one slab per rank that needs the band, so the owners can share it evenly
        ranks = len({boxes[i][0] for i, _, _ in active})
        step = max(1, min(slab_bytes // row, -(-(b - a) // ranks)))
        for s in range(a, b, step):
            n0 = min(step, b - s)
            parts = tuple((i, (s,) + o[1:], (n0,) + n[1:]) for i, o, n in active)
            slabs.append(CoopSlab((s,) + lo, (n0,) + tuple(h - low for low, h in zip(lo, hi)), n0 * row, parts))
    return slabs


def assign_owners(units: Sequence[tuple[int, Sequence[int]]], quota: dict[int, int]) -> list[int]:
    """Owners of ``units`` (``(bytes, candidate ranks)``), in order: each to the
    candidate with the most quota left (ties: the lower rank)."""
    left = dict(quota)
    owners = []
    for nbytes, cands in units:
        owner = max(cands, key=lambda r: (left.get(r, 0), -r))
        left[owner] = left.get(owner, 0) - nbytes
        owners.append(owner)
    return owners
