"""Reference implementations the tests and benchmarks hold the library to:
naive, obviously right, and slow.  Not part of the package.

* :func:`map_runs_to_extents`: a loop over runs and extents, the oracle of
  :func:`fp_dcp.load.plan.map_ranges`;
* :func:`item_file_ranges` / :func:`count_runs`: the stored bytes a load's
  read items need, and how many contiguous runs they make (what a reader that
  reads only the needed bytes must read).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fp_dcp.format import Extent
from fp_dcp.load.plan import box_runs

__all__ = ["map_runs_to_extents", "item_file_ranges", "count_runs"]


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
