"""The load planner's table of every extent (fp_dcp.load.jobs.ExtentTable):
the same columns an item's own extents give, and a layout whose extents do
not tile an item refused with the error naming it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex

from fp_dcp import format as fmt
from fp_dcp.format import Extent
from fp_dcp.load.jobs import ExtentTable, ItemPlanner


@st.composite
def layouts(draw):
    """Items of 0-5 extents each, cut at random points, in random files."""
    extents = {}
    for i in range(draw(st.integers(0, 12))):
        total = draw(st.integers(0, 5000))
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, total - 1)), max_size=4)))) if total > 1 else []
        bounds = [0] + cuts + [total] if total else []
        key = MetadataIndex(f"t{i}", None if i % 3 else [i, 0])
        extents[key] = [
            Extent(draw(st.integers(0, 3)), draw(st.integers(0, 1 << 40)), a, b - a)
            for a, b in zip(bounds, bounds[1:])
        ]
    return extents


@given(layouts())
@settings(max_examples=200, deadline=None)
def test_the_table_gives_each_items_extents_as_columns(extents):
    table = ExtentTable(extents)
    for key, exts in extents.items():
        total = sum(e.length for e in exts)
        got = table.get(key, total)
        assert got is not None
        want = [[e.item_offset for e in exts], [e.length for e in exts], [e.file for e in exts],
                [e.file_offset for e in exts]]
        for column, values in zip(got, want):
            assert column.dtype == np.int64 and column.tolist() == values
        assert table.get(key, total + 1) is None  # another size: not this item's tiling
    assert table.get(MetadataIndex("absent", None), 0) is None


@pytest.mark.parametrize(
    "exts, nbytes, message",
    [
        ([Extent(0, 0, 0, 10), Extent(0, 64, 12, 4)], 16, "a gap at byte 10"),
        ([Extent(0, 0, 0, 10), Extent(0, 64, 8, 8)], 16, "overlap at byte 8"),
        ([Extent(0, 0, 2, 14)], 16, "a gap at byte 0"),
        ([Extent(0, 0, 0, 10)], 16, "hold 10 bytes, the item has 16"),
        ([], 16, "hold 0 bytes, the item has 16"),
    ],
)
def test_extents_that_do_not_tile_an_item_are_refused_naming_it(exts, nbytes, message):
    """Each item's tiling is checked for all items at once; a bad one still
    gets check_extents_cover's error, naming the tensor, when it is planned
    (and the good items beside it plan as before)."""
    good = MetadataIndex("good", None)
    layout = SimpleNamespace(extents={MetadataIndex("bad.weight", None): exts, good: [Extent(1, 0, 0, 8)]})
    planner = ItemPlanner(layout, {}, "ckpt", strict_dtype=False, allow_pickle=False)
    assert [c.tolist() for c in planner.extents("good", None, 8)] == [[0], [8], [1], [0]]
    with pytest.raises(fmt.CheckpointFormatError, match=f"bad.weight: .*{message}"):
        planner.extents("bad.weight", None, nbytes)
    with pytest.raises(fmt.CheckpointFormatError, match="no stored bytes for missing"):
        planner.extents("missing", None, 8)


def test_an_empty_item_has_empty_columns():
    table = ExtentTable({MetadataIndex("e", None): [], MetadataIndex("f", None): [Extent(0, 0, 0, 0)]})
    assert [c.size for c in table.get(MetadataIndex("e", None), 0)] == [0, 0, 0, 0]
    assert [c.tolist() for c in table.get(MetadataIndex("f", None), 0)] == [[0], [0], [0], [0]]
    assert ExtentTable({}).get(MetadataIndex("e", None), 0) is None
