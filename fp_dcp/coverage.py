"""Whether a tensor's stored chunks hold every element of it exactly once
(a reader checks it again: chunks that miss part of a tensor would load as
zeros).  :func:`fp_dcp.format.check_chunks_cover` raises the named error.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["uncovered", "all_covered", "overlap"]


def uncovered(size: Sequence[int], chunks: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """None when the ``(offsets, sizes)`` chunks, each inside a tensor of
    shape ``size``, cover it exactly; else what is wrong, in words."""
    total = math.prod(size)
    stored = sum(math.prod(n) for _, n in chunks)
    if stored == total and not overlap(chunks):
        return None
    if stored == total:
        return "chunks that overlap (some elements stored twice, others not at all)"
    return "no stored chunks" if not chunks else f"chunks holding {stored:,} of its {total:,} elements"


def overlap(chunks: Sequence[tuple[Sequence[int], Sequence[int]]]) -> bool:
    """Whether two of the (in-bounds) chunks share an element."""
    if len(chunks) < 2:
        return False
    starts = np.array([list(o) for o, _ in chunks], dtype=np.int64).reshape(len(chunks), -1)
    ends = starts + np.array([list(n) for _, n in chunks], dtype=np.int64).reshape(len(chunks), -1)
    keep = (ends > starts).all(axis=1)  # an empty chunk holds nothing
    starts, ends = starts[keep], ends[keep]
    for i in range(len(starts) - 1):  # chunk i against every later one, all dimensions at once
        if ((starts[i] < ends[i + 1:]) & (starts[i + 1:] < ends[i])).all(axis=1).any():
            return True
    return False


def all_covered(sizes: list[list[int]], offs: list[list[int]], lens: list[list[int]], counts: list[int]) -> bool:
    """:func:`uncovered` is None for every tensor (shape ``sizes[t]``, its
    ``counts[t]`` chunks next in ``offs``/``lens``)."""
    totals = list(map(math.prod, sizes))
    volumes = list(map(math.prod, lens))
    if all(count == 1 for count in counts):
        return volumes == totals
    at = 0
    for total, count in zip(totals, counts):
        chunk = slice(at, at + count)
        at += count
        if sum(volumes[chunk]) != total or (count > 1 and overlap(list(zip(offs[chunk], lens[chunk])))):
            return False
    return True
