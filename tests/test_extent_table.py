"""The load planner's table of every extent (fp_dcp.load.jobs.ExtentTable):
the same columns an item's own extents give, and a layout whose extents do
not tile an item refused with the error naming it."""

from __future__ import annotations

import pickle
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


def columns_of(extents) -> fmt.ExtentColumns:
    """``extents`` (a dict) as the decoder keeps a checkpoint's: columns."""
    keys = [(k.fqn, None if k.offset is None else tuple(k.offset)) for k in extents]
    rows = [e for exts in extents.values() for e in exts]
    counts = np.array([len(v) for v in extents.values()], dtype=np.int64)
    cols = (np.array([getattr(e, f) for e in rows], dtype=np.int64).reshape(-1)
            for f in ("file", "file_offset", "item_offset", "length"))
    return fmt.ExtentColumns(keys, counts, *cols, [e.crc32c for e in rows])


@given(layouts())
@settings(max_examples=100, deadline=None)
def test_a_decoded_layouts_columns_make_the_same_table(extents):
    """ExtentTable takes a decoded layout's columns as they are: the same
    columns and byte counts as from the dict of Extent lists, which the
    columns also are to any other reader (pickled as columns)."""
    columns = columns_of(extents)
    assert columns == extents and list(columns) == list(extents) and len(columns) == len(extents)
    again = pickle.loads(pickle.dumps(columns))
    assert again._dict is None and again == extents
    from_dict, from_columns = ExtentTable(extents), ExtentTable(columns_of(extents))
    for key, exts in extents.items():
        total = sum(e.length for e in exts)
        assert from_columns.nbytes(key) == from_dict.nbytes(key) == total
        got, want = from_columns.get(key, total), from_dict.get(key, total)
        assert [c.tolist() for c in got] == [c.tolist() for c in want]
    assert from_columns.nbytes(MetadataIndex("absent", None)) is None


def test_a_table_knows_an_items_bytes_only_where_its_extents_tile_it():
    key = MetadataIndex("bad", None)
    for extents in ({key: [Extent(0, 0, 2, 14)]}, {key: [Extent(0, 0, 0, 10), Extent(0, 64, 12, 4)]}):
        assert ExtentTable(extents).nbytes(key) is None
        assert ExtentTable(columns_of(extents)).nbytes(key) is None
    assert ExtentTable({key: []}).nbytes(key) == 0
