"""Pure planning functions: where bytes go in files, which bytes a load needs.

Nothing here touches a disk or a process group; every function takes and
returns plain numbers so it can be tested with hypothesis.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from fp_dcp.format import CheckpointFormatError, Extent

__all__ = [
    "check_box",
    "item_file_ranges",
    "count_runs",
    "align_up",
    "place_extents",
    "box_runs",
    "map_runs_to_extents",
    "check_extents_cover",
]


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def place_extents(
    lengths: Sequence[int],
    alignment: int,
    pack_threshold: int,
    pack_alignment: int,
    start: int = 0,
) -> tuple[list[int], int]:
    """File offsets for extents of ``lengths`` bytes written in this order.

    An extent of at least ``pack_threshold`` bytes starts on an ``alignment``
    boundary (so it is written and read in place, without a bounce copy);
    smaller ones are packed back to back at ``pack_alignment`` (which keeps
    every element naturally aligned).  Returns the offsets and the end of the
    last extent (not padded).
    """
    offsets = []
    pos = start
    for n in lengths:
        pos = align_up(pos, alignment if n >= pack_threshold else pack_alignment)
        offsets.append(pos)
        pos += n
    return offsets, pos


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
    """Byte runs of a sub-box of a row-major chunk.

    The chunk has shape ``chunk_sizes``; the box starts at ``box_offsets`` and
    spans ``box_lengths``.  Returns ``(starts, run_length)``: the box's bytes
    are the runs ``[starts[i], starts[i] + run_length)`` of the chunk's byte
    image, in row-major order of the box (so run ``i`` lands at byte
    ``i * run_length`` of a contiguous tensor of the box's shape).  A dim-0
    slice is one run; a slice of the last dim is one run per row.
    """
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


def map_runs_to_extents(
    starts: np.ndarray, run_length: int, extents: Sequence[Extent]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split item-byte runs at extent boundaries.

    Returns four arrays over the resulting pieces: file number, file offset,
    length, and the piece's position in the packed destination (run ``i``
    lands at ``i * run_length``).  ``extents`` must be sorted by
    ``item_offset`` and cover the item (see :func:`check_extents_cover`).
    """
    if len(starts) == 0 or run_length == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    dest = np.arange(len(starts), dtype=np.int64) * run_length
    if len(extents) == 1:
        e = extents[0]
        n = len(starts)
        return (
            np.full(n, e.file, dtype=np.int64),
            starts - e.item_offset + e.file_offset,
            np.full(n, run_length, dtype=np.int64),
            dest,
        )
    ext_starts = np.array([e.item_offset for e in extents], dtype=np.int64)
    files, offs, lens, dests = [], [], [], []
    ends = starts + run_length
    first = np.searchsorted(ext_starts, starts, side="right") - 1
    last = np.searchsorted(ext_starts, ends - 1, side="right") - 1
    for i in range(len(starts)):
        s, t = int(starts[i]), int(ends[i])
        for j in range(int(first[i]), int(last[i]) + 1):
            e = extents[j]
            a = max(s, e.item_offset)
            b = min(t, e.item_offset + e.length)
            if b <= a:
                continue
            files.append(e.file)
            offs.append(e.file_offset + a - e.item_offset)
            lens.append(b - a)
            dests.append(int(dest[i]) + a - s)
    as_array = lambda v: np.array(v, dtype=np.int64)  # noqa: E731
    return as_array(files), as_array(offs), as_array(lens), as_array(dests)


def check_extents_cover(name: str, extents: Sequence[Extent], nbytes: int) -> None:
    """Raise unless ``extents`` (sorted by item_offset) tile ``[0, nbytes)`` exactly."""
    pos = 0
    for e in extents:
        if e.item_offset != pos:
            what = "overlap" if e.item_offset < pos else "a gap"
            raise CheckpointFormatError(
                f"{name}: the stored extents have {what} at byte {min(pos, e.item_offset)} "
                f"of {nbytes}; the checkpoint metadata is corrupt"
            )
        pos += e.length
    if pos != nbytes:
        raise CheckpointFormatError(
            f"{name}: the stored extents hold {pos} bytes, the item has {nbytes}; "
            f"the checkpoint metadata is corrupt"
        )


def item_file_ranges(metadata, storage_layout, items) -> np.ndarray:
    """``(file index, start, end)`` rows, sorted, of the stored bytes that DCP
    read items (``ReadItem``) need: each item's box of its stored chunk as row-major
    byte runs (:func:`box_runs`), mapped onto the chunk's extents.  What a
    reader that reads only the needed bytes must read; for benchmarks and
    tests that hold a reader to it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    pieces = []
    for req in items:
        exts = storage_layout.extents[MetadataIndex(req.storage_index.fqn, req.storage_index.offset)]
        tmd = metadata.state_dict_metadata[req.storage_index.fqn]
        if not hasattr(tmd, "chunks"):  # a bytes item: all of it
            starts, run = np.zeros(1, np.int64), sum(e.length for e in exts)
        else:
            chunk = next(c for c in tmd.chunks if req.storage_index.offset is None
                         or list(c.offsets) == list(req.storage_index.offset))
            esize = tmd.properties.dtype.itemsize
            starts, run = box_runs(list(chunk.sizes), list(req.storage_offsets), list(req.lengths), esize)
        f, o, n, _ = map_runs_to_extents(starts, run, exts)
        keep = n > 0
        pieces.append(np.stack([f[keep], o[keep], (o + n)[keep]], axis=1))
    if not pieces:
        return np.zeros((0, 3), np.int64)
    p = np.concatenate(pieces).astype(np.int64)
    return p[np.lexsort((p[:, 1], p[:, 0]))]


def count_runs(ranges: np.ndarray) -> int:
    """Maximal contiguous runs of sorted ``(file, start, end)`` rows (rows
    that touch or overlap are one run)."""
    if len(ranges) == 0:
        return 0
    p = ranges
    return 1 + int(np.sum((p[1:, 0] != p[:-1, 0]) | (p[1:, 1] > np.maximum.accumulate(p[:, 2])[:-1])))
