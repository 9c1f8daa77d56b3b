"""Pure planning of a save's file layout: where each item's bytes go in the
data files (:func:`place_extents`).
"""

from __future__ import annotations

from typing import Sequence

from fp_dcp.format import align_up, check_extents_cover

__all__ = [
    "align_up",
    "place_extents",
    "check_extents_cover",
]


def place_extents(
    lengths: Sequence[int],
    alignment: int,
    pack_threshold: int,
    pack_alignment: int,
    start: int = 0,
) -> tuple[list[int], int]:
    """File offsets for extents of ``lengths`` bytes, in order: extents of at
    least ``pack_threshold`` bytes start ``alignment``-aligned (written in
    place), smaller ones packed at ``pack_alignment``.  Returns the offsets and
    the end of the last extent (not padded)."""
    offsets = []
    pos = start
    for n in lengths:
        pos = align_up(pos, alignment if n >= pack_threshold else pack_alignment)
        offsets.append(pos)
        pos += n
    return offsets, pos


