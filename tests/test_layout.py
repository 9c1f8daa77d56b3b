"""Property tests of the pure planning functions (no disk)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp_dcp.format import CheckpointFormatError, Extent
from fp_dcp.load.plan import box_runs
from fp_dcp.save.layout import align_up, check_extents_cover, place_extents
from tests._oracles import map_runs_to_extents


@given(
    st.lists(st.integers(0, 1 << 20), max_size=40),
    st.sampled_from([512, 4096]),
    st.integers(0, 1 << 19),
    st.sampled_from([1, 16, 64]),
)
def test_place_extents_aligned_large_packed_small_no_overlap(lengths, align, threshold, pack):
    offsets, end = place_extents(lengths, align, threshold, pack)
    pos = 0
    for n, off in zip(lengths, offsets):
        assert off >= pos
        assert off % (align if n >= threshold else pack) == 0
        # packing wastes less than one alignment unit per extent
        assert off - pos < (align if n >= threshold else pack)
        pos = off + n
    assert end == pos


@st.composite
def boxes(draw):
    ndim = draw(st.integers(0, 4))
    sizes = [draw(st.integers(0, 6)) for _ in range(ndim)]
    offs, lens = [], []
    for s in sizes:
        o = draw(st.integers(0, s))
        offs.append(o)
        lens.append(draw(st.integers(0, s - o)))
    return sizes, offs, lens, draw(st.sampled_from([1, 2, 4, 8]))


@given(boxes())
@settings(max_examples=300)
def test_box_runs_match_numpy_slicing(box):
    sizes, offs, lens, esize = box
    n = int(np.prod(sizes, dtype=np.int64))
    chunk = np.arange(n * esize, dtype=np.int64).reshape(sizes + [esize]) if sizes else np.arange(esize)
    sl = tuple(slice(o, o + k) for o, k in zip(offs, lens))
    expected = chunk[sl].reshape(-1)
    starts, run = box_runs(sizes, offs, lens, esize)
    got = np.concatenate([np.arange(s, s + run) for s in starts]) if len(starts) else np.zeros(0, np.int64)
    np.testing.assert_array_equal(got, expected)


def test_box_runs_dim0_slice_is_one_run_last_dim_slice_is_one_per_row():
    starts, run = box_runs([8, 16], [2, 0], [3, 16], 4)
    assert starts.tolist() == [2 * 16 * 4] and run == 3 * 16 * 4
    starts, run = box_runs([8, 16], [0, 8], [8, 8], 4)
    assert starts.tolist() == [r * 64 + 32 for r in range(8)] and run == 32


@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=6),
    st.data(),
)
def test_map_runs_to_extents_reassembles_the_item(ext_lengths, data):
    total = sum(ext_lengths)
    item = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    # the item's extents scattered into a "file" at shuffled offsets
    file = np.zeros(4 * total + 64, dtype=np.uint8)
    extents, pos, at = [], 0, 7
    for n in ext_lengths:
        extents.append(Extent(0, at, pos, n))
        file[at : at + n] = item[pos : pos + n]
        pos += n
        at += n + data.draw(st.integers(0, 9))
    run = data.draw(st.integers(1, total))
    starts = np.array(sorted(data.draw(st.lists(st.integers(0, total - run), min_size=1, max_size=5))), np.int64)
    files, offs, lens, dests = map_runs_to_extents(starts, run, extents)
    out = np.zeros(len(starts) * run, dtype=np.uint8)
    for f, o, n, d in zip(files, offs, lens, dests):
        assert f == 0
        out[d : d + n] = file[o : o + n]
    expected = np.concatenate([item[s : s + run] for s in starts])
    np.testing.assert_array_equal(out, expected)
    assert lens.sum() == len(starts) * run


def test_check_extents_cover_reports_gaps_overlaps_and_size():
    check_extents_cover("t", [Extent(0, 0, 0, 10), Extent(1, 0, 10, 5)], 15)
    with pytest.raises(CheckpointFormatError, match="t: .*gap"):
        check_extents_cover("t", [Extent(0, 0, 0, 10), Extent(1, 0, 11, 4)], 15)
    with pytest.raises(CheckpointFormatError, match="overlap"):
        check_extents_cover("t", [Extent(0, 0, 0, 10), Extent(1, 0, 9, 6)], 15)
    with pytest.raises(CheckpointFormatError, match="hold 10 bytes, the item has 15"):
        check_extents_cover("t", [Extent(0, 0, 0, 10)], 15)


def test_align_up():
    assert [align_up(v, 4096) for v in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]
