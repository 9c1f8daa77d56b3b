"""Resharded loads (Universal Checkpointing): the reader rebuilds any target
sharding from exactly the bytes it needs.

* pure planning functions (``fp_dcp.load.plan``) against naive references;
* one process, hand-made ``ReadItem``s of random boxes into every kind of
  target (contiguous, strided, transposed, another dtype): bit-exact, and the
  bytes read from disk stay within the blocks the needed bytes touch plus the
  over-read budget;
* gloo worlds: DTensor Shard(0) on 4 ranks -> Shard(0) on 3 and 2, Shard(1)
  on 2, a 2-D mesh -> 1-D, 2 -> 4 ranks; FSDP2 + AdamW saved on 4 ranks and
  restarted on 2 ranks and on one process without a process group; partial
  loads; dtype casts and ``strict_dtype``; shared replicated reads;
  cooperative (interleaved) reads of Shard(0) -> Shard(1) on 2 and 3 ranks.  Every
  load is compared bit for bit with the stock reader's load of the same state.

The worlds are few and each checks many cases: starting one costs seconds.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp_dcp.load import plan as readplan
from fp_dcp.format import Extent
from fp_dcp.load.plan import box_runs
from tests._dist import run_ranks
from tests._oracles import count_runs, item_file_ranges, map_runs_to_extents
from tests._sd import FAILED, bits_equal

# --------------------------------------------------------------------------
# helpers shared by every part


def needed_blocks(path: str, items, alignment: int) -> tuple[int, int]:
    """(bytes the read items need, bytes of the aligned blocks those bytes
    touch), computed with the reference functions of tests/_oracles.py."""
    from fp_dcp.load.reader import read_checkpoint_metadata

    md, layout, _ = read_checkpoint_metadata(path)
    ranges = item_file_ranges(md, layout, items)
    blocks: dict[int, set] = {}
    for f, start, end in ranges.tolist():
        blocks.setdefault(f, set()).update(range(start // alignment, (end - 1) // alignment + 1))
    return int(np.sum(ranges[:, 2] - ranges[:, 1])), sum(len(b) for b in blocks.values()) * alignment


def needed_runs(path: str, items) -> int:
    """Maximal contiguous byte runs of the files that the read items need
    (runs of different items that touch are one)."""
    from fp_dcp.load.reader import read_checkpoint_metadata

    md, layout, _ = read_checkpoint_metadata(path)
    return count_runs(item_file_ranges(md, layout, items))


def assert_read_bound(stats: dict, needed: int, touched: int, alignment: int, what: str) -> None:
    """Bytes read <= the blocks the needed bytes touch, plus the over-read
    budget (5%), plus one block per engine call and per temporary unit (a
    block shared by two of them may be read twice)."""
    assert stats["bytes"] == needed, f"{what}: reader needed {stats['bytes']}, the items need {needed}"
    slack = alignment * (2 * stats["engine_calls"] + stats.get("temp_units", 0))
    bound = touched + needed * 5 // 100 + slack
    assert stats["bytes_read"] <= bound, f"{what}: read {stats['bytes_read']} > bound {bound} ({stats})"


class RecordingPlanner:
    """A DefaultLoadPlanner that keeps the items of this rank's final plan."""

    def __new__(cls, *args, **kwargs):
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        class _Recording(DefaultLoadPlanner):
            items: list = []

            def finish_plan(self, new_plan):
                self.items = list(new_plan.items)
                return super().finish_plan(new_plan)

        return _Recording(*args, **kwargs)


# --------------------------------------------------------------------------
# pure planning functions


def _draw_box(data, max_ndim: int, max_size: int) -> tuple[list[int], list[int], list[int]]:
    """A chunk shape (1..max_ndim dims of 1..max_size) and a non-empty box in it."""
    ndim = data.draw(st.integers(1, max_ndim))
    sizes = data.draw(st.lists(st.integers(1, max_size), min_size=ndim, max_size=ndim))
    offs = [data.draw(st.integers(0, s - 1)) for s in sizes]
    lens = [data.draw(st.integers(1, s - o)) for s, o in zip(sizes, offs)]
    return sizes, offs, lens


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_box_grid_matches_box_runs(data):
    sizes, offs, lens = _draw_box(data, 4, 6)
    esize = data.draw(st.sampled_from([1, 2, 4, 8]))
    grid = readplan.box_grid(sizes, offs, lens, esize)
    src, dst, _ = readplan.unit_starts(grid, len(grid.counts))
    # byte by byte: every byte of the box, in row-major order of the box
    got = (src[:, None] + np.arange(grid.run)[None, :]).reshape(-1)
    starts, run = box_runs(sizes, offs, lens, esize)
    want = (starts[:, None] + np.arange(run)[None, :]).reshape(-1)
    assert np.array_equal(got, want)
    assert np.array_equal((dst[:, None] + np.arange(grid.run)[None, :]).reshape(-1), np.arange(len(want)))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_box_grid_into_strided_targets_and_merge_levels(data):
    sizes, offs, lens = _draw_box(data, 3, 7)
    ndim = len(sizes)
    perm = data.draw(st.permutations(range(ndim)))
    pad = data.draw(st.integers(0, 2))
    # a target laid out in another dimension order, inside a padded buffer
    outer = torch.zeros([lens[p] + pad for p in perm]).permute(*np.argsort(perm).tolist())
    dest = outer[tuple(slice(0, n) for n in lens)]
    grid = readplan.box_grid(sizes, offs, lens, 1, dest.stride())
    full = torch.arange(math.prod(sizes), dtype=torch.float32).reshape(sizes)
    src, dst, _ = readplan.unit_starts(grid, len(grid.counts))
    flat_src = full.reshape(-1)
    base = dest.as_strided((1 + sum((n - 1) * s for n, s in zip(dest.shape, dest.stride())),), (1,), dest.storage_offset())
    for s, d in zip(src.tolist(), dst.tolist()):
        base[d : d + grid.run] = flat_src[s : s + grid.run]
    assert torch.equal(dest, full[tuple(slice(o, o + n) for o, n in zip(offs, lens))])
    # every sub-grid of the free merge level spans its runs without a whole block in a gap
    level = readplan.free_merge_level(grid, 4)
    assert 0 <= level <= len(grid.counts)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_map_ranges_matches_map_runs_to_extents(data):
    total = data.draw(st.integers(1, 400))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, total - 1), max_size=5)))) if total > 1 else []
    bounds = [0] + cuts + [total]
    exts = [Extent(i % 3, 1000 * i + 7 * i, a, b - a) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    run = data.draw(st.integers(1, total))
    starts = np.array(sorted(data.draw(st.lists(st.integers(0, total - run), min_size=1, max_size=6))), dtype=np.int64)
    arrays = [np.array([getattr(e, f) for e in exts], dtype=np.int64)
              for f in ("item_offset", "length", "file", "file_offset")]
    rng, within, files, offs, lens = readplan.map_ranges(starts, np.full(len(starts), run), *arrays)
    f2, o2, l2, d2 = map_runs_to_extents(starts, run, exts)
    assert np.array_equal(files, f2) and np.array_equal(offs, o2) and np.array_equal(lens, l2)
    assert np.array_equal(rng * run + within, d2)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_whole_chunk_into_a_contiguous_target_reads_the_pieces_of_the_grid_path(data):
    """The planner's shortcut for the common read (a whole stored chunk into
    a contiguous tensor of its dtype) makes the pieces the grid path makes:
    the chunk's extents, each into its place in the target."""
    from types import SimpleNamespace

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from fp_dcp.load.jobs import ItemPlanner, Limits, direct_jobs

    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]))
    shape = tuple(data.draw(st.lists(st.integers(1, 9), max_size=3)))
    total = math.prod(shape) * dtype.itemsize
    cuts = sorted(set(data.draw(st.lists(st.integers(1, total - 1), max_size=4)))) if total > 1 else []
    bounds = [0] + cuts + [total]
    exts = [Extent(i % 2, 4096 * i + 64 * i, a, b - a) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    planner = ItemPlanner(SimpleNamespace(extents={MetadataIndex("t", None): exts}), {}, "ckpt",
                          strict_dtype=False, allow_pickle=False)
    limits = Limits(4096, 1 << 20, np.array([1 << 30, 1 << 30]), 0.05)
    dest = torch.empty(shape, dtype=dtype)
    (job,) = planner.plan_box("t", None, list(shape), dtype, [0] * len(shape), list(shape), dest, limits, None)
    grid = readplan.box_grid(list(shape), [0] * len(shape), list(shape), dtype.itemsize, dest.stride())
    (ref,) = direct_jobs(grid, planner.extents("t", None, total), job.buf, total)
    keep = job.lens > 0
    assert job.needed == ref.needed == total and job.buf.nbytes == total
    assert job.buf.__array_interface__["data"][0] == dest.data_ptr()
    for got, want in ((job.files, ref.files), (job.offs, ref.offs), (job.lens, ref.lens), (job.pos, ref.pos)):
        assert np.array_equal(got[keep], want)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_plan_fillers_fills_free_gaps_and_stays_in_budget(data):
    a = 64
    n = data.draw(st.integers(1, 30))
    offs = np.array(sorted(data.draw(st.lists(st.integers(0, 3000), min_size=n, max_size=n))), dtype=np.int64)
    lens = np.array(data.draw(st.lists(st.integers(0, 200), min_size=n, max_size=n)), dtype=np.int64)
    files = np.zeros(n, dtype=np.int64)
    budget = data.draw(st.integers(0, 500))
    ff, fo, fl, paid = readplan.plan_fillers(files, offs, lens, a, budget, 256)
    assert paid <= budget
    assert np.all(fl > 0)
    end = np.maximum.accumulate(offs + lens)
    for i in range(1, n):
        gap_start, gap_end = end[i - 1], offs[i]
        whole_blocks = (gap_end // a) * a - (-(-gap_start // a) * a)
        filled = np.any((fo == gap_start) & (fl == gap_end - gap_start))
        if gap_end > gap_start and whole_blocks <= 0:
            assert filled, (i, gap_start, gap_end)
        if filled:
            assert gap_end > gap_start


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(1, 600))
def test_split_box_tiles_the_box_within_the_cap(lengths, cap):
    parts = readplan.split_box(lengths, 4, cap)
    seen = np.zeros(lengths, dtype=np.int32)
    for offs, lens in parts:
        assert math.prod(lens) * 4 <= max(cap, 4)
        seen[tuple(slice(o, o + n) for o, n in zip(offs, lens))] += 1
    assert np.all(seen == 1)


def test_strides_non_overlapping():
    a = torch.zeros(5, 7)
    assert readplan.strides_non_overlapping(a.shape, a.stride())
    assert readplan.strides_non_overlapping(a[:, 1:3].shape, a[:, 1:3].stride())
    assert readplan.strides_non_overlapping(a.t().shape, a.t().stride())
    e = torch.zeros(3, 1).expand(3, 4)
    assert not readplan.strides_non_overlapping(e.shape, e.stride())


def _coverage(shape, slabs, boxes):
    """Per box, how often each of its elements is in one of its parts; and how
    often each element of the chunk is in a slab."""
    per_box = [np.zeros(n, dtype=np.int32) for _, _, n in boxes]
    read = np.zeros(shape, dtype=np.int32)
    for sl in slabs:
        read[tuple(slice(o, o + n) for o, n in zip(sl.offsets, sl.lengths))] += 1
        for i, po, pn in sl.parts:
            # inside the slab and inside its box
            assert all(so <= o and o + n <= so + sn for o, n, so, sn in zip(po, pn, sl.offsets, sl.lengths))
            _, bo, bn = boxes[i]
            assert all(b <= o and o + n <= b + m for o, n, b, m in zip(po, pn, bo, bn))
            per_box[i][tuple(slice(o - b, o - b + n) for o, n, b in zip(po, pn, bo))] += 1
    return per_box, read


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_interleaved_slabs_tile_every_box_once_and_owners_stay_near_their_needs(data):
    """Column bands of the same rows (a load that moves the sharded
    dimension), uneven, some ranks needing a sub-range of the rows: every
    needed element is in exactly one part of its box, every element of the
    chunk is read by at most one slab (one owner), the slabs cost at most 5%
    more than the needs, and no owner reads more than its quota plus one slab."""
    rows = data.draw(st.integers(1, 40))
    cols = data.draw(st.integers(2, 64))
    inner = data.draw(st.sampled_from([(), (3,)]))
    shape = (rows, cols) + inner
    esize = data.draw(st.sampled_from([1, 2, 4]))
    k = data.draw(st.integers(2, min(5, cols)))
    cuts = sorted(data.draw(st.lists(st.integers(1, cols - 1), min_size=k - 1, max_size=k - 1, unique=True)))
    bounds = [0] + cuts + [cols]
    boxes = []
    for r, (a, b) in enumerate(zip(bounds, bounds[1:])):
        r0 = data.draw(st.integers(0, rows - 1)) if data.draw(st.booleans()) else 0
        r1 = rows if r0 == 0 else data.draw(st.integers(r0 + 1, rows))
        boxes.append((r % data.draw(st.integers(2, k)) if k > 2 else r, (r0, a) + (0,) * len(inner),
                      (r1 - r0, b - a) + inner))
    slab_bytes = data.draw(st.integers(cols * math.prod(inner) * esize, 4096))
    slabs = readplan.interleaved_slabs(shape, esize, boxes, slab_bytes, run_max_bytes=1 << 16)
    need = sum(math.prod(n) for _, _, n in boxes) * esize
    if not slabs:
        # declined only for one rank, boxes that are single runs, or rows the boxes do not cover
        fragmented = any(readplan.box_grid(shape, o, n, esize).counts for _, o, n in boxes)
        covered = all(o[0] == 0 and n[0] == rows for _, o, n in boxes)
        assert len({r for r, _, _ in boxes}) < 2 or not fragmented or not covered
        return
    per_box, read = _coverage(shape, slabs, boxes)
    assert all(np.all(c == 1) for c in per_box)
    assert read.max() <= 1
    total = sum(sl.nbytes for sl in slabs)
    assert total == int(read.sum()) * esize
    assert total <= need * 1.05
    assert all(sl.nbytes <= max(slab_bytes, sl.nbytes // sl.lengths[0]) for sl in slabs)
    # owners: quotas in proportion to each rank's needs, as the reader sets them
    per_rank: dict[int, int] = {}
    for sl in slabs:
        for i, po, pn in sl.parts:
            per_rank[boxes[i][0]] = per_rank.get(boxes[i][0], 0) + math.prod(pn) * esize
    quota = {r: n * total // need for r, n in per_rank.items()}
    if all(len({boxes[i][0] for i, _, _ in sl.parts}) == len(per_rank) for sl in slabs):
        owners = readplan.assign_owners([(sl.nbytes, sorted(per_rank)) for sl in slabs], quota)
        owned = {r: 0 for r in per_rank}
        for sl, o in zip(slabs, owners):
            owned[o] += sl.nbytes
        biggest = max(sl.nbytes for sl in slabs)
        for r in per_rank:
            assert owned[r] <= per_rank[r] * 1.05 + biggest, (r, owned, per_rank)


def test_interleaved_slabs_decline_where_cooperation_does_not_pay():
    ws = 4096 * 4
    # Shard(1) of Shard(0) chunks on 2 ranks: one slab per rank at least, whole rows
    slabs = readplan.interleaved_slabs((512, 4096), 4, [(0, (0, 0), (512, 2048)), (1, (0, 2048), (512, 2048))],
                                       1 << 20)
    assert slabs and all(sl.lengths == (sl.lengths[0], 4096) for sl in slabs)
    assert sum(sl.nbytes for sl in slabs) == 512 * ws
    assert len(slabs) == 8  # 64 rows of 16 KiB per 1 MiB slab
    # long runs (>= 64 KiB): every rank reads its own
    assert readplan.interleaved_slabs((64, 65536), 4, [(0, (0, 0), (64, 32768)), (1, (0, 32768), (64, 32768))],
                                      64 << 20) == []
    # dim-0 boxes are contiguous: nothing to share
    assert readplan.interleaved_slabs((64, 16), 4, [(0, (0, 0), (32, 16)), (1, (32, 0), (32, 16))], 1 << 20) == []
    # one rank, or a gap of half the rows between the bands
    assert readplan.interleaved_slabs((64, 16), 4, [(0, (0, 0), (64, 8))], 1 << 20) == []
    assert readplan.interleaved_slabs((64, 16), 4, [(0, (0, 0), (64, 4)), (1, (0, 12), (64, 4))], 1 << 20) == []
    # a row longer than a slab would break the memory bound
    assert readplan.interleaved_slabs((8, 4096), 4, [(0, (0, 0), (8, 2048)), (1, (0, 2048), (8, 2048))],
                                      8 << 10) == []
    # owners: each takes about its quota, interleaved
    owners = readplan.assign_owners([(10, [0, 1])] * 6, {0: 30, 1: 30})
    assert owners == [0, 1, 0, 1, 0, 1]
    assert readplan.assign_owners([(10, [1])], {0: 100}) == [1]


# --------------------------------------------------------------------------
# one process: random boxes into every kind of target


class _Planner:
    def __init__(self, targets):
        self.targets, self.committed, self.loaded = targets, [], {}

    def resolve_tensor(self, req):
        return self.targets[req.dest_index.fqn]

    def commit_tensor(self, req, tensor):
        self.committed.append(req.dest_index.fqn)

    def load_bytes(self, req, value):
        self.loaded[req.dest_index.fqn] = value.read()


def _target(kind: str, lens: list[int], dtype: torch.dtype) -> torch.Tensor:
    if kind == "contiguous":
        return torch.zeros(lens, dtype=dtype)
    if kind == "strided":  # a window of a larger tensor (a column slice)
        return torch.zeros([n + 3 for n in lens], dtype=dtype)[tuple(slice(1, 1 + n) for n in lens)]
    if kind == "transposed":
        return torch.zeros(lens[::-1], dtype=dtype).permute(*reversed(range(len(lens))))
    if kind == "cast":
        return torch.zeros(lens, dtype=torch.float64 if dtype != torch.float64 else torch.bfloat16)
    raise ValueError(kind)


@pytest.mark.parametrize("budget", [1 << 20, 64 << 20])
def test_random_boxes_into_every_target_kind_are_exact_and_read_only_needed_blocks(tmp_path, budget):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from fp_dcp import FastPersistReader, FastPersistWriter

    g = torch.Generator().manual_seed(0)
    sd = {
        "wide": torch.randn(96, 4096, generator=g),  # 16 KiB rows: column slices are sparse runs
        "narrow": torch.randn(3000, 96, generator=g),  # 384-byte rows: column slices are dense
        "cube": torch.randn(24, 40, 72, generator=g).to(torch.bfloat16),
        "ints": torch.randint(0, 1 << 40, (777, 33), generator=g),
        "small": torch.randn(5, 3, generator=g),
    }
    path = str(tmp_path / "c")
    dcp.save(sd, storage_writer=FastPersistWriter(path), no_dist=True)
    reader = FastPersistReader(path, read_buffer_budget_bytes=budget)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    rng = np.random.default_rng(budget)
    kinds = ["contiguous", "strided", "transposed", "cast"]
    for trial in range(120):
        name = list(sd)[trial % len(sd)]
        full = sd[name]
        offs = [int(rng.integers(0, s)) for s in full.shape]
        lens = [int(rng.integers(1, s - o + 1)) for s, o in zip(full.shape, offs)]
        if trial % 7 == 0:  # whole rows
            offs[1:] = [0] * (len(offs) - 1)
            lens[1:] = list(full.shape[1:])
        kind = kinds[(trial // len(sd)) % len(kinds)]
        dest = _target(kind, lens, full.dtype)
        planner = _Planner({"t": dest})
        req = ReadItem(LoadItemType.TENSOR, MetadataIndex("t", [0] * len(lens)), [0] * len(lens),
                       MetadataIndex(name, [0] * len(lens)), offs, lens)
        reader.read_data(LoadPlan([req]), planner)
        want = full[tuple(slice(o, o + n) for o, n in zip(offs, lens))].to(dest.dtype)
        assert bits_equal(dest, want), (trial, name, offs, lens, kind)
        assert planner.committed == ["t"]
        needed, touched = needed_blocks(path, [req], 4096)
        assert_read_bound(reader.last_stats, needed, touched, 4096, f"trial {trial} {name} {offs} {lens} {kind}")
    reader.close()


def test_dense_last_dim_slice_is_read_in_few_requests(tmp_path):
    """A slice of 90 of 96 columns of 3000 rows: one range per slab, not one
    request per row; bytes read = the span (its gaps hold no whole block)."""
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader, FastPersistWriter

    full = torch.randn(3000, 96)
    path = str(tmp_path / "c")
    dcp.save({"x": full}, storage_writer=FastPersistWriter(path), no_dist=True)
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    dest = torch.zeros(3000, 90)
    reader = FastPersistReader(path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    req = ReadItem(LoadItemType.TENSOR, MetadataIndex("t", [0, 0]), [0, 0], MetadataIndex("x", [0, 0]), [0, 3], [3000, 90])
    reader.read_data(LoadPlan([req]), _Planner({"t": dest}))
    assert torch.equal(dest, full[:, 3:93])
    s = reader.last_stats
    assert s["pieces"] <= 4 and s["requests"] <= 8, s
    assert s["bytes_read"] <= 3000 * 96 * 4 + 2 * 4096, s
    reader.close()


def test_overread_budget_decides_between_runs_and_whole_ranges(tmp_path):
    """A column shard of 16 KiB rows (8 KiB runs, 8 KiB gaps): within the
    default 5% budget each run is read on its own; with
    max_overread_percent=100 the rows are read as whole ranges (twice the
    bytes, a few large requests) and the budget is not exceeded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from fp_dcp import FastPersistReader, FastPersistWriter

    full = torch.randn(512, 4096)
    path = str(tmp_path / "c")
    dcp.save({"x": full}, storage_writer=FastPersistWriter(path), no_dist=True)
    req = ReadItem(LoadItemType.TENSOR, MetadataIndex("t", [0, 0]), [0, 0], MetadataIndex("x", [0, 0]),
                   [0, 2048], [512, 2048])
    needed = 512 * 2048 * 4
    for percent, max_read, max_pieces in ((5, needed * 105 // 100 + 4096, 10**6), (100, 2 * needed, 8)):
        dest = torch.zeros(512, 2048)
        reader = FastPersistReader(path, max_overread_percent=percent)
        reader.set_up_storage_reader(reader.read_metadata(), True)
        reader.read_data(LoadPlan([req]), _Planner({"t": dest}))
        assert torch.equal(dest, full[:, 2048:])
        s = reader.last_stats
        assert s["bytes_read"] <= max_read and s["pieces"] <= max_pieces, (percent, s)
        if percent == 5:
            assert s["pieces"] >= 512 and s["temp_units"] == 0, s
        reader.close()


def test_strict_dtype_refuses_a_cast_and_names_the_tensor(tmp_path):
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader, FastPersistWriter

    path = str(tmp_path / "c")
    dcp.save({"layer.w": torch.randn(8, 8)}, storage_writer=FastPersistWriter(path), no_dist=True)
    target = {"layer.w": torch.zeros(8, 8, dtype=torch.bfloat16)}
    dcp.load(target, storage_reader=FastPersistReader(path), no_dist=True)  # casts, as the stock reader
    with pytest.raises(FAILED, match=r"layer\.w.*torch\.float32.*strict_dtype"):
        dcp.load({"layer.w": torch.zeros(8, 8, dtype=torch.bfloat16)},
                 storage_reader=FastPersistReader(path, strict_dtype=True), no_dist=True)


# --------------------------------------------------------------------------
# gloo worlds

_N = 16  # global batch of the FSDP2 training
_STEPS_BEFORE = 3
_STEPS_AFTER = 10


def _full(name: str, shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(dtype)


# name -> (global shape, saved placements on a 1-D mesh, or "2d")
_DT = {
    "w": ((96, 40), "s0"),
    "odd": ((50, 70), "s0"),  # uneven shards
    "big": ((1024, 520), "s0"),  # 2 MiB: runs long enough to read straight into the targets
    "cols": ((40, 2000), "s1"),
    "grid2d": ((60, 36), "2d"),
}


def _placements(kind: str):
    from torch.distributed.tensor import Replicate, Shard

    return {"s0": [Shard(0)], "s1": [Shard(1)], "rep": [Replicate()]}[kind]


def _dtensor_sd(ws: int, placements: dict[str, str], zero: bool, dtype=None):
    """The DTensor state dict on a 1-D mesh of ``ws`` ranks (a 2x2 mesh for
    "2d" entries when saving on 4 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    sd = {}
    for name, (shape, saved) in _DT.items():
        kind = placements.get(name, saved)
        if kind == "2d" and ws != 4:  # the 2x2 mesh exists only on 4 ranks: loads go 2-D -> 1-D
            kind = "s0"
        full = torch.zeros(shape, dtype=dtype or torch.float32) if zero else _full(name, shape)
        if kind == "2d":
            mesh2 = init_device_mesh("cpu", (2, 2))
            sd[name] = distribute_tensor(full, mesh2, [Shard(0), Shard(1)])
        else:
            sd[name] = distribute_tensor(full, mesh, _placements(kind))
    sd["rep"] = torch.zeros(300, 64) if zero else _full("rep", (300, 64))  # every rank holds it (DDP style)
    sd["step"] = 0 if zero else 7
    return sd


def _expected_local(sd: dict) -> dict:
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = {}
    for name, t in sd.items():
        if isinstance(t, DTensor):
            full = _full(name, tuple(t.shape)).to(t.dtype)
            out[name] = distribute_tensor(full, t.device_mesh, t.placements).to_local()
        elif isinstance(t, torch.Tensor):
            out[name] = _full(name, tuple(t.shape)).to(t.dtype)
    return out


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _model():
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))


def _batch(step: int, rank: int, ws: int):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(_N, 16, generator=g), torch.randn(_N, 8, generator=g)
    n = _N // ws
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _fsdp(ws: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps, first, rank, ws):
    import torch.distributed as dist

    losses = []
    for s in range(first, first + steps):
        x, y = _batch(s, rank, ws)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dist.is_initialized():
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= ws
        losses.append(loss.item())
    return losses


def _save_world(rank, ws, root):
    """4 ranks: the DTensor state and an FSDP2 model + AdamW after a few
    steps, each saved by fp_dcp and by the stock writer; then the
    uninterrupted run's next losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fp_dcp import FastPersistWriter

    sd = _dtensor_sd(ws, {}, zero=False)
    dcp.save(sd, storage_writer=FastPersistWriter(os.path.join(root, "dt")))
    dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(root, "dt_stock")))
    model, opt = _fsdp(ws)
    _train(model, opt, _STEPS_BEFORE, 0, rank, ws)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.save(state, storage_writer=FastPersistWriter(os.path.join(root, "fsdp")))
    dcp.save(state, storage_writer=FileSystemWriter(os.path.join(root, "fsdp_stock")))
    full = _full_state(model, opt)  # what every restart must hold, bit for bit
    if rank == 0:
        torch.save(full, os.path.join(root, "fsdp_full.pt"))
    return _train(model, opt, _STEPS_AFTER, _STEPS_BEFORE, rank, ws)


def _full_state(model, opt) -> dict:
    """The whole (unsharded) model and optimizer state, flattened to
    ``{"model.<fqn>" / "optim.<path>": value}``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}", x)
        else:
            out[prefix] = _local(v).detach().clone() if isinstance(v, torch.Tensor) else v

    walk("model", msd)
    walk("optim", osd)
    return out


def _load_both(root: str, name: str, make, **reader_kw):
    """Load the same fresh target from fp_dcp and from the stock checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from fp_dcp import FastPersistReader

    ours, stock = make(), make()
    reader = FastPersistReader(os.path.join(root, name), **reader_kw)
    planner = RecordingPlanner()
    dcp.load(ours, storage_reader=reader, planner=planner)
    dcp.load(stock, storage_reader=FileSystemReader(os.path.join(root, name + "_stock")))
    for k, t in stock.items():
        if isinstance(t, torch.Tensor):
            assert bits_equal(_local(ours[k]), _local(t)), f"{name}/{k}: fp_dcp and the stock reader differ"
        else:
            assert ours[k] == t, k
    return ours, reader.last_stats, planner.items


def _check_dt_load(root, ws, placements, dtype=None, **reader_kw):
    ours, stats, items = _load_both(root, "dt", lambda: _dtensor_sd(ws, placements, zero=True, dtype=dtype), **reader_kw)
    for k, want in _expected_local(ours).items():
        assert bits_equal(_local(ours[k]), want), f"{k} ({placements.get(k)}) on {ws} ranks"
    assert ours["step"] == 7
    needed, touched = needed_blocks(os.path.join(root, "dt"), items, 4096)
    assert_read_bound(stats, needed, touched, 4096, f"dt {placements} on {ws} ranks")
    return stats


def _fsdp_restart(root, rank, ws):
    """Load the FSDP2 checkpoint (stock and ours must agree bit for bit),
    then train on: fp_dcp's restart and the stock restart give identical
    losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from fp_dcp import FastPersistReader

    runs = {}
    for name, reader in (("fp", FastPersistReader(os.path.join(root, "fsdp"))),
                         ("stock", FileSystemReader(os.path.join(root, "fsdp_stock")))):
        model, opt = _fsdp(ws) if ws > 1 else (_model(), None)
        if opt is None:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=reader, no_dist=ws == 1)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = _full_state(model, opt)
        runs[name] = (loaded, _train(model, opt, _STEPS_AFTER, _STEPS_BEFORE, rank, ws))
    # the restarted model and optimizer hold exactly what was saved (all of
    # it: every parameter, exp_avg, exp_avg_sq, step and hyperparameter)
    saved = torch.load(os.path.join(root, "fsdp_full.pt"))
    assert sorted(runs["fp"][0]) == sorted(saved), (sorted(runs["fp"][0]), sorted(saved))
    for k, want in saved.items():
        got = runs["fp"][0][k]
        assert bits_equal(got, want) if isinstance(want, torch.Tensor) else got == want, k
    assert runs["fp"][1] == runs["stock"][1], (runs["fp"][1], runs["stock"][1])
    return runs["fp"][1]


def _partial_load(root, rank, ws):
    """Model only, then two keys of the DTensor state: the reader needs and
    reads only those bytes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from fp_dcp import FastPersistReader

    model, _ = _fsdp(ws)
    msd = get_model_state_dict(model)
    reader = FastPersistReader(os.path.join(root, "fsdp"))
    planner = RecordingPlanner()
    dcp.load({"model": msd}, storage_reader=reader, planner=planner)
    assert all(i.storage_index.fqn.startswith("model.") for i in planner.items)
    local_bytes = sum(_local(v).numel() * _local(v).element_size() for v in msd.values())
    needed, touched = needed_blocks(os.path.join(root, "fsdp"), planner.items, 4096)
    assert needed == local_bytes
    assert_read_bound(reader.last_stats, needed, touched, 4096, "model only")

    sd = _dtensor_sd(ws, {}, zero=True)
    part = {"odd": sd["odd"], "cols": sd["cols"]}
    reader = FastPersistReader(os.path.join(root, "dt"))
    planner = RecordingPlanner()
    dcp.load(part, storage_reader=reader, planner=planner)
    want = _expected_local(part)
    assert all(bits_equal(_local(part[k]), want[k]) for k in part)
    local_bytes = sum(_local(v).numel() * 4 for v in part.values())
    needed, touched = needed_blocks(os.path.join(root, "dt"), planner.items, 4096)
    assert needed == local_bytes == reader.last_stats["bytes"]
    assert_read_bound(reader.last_stats, needed, touched, 4096, "two keys")
    total = sum(os.path.getsize(os.path.join(root, "dt", f)) for f in os.listdir(os.path.join(root, "dt")))
    assert reader.last_stats["bytes_read"] < total / 4


def _interleaved_reads(root, rank, ws):
    """Shard(0) on 4 ranks loaded as Shard(1) on ``ws`` ranks with
    share_interleaved_reads: bit-exact beside the stock reader, with parts
    pulled from the owners' memory and sent over gloo; each rank reads from
    disk about the bytes it needs (not whole rows), strictly less than
    without the option; a cast target goes through the same path; a failure
    on one rank, in its reads or in its pulls, fails every rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from fp_dcp import FastPersistReader

    s1 = {k: "s1" for k in _DT}
    budget = 1 << 20  # 64 KiB slabs: several rounds even for these small tensors
    path = os.path.join(root, "dt")
    out = {}
    # None: the default (auto), on for a gloo group
    for coop, transport in ((False, "auto"), (None, "auto"), (True, "process_group")):
        ours, stats, items = _load_both(root, "dt", lambda: _dtensor_sd(ws, s1, zero=True),
                                        share_interleaved_reads=coop, read_buffer_budget_bytes=budget,
                                        shared_read_transport=transport)
        for k, want in _expected_local(ours).items():
            assert bits_equal(_local(ours[k]), want), k
        needed, _ = needed_blocks(path, items, 4096)
        assert stats["bytes"] == needed, (stats, needed)
        out[coop, transport] = (needed, stats["bytes_read"], needed_runs(path, items), stats)
    needed, plain, runs, _ = out[False, "auto"]
    for key in ((None, "auto"), (True, "process_group")):
        transport = key[1]
        _, coop, _, st = out[key]
        # the reshard target, and tighter: 5% plus one 64 KiB slab of owner imbalance
        assert coop <= 1.05 * needed + 4096 * runs, (coop, needed, runs)
        assert coop <= 1.05 * needed + (64 << 10), (coop, needed, st)
        assert 0 < st["shared_buffer_bytes"] <= budget, st  # the rounds' buffers, all of them
        assert coop < plain, (coop, plain)
        assert st["shared_bytes_received"] > 0 and st["shared_bytes_sent"] > 0 and st["shared_rounds"] > 1, st
        # on one machine every part is pulled; with the process group, none
        pulled = st["shared_bytes_received"] if transport == "auto" else 0
        assert st["shared_bytes_pulled"] == pulled, (transport, st)
        phases = [st[f"shared_{k}_seconds"] for k in ("setup", "read_wait", "prepare", "split", "status")]
        assert all(p >= 0.0 for p in phases) and st["shared_status_seconds"] > 0.0, st  # one all-gather a round
        flows = torch.tensor([st["shared_bytes_sent"], st["shared_bytes_received"]])
        dist.all_reduce(flows)
        assert flows[0] == flows[1]  # every byte sent is received

    # targets of another dtype: received into a temporary and cast
    ours, stats, _ = _load_both(root, "dt", lambda: _dtensor_sd(ws, s1, zero=True, dtype=torch.float64),
                                share_interleaved_reads=True, read_buffer_budget_bytes=budget)
    for k, want in _expected_local(ours).items():
        assert bits_equal(_local(ours[k]), want), k
    assert stats["shared_bytes_received"] > 0

    # a failure on one rank inside the cooperative phase fails every rank
    mesh = init_device_mesh("cpu", (ws,))
    big = distribute_tensor(torch.zeros(1024, 520), mesh, [Shard(1)])
    local = big.to_local().to(torch.bfloat16 if rank == 1 else torch.float32)
    target = {"big": DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=big.shape,
                                        stride=big.stride())}
    try:
        dcp.load(target, storage_reader=FastPersistReader(path, share_interleaved_reads=True, strict_dtype=True,
                                                          read_buffer_budget_bytes=budget))
        raise AssertionError("a strict_dtype mismatch on rank 1 did not fail the cooperative load")
    except FAILED as e:
        assert "strict_dtype" in str(e) or "rank 1" in str(e), str(e)

    # a kernel that refuses rank 1's pulls (a fault injected into them): when
    # the probe is refused, rank 1 receives over gloo and the load is right;
    # when only later pulls are, every rank fails, naming the fallback
    from fp_dcp import _native

    real_pull = _native.pull

    def load_with(pull_on_rank_1):
        """A cooperative load with rank 1 pulling through ``pull_on_rank_1``:
        bit-exact, or raises; its stats."""
        if rank == 1:
            _native.pull = pull_on_rank_1
        try:
            target = _dtensor_sd(ws, s1, zero=True)
            reader = FastPersistReader(path, share_interleaved_reads=True, read_buffer_budget_bytes=budget)
            dcp.load(target, storage_reader=reader)
            for k, want in _expected_local(target).items():
                assert bits_equal(_local(target[k]), want), k
            return reader.last_stats
        finally:
            _native.pull = real_pull

    for probe_too in (True, False):

        def refused(pid, dst, remote, starts, run_length, probe_too=probe_too):
            if probe_too or len(starts) != 1 or run_length != 16:  # the probe pulls one 16-byte run
                raise PermissionError(1, "Operation not permitted (injected)")
            return real_pull(pid, dst, remote, starts, run_length)

        try:
            stats = load_with(refused)
            assert probe_too, "a refused pull on rank 1 did not fail the cooperative load"
            pulled = stats["shared_bytes_pulled"]
            assert (pulled == 0) if rank == 1 else (pulled > 0), (rank, stats)
        except FAILED as e:
            assert not probe_too, str(e)
            assert "shared_read_transport='process_group'" in str(e) and "rank 1" in str(e), str(e)

    # a slow puller (rank 1 sleeps before each pull of a part): the owners
    # read no other round into a box before its progress counter says it has
    # pulled from that box, so the parts stay right
    def slow(pid, dst, remote, starts, run_length):
        if not (len(starts) == 1 and run_length in (8, 16)):  # not a counter or the probe
            time.sleep(0.02)
        return real_pull(pid, dst, remote, starts, run_length)

    stats = load_with(slow)
    assert stats["shared_rounds"] > 4 and stats["shared_bytes_pulled"] > 0, stats

    # auto shares rows only among ranks of one machine: with rank 1 saying it
    # runs elsewhere, every rank reads its own runs; True still shares, and
    # rank 1's parts go over gloo
    from fp_dcp.load.sharing import transport

    real_key = transport.machine_key
    if rank == 1:
        transport.machine_key = lambda: ("another machine",)
    try:
        for wanted in (None, True):
            _, st, _ = _load_both(root, "dt", lambda: _dtensor_sd(ws, s1, zero=True),
                                  share_interleaved_reads=wanted, read_buffer_budget_bytes=budget)
            if wanted is None:
                assert "shared_rounds" not in st, st
            else:
                assert st["shared_rounds"] > 0 and st["shared_bytes_received"] > 0, st
                assert rank != 1 or st["shared_bytes_pulled"] == 0, st
    finally:
        transport.machine_key = real_key
    return {"needed": needed, "plain": plain, "coop": out[None, "auto"][1]}


def _world_3(rank, ws, root):
    _check_dt_load(root, ws, {"grid2d": "s0", "cols": "s0"})
    interleaved = _interleaved_reads(root, rank, ws)
    # every rank needs all of "rep": with sharing, it is read from disk once in all
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for share, transport in ((False, "auto"), (True, "auto"), (True, "process_group")):
        target = {"rep": torch.zeros(300, 64), "w": distribute_tensor(torch.zeros(96, 40), mesh, [Replicate()])}
        reader = FastPersistReader(os.path.join(root, "dt"), share_replicated_reads=share,
                                   read_buffer_budget_bytes=1 << 20, shared_read_transport=transport)
        dcp.load(target, storage_reader=reader)
        assert bits_equal(target["rep"], _full("rep", (300, 64)))
        assert bits_equal(target["w"].to_local(), _full("w", (96, 40)))
        st = reader.last_stats
        got = torch.tensor([st["bytes_read"], st.get("shared_bytes_received", 0), st.get("shared_bytes_pulled", 0)])
        dist.all_reduce(got)
        if share:
            assert got[2] == (got[1] if transport == "auto" else 0), (transport, got)
            assert share not in out or out[share] == got[:2].tolist(), (out, got)  # the same bytes either way
        out[share] = got[:2].tolist()
    # the coordinator decides: a rank whose own option is off still takes part
    target = {"rep": torch.zeros(300, 64)}
    dcp.load(target, storage_reader=FastPersistReader(os.path.join(root, "dt"), share_replicated_reads=rank == 0))
    assert bits_equal(target["rep"], _full("rep", (300, 64)))
    # a failure on one rank inside the shared phase fails every rank (no rank is left waiting)
    target = {"rep": torch.zeros(300, 64, dtype=torch.bfloat16 if rank == 1 else torch.float32)}
    try:
        dcp.load(target, storage_reader=FastPersistReader(os.path.join(root, "dt"), share_replicated_reads=True,
                                                          strict_dtype=True))
        raise AssertionError("a strict_dtype mismatch on rank 1 did not fail the load")
    except FAILED as e:
        assert "strict_dtype" in str(e) or "rank 1" in str(e), str(e)
    out["interleaved"] = interleaved
    return out


def _world_2(rank, ws, root):
    s0 = _check_dt_load(root, ws, {"grid2d": "s0"})
    s1 = _check_dt_load(root, ws, {k: "s1" for k in _DT})
    # targets of another dtype are cast as the stock reader casts
    _check_dt_load(root, ws, {}, dtype=torch.bfloat16)
    _check_dt_load(root, ws, {k: "s1" for k in _DT}, dtype=torch.float64)
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader, FastPersistWriter

    try:
        dcp.load(_dtensor_sd(ws, {}, zero=True, dtype=torch.bfloat16),
                 storage_reader=FastPersistReader(os.path.join(root, "dt"), strict_dtype=True))
        raise AssertionError("strict_dtype did not refuse a cast")
    except FAILED as e:
        assert "strict_dtype" in str(e) and "torch.float32" in str(e), str(e)
    interleaved = _interleaved_reads(root, rank, ws)
    _partial_load(root, rank, ws)
    losses = _fsdp_restart(root, rank, ws)
    # a 2-rank checkpoint for the 2 -> 4 world
    sd = _dtensor_sd(ws, {}, zero=False)
    for name in ("grid2d",):
        sd.pop(name)
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(sd, storage_writer=FastPersistWriter(os.path.join(root, "dt2")))
    dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(root, "dt2_stock")))
    return {"losses": losses, "stats": (s0, s1), "interleaved": interleaved}


def _world_4_from_2(rank, ws, root):
    # the FSDP2 checkpoint on the world size that saved it: the restart's losses
    losses = _fsdp_restart(root, rank, ws)
    for placements in ({}, {k: "s1" for k in _DT}):

        def make(placements=placements):
            sd = _dtensor_sd(ws, placements, zero=True)
            sd.pop("grid2d")
            return sd

        ours, stats, items = _load_both(root, "dt2", make)
        for k, want in _expected_local(ours).items():
            assert bits_equal(_local(ours[k]), want), k
        needed, touched = needed_blocks(os.path.join(root, "dt2"), items, 4096)
        assert_read_bound(stats, needed, touched, 4096, f"2 -> 4 {placements}")
    return losses


@pytest.mark.slow
def test_resharded_loads_fsdp2_restart_partial_and_shared_reads(tmp_path):
    root = str(tmp_path)
    reference = run_ranks(4, _save_world, root)[0]

    shared = run_ranks(3, _world_3, root)[0]
    plain, with_share = shared[False], shared[True]
    rep_bytes = 300 * 64 * 4 + 96 * 40 * 4
    assert plain[0] >= 3 * rep_bytes  # every rank read both tensors
    assert with_share[0] < plain[0] - rep_bytes  # ... with sharing about once in all
    assert with_share[1] == 2 * rep_bytes  # two ranks received each box from its owner

    # On another world size the gradients are reduced over other partitions
    # of the batch, in another order, so the losses can differ in the last
    # bits (with any checkpoint format; the restarted state itself is checked
    # bit for bit in _fsdp_restart) ...
    out = run_ranks(2, _world_2, root)[0]
    np.testing.assert_allclose(out["losses"], reference, rtol=1e-5, atol=1e-7)
    # Shard(0) -> Shard(1), cooperative: each rank reads what it needs, not the whole rows
    for coop in (out["interleaved"], shared["interleaved"]):
        assert coop["coop"] < 0.8 * coop["plain"], coop

    # ... restarted on the world size that saved it, training continues
    # exactly as if it had never stopped
    same_world = run_ranks(4, _world_4_from_2, root)
    assert all(losses == reference for losses in same_world), (same_world[0], reference)


    # one process, no process group: the FSDP2 checkpoint into a plain model
    losses = _fsdp_restart(root, 0, 1)
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-7)


def _cooperative_long_runs(rank, ws, root):
    """Shard(0) saved, Shard(1) loaded cooperatively, with slabs of whole
    rows several MiB long: the rounds read ahead on two threads and both
    send long runs to the engine of large requests."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fp_dcp import FastPersistReader, FastPersistWriter

    mesh = init_device_mesh("cpu", (ws,))
    full = torch.arange(4096 * 2048, dtype=torch.float32).reshape(4096, 2048)
    path = os.path.join(root, "long")
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, storage_writer=FastPersistWriter(path))
    target = {"w": distribute_tensor(torch.zeros(4096, 2048), mesh, [Shard(1)])}
    # 64 MiB of buffers: 4 MiB slabs (budget / 16) of whole 8 KiB rows, long runs
    reader = FastPersistReader(path, share_interleaved_reads=True, read_buffer_budget_bytes=64 << 20)
    dcp.load(target, storage_reader=reader)
    assert bits_equal(target["w"].to_local(), full[:, rank * 1024:(rank + 1) * 1024]), rank
    return reader.last_stats


@pytest.mark.slow  # multi-process, ~5-10 s: the fast subset stays under 3 minutes
def test_cooperative_reads_of_long_runs_use_an_engine_per_thread(tmp_path):
    """Two rounds in flight each read long runs, bit-exact: each reading
    thread has its own engine of large requests (one shared engine failed
    every 1 GiB cooperative load of bench_reshard's s0tos1 with "Engine is in
    use by another thread"; whether two threads meet in it here depends on
    timing, so test_engines_are_set_up_before_the_read_kept_and_closed checks
    the engines themselves)."""
    for stats in run_ranks(2, _cooperative_long_runs, str(tmp_path)):
        assert stats["shared_rounds"] >= 2 and stats["large_request_bytes"] > 0, stats


def _cooperative_corrupt_block(rank, ws, root):
    """Shard(0) saved, one byte of it damaged, Shard(1) loaded cooperatively:
    every rank fails naming the tensor and the file, and no byte of the bad
    checksum block reaches a target on any rank (the owner checks each block
    before it copies out of it; the other rank pulls nothing of that round)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fp_dcp import FastPersistReader, FastPersistWriter
    from fp_dcp.load.reader import read_checkpoint_metadata
    from tests._sd import flip_byte

    mesh = init_device_mesh("cpu", (ws,))
    full = torch.arange(4096 * 2048, dtype=torch.float32).reshape(4096, 2048)
    path = os.path.join(root, "bad")
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, storage_writer=FastPersistWriter(path))
    _, layout, _ = read_checkpoint_metadata(path)
    ext = next(exts[0] for index, exts in layout.extents.items() if index.fqn == "w" and not any(index.offset))
    data_file = os.path.join(path, layout.files[ext.file][0])
    bad_block = 5  # rows 640..767 of the first stored chunk (8 KiB rows, 1 MiB blocks)
    dist.barrier()
    if rank == 0:
        flip_byte(data_file, ext.file_offset + bad_block * (1 << 20) + 100)
    dist.barrier()
    target = {"w": distribute_tensor(torch.zeros(4096, 2048), mesh, [Shard(1)])}
    reader = FastPersistReader(path, share_interleaved_reads=True, read_buffer_budget_bytes=16 << 20)
    try:
        dcp.load(target, storage_reader=reader)
        raise AssertionError("a damaged block did not fail the cooperative load")
    except FAILED as e:
        text = str(e)
        assert "checksum mismatch" in text and "w: bytes" in text and data_file in text, text
    local = target["w"].to_local()
    assert not local[bad_block * 128:(bad_block + 1) * 128].any(), rank
    return True


@pytest.mark.slow  # multi-process
def test_a_damaged_block_fails_a_cooperative_load_on_every_rank_before_reaching_a_target(tmp_path):
    assert run_ranks(2, _cooperative_corrupt_block, str(tmp_path)) == [True, True]
