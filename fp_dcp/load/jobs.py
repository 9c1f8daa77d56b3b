"""A load's read items turned into jobs: :class:`ItemPlanner` takes one
``ReadItem`` (or a box of a stored chunk, for shared reads) and returns
:class:`Job` s, which :mod:`fp_dcp.load.execute` runs."""

# Runs are read straight into the target tensor wherever it is a CPU tensor
# of the stored dtype (direct_jobs); many small runs whose gaps hold no whole
# alignment block are read as a few ranges into the temporary buffer and moved
# with strided copies (unit_jobs); targets of another dtype or device are read
# into the temporary buffer and cast with copy_ (packed_temp_jobs, or unit_jobs
# with torch_copier).

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from fp_dcp import format as fmt
from fp_dcp.load import objects
from fp_dcp.load.plan import (
    Grid,
    box_grid,
    level_span,
    map_ranges,
    merge_level,
    split_box,
    split_runs,
    strides_non_overlapping,
    unit_starts,
)

__all__ = ["Job", "Limits", "ExtentTable", "ItemPlanner", "storage_bytes", "whole_chunk_read", "MERGE_RUN_MAX_BYTES",
           "MAX_BATCH_PIECES"]

# Runs at least this long are always read straight into their target: the
# per-run cost (one memoryview, one engine piece) is negligible beside them,
# and a copy through the arena would cost more than it saves.  Also the run
# length above which shared reads see no fragmentation worth sharing.
MERGE_RUN_MAX_BYTES = 64 << 10
# A sub-grid is read through the arena only if that saves this many runs:
# below it the strided copy's set-up costs about what the runs would.
_MERGE_MIN_RUNS = 16
# Runs longer than this are cut, so one engine call (and one progress step)
# stays bounded.
_MAX_PIECE_BYTES = 64 << 20
# The most pieces one engine call takes (the executor batches by it too):
# bounds the per-call arrays and memoryview lists.
MAX_BATCH_PIECES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Limits:
    """What planning needs to know of the executor: the engine's
    ``alignment``, ``cap`` (the most arena one job takes: a quarter of the
    read buffer budget), the data files' sizes (an aligned read is clamped
    to a file's end) and the over-read budget as a fraction."""

    alignment: int
    cap: int
    file_sizes: np.ndarray
    max_overread: float


class Job:
    """Pieces (file, offset, length, position) read into ``buf`` or, with
    ``temp`` > 0, into the arena; then ``post`` and the ``done`` callbacks.
    ``paid``: over-read charged to the load's budget; ``cuda``: the CUDA
    device ``post`` copies to (asynchronously, from the arena), or None."""

    __slots__ = ("files", "offs", "lens", "pos", "buf", "temp", "post", "needed", "done", "temp_off", "units",
                 "paid", "cuda")

    def __init__(self, files, offs, lens, pos, *, buf=None, temp=0, post=None, needed=0, done=None, units=0):
        self.files, self.offs, self.lens, self.pos = files, offs, lens, pos
        self.buf, self.temp, self.post, self.needed = buf, temp, post, needed
        self.units = units  # ranges read whole into the arena
        self.done = [] if done is None else [done]
        self.temp_off = 0
        self.paid = 0
        self.cuda: torch.device | None = None

    @classmethod
    def empty(cls, done=None) -> "Job":
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, z, done=done)

    def add_done(self, fn: Callable[[], None]) -> None:
        self.done.append(fn)


class ExtentTable:
    """Every extent of a layout in one ``(4, n)`` int64 array (item offset,
    length, file, file offset), with each item's rows and whether its extents
    tile it exactly, checked for all items at once."""

    def __init__(self, extents: Mapping[MetadataIndex, list[fmt.Extent]]) -> None:
        columns = fmt.ExtentColumns.of(extents)
        keys, counts = columns.item_keys, columns.counts
        self.rows = np.stack([columns.item_offset, columns.length, columns.file, columns.file_offset])
        n = self.rows.shape[1]
        ends = np.cumsum(counts)
        starts = ends - counts
        io_, ln = self.rows[0], self.rows[1]
        # within an item, each extent starts where the one before it ends;
        # the first starts at 0 (an item with no extents holds 0 bytes)
        follows = np.ones(n, dtype=bool)
        if n > 1:
            follows[1:] = io_[1:] == io_[:-1] + ln[:-1]
        nonempty = counts > 0
        follows[starts[nonempty]] = io_[starts[nonempty]] == 0
        bad = np.zeros(len(keys), dtype=np.int64)
        totals = np.zeros(len(keys), dtype=np.int64)
        if n:
            bad[nonempty] = np.add.reduceat((~follows).astype(np.int64), starts[nonempty])
            totals[nonempty] = np.add.reduceat(ln, starts[nonempty])
        # each item's rows and total bytes (-1: its extents do not tile its range)
        self._where = dict(zip(keys, zip(starts.tolist(), ends.tolist(), np.where(bad == 0, totals, -1).tolist())))

    def nbytes(self, key: MetadataIndex) -> int | None:
        """The bytes ``key``'s extents hold, or None when it has none or
        they do not tile a range from 0."""
        where = self._where.get(fmt.item_key(key))
        return None if where is None or where[2] < 0 else where[2]

    def get(self, key: MetadataIndex, nbytes: int) -> tuple[np.ndarray, ...] | None:
        """The four columns of ``key``'s extents (views), or None when it has
        none or they do not tile ``[0, nbytes)`` exactly."""
        where = self._where.get(fmt.item_key(key))
        if where is None or where[2] != nbytes:
            return None
        a, b, _ = where
        rows = self.rows
        return rows[0, a:b], rows[1, a:b], rows[2, a:b], rows[3, a:b]


class ItemPlanner:
    """The jobs of a checkpoint's read items (``layout`` and
    ``state_dict_metadata`` of the checkpoint at ``path``, named in errors).
    The stored extents of each item are looked up once and kept."""

    def __init__(self, layout: fmt.StorageLayout, state_dict_metadata: dict[str, Any], path: str, *,
                 strict_dtype: bool, allow_pickle: bool) -> None:
        self.layout = layout
        self.state_dict_metadata = state_dict_metadata
        self.path = path
        self.strict_dtype = strict_dtype
        self.allow_pickle = allow_pickle
        self._table: ExtentTable | None = None  # made on first use, from layout.extents

    def chunk_sizes(self, fqn: str, chunk: Any) -> tuple[list[int], torch.dtype]:
        """The stored chunk's shape and dtype (``chunk``: its offsets, or None)."""
        md = self.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise fmt.CheckpointFormatError(f"{self.path}: {fqn} is not a tensor in the checkpoint")
        want = None if chunk is None else tuple(chunk)  # torch.Size is a tuple: compared without lists
        for c in md.chunks:
            if want is None or tuple(c.offsets) == want:
                return list(c.sizes), md.properties.dtype
        raise fmt.CheckpointFormatError(f"{self.path}: {fqn}: the checkpoint has no chunk at {list(chunk)}")

    def _extent_table(self) -> ExtentTable:
        if self._table is None:
            self._table = ExtentTable(self.layout.extents)
        return self._table

    def extents(self, fqn: str, chunk: Any, nbytes: int, key: MetadataIndex | None = None) -> tuple[np.ndarray, ...]:
        """The item's extents as arrays (item offsets, lengths, files, file offsets: views of one
        table of every extent, :class:`ExtentTable`); ``key``: its ``MetadataIndex`` where the
        caller has it (a read item's).  Raises unless they tile ``nbytes`` exactly."""
        if key is None:
            key = MetadataIndex(fqn, chunk)
        arrays = self._extent_table().get(key, nbytes)
        if arrays is None:
            exts = self.layout.extents.get(key)
            if exts is None:
                raise fmt.CheckpointFormatError(
                    f"{self.path}: no stored bytes for {fqn}"
                    + ("" if chunk is None else f" (chunk at {list(chunk)})")
                    + "; the checkpoint metadata is inconsistent"
                )
            fmt.check_extents_cover(fqn, exts, nbytes)  # raises, naming the gap or overlap
            raise AssertionError(f"{fqn}: ExtentTable refused extents that check_extents_cover accepts")
        return arrays

    def plan_item(self, req: ReadItem, planner: LoadPlanner, limits: Limits) -> list[Job]:
        """The jobs of one read item; the last hands the result to ``planner``."""
        fqn, chunk = req.storage_index.fqn, req.storage_index.offset
        if req.type == LoadItemType.BYTE_IO:
            nbytes = self._extent_table().nbytes(req.storage_index)
            if nbytes is None:  # no extents, or they do not tile: self.extents says what is wrong
                nbytes = sum(e.length for e in self.layout.extents.get(MetadataIndex(fqn, chunk)) or [])
            arrays = self.extents(fqn, chunk, nbytes)
            buf = np.empty(nbytes, dtype=np.uint8)
            done = lambda: self._load_object(req, planner, buf.tobytes())  # noqa: E731
            if nbytes == 0:
                return [Job.empty(done=done)]
            rng, within, files, offs, lens = map_ranges(np.zeros(1, np.int64), np.array([nbytes]), *arrays)
            return [Job(files, offs, lens, within, buf=buf, needed=nbytes, done=done)]
        sizes, dtype = self.chunk_sizes(fqn, chunk)
        dest = self.target(req, planner, dtype)
        commit = lambda: planner.commit_tensor(req, dest)  # noqa: E731
        return self.plan_box(fqn, chunk, sizes, dtype, list(req.storage_offsets), list(req.lengths), dest, limits,
                             commit, key=req.storage_index)

    def _load_object(self, req: ReadItem, planner: LoadPlanner, data: bytes) -> None:
        """A bytes item's object, rebuilt safely (:mod:`fp_dcp.load.objects`), to the planner."""
        key = req.storage_index.fqn
        obj = objects.load_object(data, key, str(self.path), self.allow_pickle)
        objects.deliver_object(planner, req, obj, data)

    def target(self, req: ReadItem, planner: LoadPlanner, stored: torch.dtype) -> torch.Tensor:
        """The planner's target tensor of ``req``, checked: a tensor, its
        shape, and its dtype against ``strict_dtype``."""
        dest = planner.resolve_tensor(req)
        if not isinstance(dest, torch.Tensor):
            raise fmt.CheckpointFormatError(
                f"{self.path}: {req.storage_index.fqn!r} is stored as a tensor ({stored}), but the state dict "
                f"being loaded holds a {type(dest).__name__} under {req.dest_index.fqn!r}; refusing to load "
                f"a tensor into it"
            )
        dest = dest.detach()
        if dest.shape != tuple(req.lengths):  # torch.Size is a tuple
            raise ValueError(
                f"{req.dest_index.fqn}: the planner's target has shape {list(dest.shape)}, "
                f"the read needs {list(req.lengths)}"
            )
        if dest.dtype != stored and self.strict_dtype:
            raise TypeError(
                f"{req.dest_index.fqn}: the checkpoint stores {req.storage_index.fqn} as {stored}, the "
                f"target tensor is {dest.dtype}; FastPersistOptions.strict_dtype=True refuses to cast. Load "
                f"into a {stored} tensor, or set strict_dtype=False to cast as the stock reader does"
            )
        return dest

    def plan_box(self, fqn, chunk, sizes, dtype, offsets, lengths, dest, limits: Limits, commit,
                 key: MetadataIndex | None = None) -> list[Job]:
        """Jobs that read box ``offsets+lengths`` of a stored chunk into ``dest``
        (``key``: the chunk's ``MetadataIndex``, where the caller has it)."""
        esize = dtype.itemsize
        arrays = self.extents(fqn, chunk, math.prod(sizes) * esize, key)
        needed = math.prod(lengths) * esize
        if needed == 0:
            return [Job.empty(done=commit)]
        if whole_chunk_read(sizes, dtype, offsets, lengths, dest):
            # The common case, planned without a grid: a whole stored chunk
            # into a contiguous target of its dtype, one run, whose pieces
            # are the chunk's extents (what direct_jobs would make of it).
            item_offsets, lens, files, offs = arrays
            return [Job(files, offs, lens, item_offsets, buf=dest.reshape(-1).view(torch.uint8).numpy(),
                        needed=needed, done=commit)]
        if whole_chunk_to_device(sizes, dtype, offsets, lengths, dest, limits.cap):
            # The same on a GPU: the chunk's extents into the arena, then one copy_.
            item_offsets, lens, files, offs = arrays
            a = limits.alignment
            job = Job(files, offs, lens, item_offsets, temp=-(-needed // a) * a,
                      post=arena_copier(dest, dtype, needed), needed=needed, done=commit, units=1)
            job.cuda = dest.device if dest.is_cuda else None
            return [job]
        in_place = (
            dest.device.type == "cpu"
            and dest.dtype == dtype
            and not dest.is_conj()
            and not dest.is_neg()
            and strides_non_overlapping(dest.shape, dest.stride())
        )
        if in_place:
            grid = box_grid(sizes, offsets, lengths, esize, dest.stride())
            buf = storage_bytes(dest)
            level, paid = _merge_level(grid, limits)
            if level is None:
                jobs = direct_jobs(grid, arrays, buf, needed)
            else:
                jobs = unit_jobs(grid, level, arrays, limits, needed, numpy_copier(buf, grid, level, esize))
                jobs[0].paid += paid
            jobs[-1].add_done(commit)
            return jobs
        # another dtype or device, or a target that overlaps itself: through a
        # temporary, bounded by the budget, and copy_ (which casts).
        jobs = []
        dgrid = box_grid(sizes, offsets, lengths, esize, dest.stride())
        level, paid = (_merge_level(dgrid, limits) if strides_non_overlapping(dest.shape, dest.stride())
                       else (None, 0))
        if level is not None:
            jobs = unit_jobs(dgrid, level, arrays, limits, needed, torch_copier(dest, dtype, dgrid, level))
            jobs[0].paid += paid
        else:
            for sub_off, sub_len in split_box(lengths, esize, limits.cap):
                sub_needed = math.prod(sub_len) * esize
                grid = box_grid(sizes, [o + s for o, s in zip(offsets, sub_off)], sub_len, esize)
                target = dest[tuple(slice(s, s + n) for s, n in zip(sub_off, sub_len))]
                jobs.extend(packed_temp_jobs(grid, arrays, sub_needed, target, dtype, limits))
        if dest.is_cuda:
            for j in jobs:
                j.cuda = dest.device
        jobs[-1].add_done(commit)
        return jobs


def whole_chunk_read(sizes, dtype: torch.dtype, offsets, lengths, dest: torch.Tensor) -> bool:
    """Whether a read is a whole chunk into a contiguous CPU target of its dtype,
    read as whole extents (so ``verify_checksums`` checks every block: the
    tiers' restore relies on it)."""
    return dest.device.type == "cpu" and _whole_chunk(sizes, dtype, offsets, lengths, dest, _MAX_PIECE_BYTES)


def whole_chunk_to_device(sizes, dtype: torch.dtype, offsets, lengths, dest: torch.Tensor, cap: int) -> bool:
    """Whether a read is a whole chunk of at most ``cap`` bytes into a
    contiguous target of its dtype on an accelerator."""
    return dest.device.type != "cpu" and _whole_chunk(sizes, dtype, offsets, lengths, dest, cap)


def _whole_chunk(sizes, dtype: torch.dtype, offsets, lengths, dest: torch.Tensor, cap: int) -> bool:
    """The whole chunk, at most ``cap`` bytes, into a contiguous target of its
    dtype (on any device)."""
    if type(lengths) is not list:
        lengths = [int(n) for n in lengths]
    if type(sizes) is not list:
        sizes = [int(n) for n in sizes]
    return (lengths == sizes and not any(offsets) and math.prod(lengths) * dtype.itemsize <= cap
            and dest.dtype == dtype and dest.is_contiguous() and not dest.is_conj() and not dest.is_neg())


def _merge_level(grid: Grid, limits: Limits) -> tuple[int | None, int]:
    """The level at which sub-grids are read through a temporary (None: straight
    into the target), and the over-read that costs."""
    g = len(grid.counts)
    if g == 0 or grid.run >= MERGE_RUN_MAX_BYTES:
        return None, 0
    level, paid = merge_level(grid, limits.alignment, limits.max_overread)
    if level == g or math.prod(grid.counts[level:]) < _MERGE_MIN_RUNS:
        return None, 0
    return level, paid


def storage_bytes(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of the memory from ``t``'s first element to
    its last (``t`` on the CPU, non-negative strides)."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    flat = t.as_strided((span,), (1,), t.storage_offset())
    return flat.view(torch.uint8).numpy()


def direct_jobs(grid: Grid, arrays, buf: np.ndarray, needed: int) -> list[Job]:
    """Every run straight into the target's bytes (cut at extents and at
    ``_MAX_PIECE_BYTES``), one job per ``MAX_BATCH_PIECES // 2`` runs."""
    src, dst, _ = unit_starts(grid, len(grid.counts))
    src, dst, lens = split_runs(src, dst, grid.run, _MAX_PIECE_BYTES)
    jobs = []
    step = MAX_BATCH_PIECES // 2
    for a in range(0, len(src), step):
        s, d, n = src[a : a + step], dst[a : a + step], lens[a : a + step]
        rng, within, files, offs, plen = map_ranges(s, n, *arrays)
        jobs.append(Job(files, offs, plen, d[rng] + within, buf=buf, needed=int(n.sum())))
    return jobs


def _unit_spans(grid: Grid, level: int, cnt: np.ndarray) -> np.ndarray:
    if level == len(grid.counts):
        return np.full(len(cnt), grid.run, dtype=np.int64)
    inner = level_span(grid, level + 1)
    return (cnt - 1) * grid.src_strides[level] + inner


def _slab_level(grid: Grid, level: int, cap: int) -> tuple[int, int | None]:
    """A level at or inside ``level`` whose sub-grids can be cut along their
    outer dimension into slabs of at most ``cap`` bytes; the slab length."""
    g = len(grid.counts)
    while level < g:
        inner = level_span(grid, level + 1)
        if inner <= cap:
            stride = grid.src_strides[level]
            return level, max(1, (cap - inner) // stride + 1)
        level += 1
    return g, None


def unit_jobs(grid: Grid, level: int, arrays, limits: Limits, needed: int, copier) -> list[Job]:
    """Sub-grids over dimensions ``level..`` read as whole ranges into the
    arena (aligned, so large ones are read without a bounce copy), then moved
    by ``copier(arena, arena_offset, unit_offsets, dst_starts, counts)``."""
    a = limits.alignment
    level, slab = _slab_level(grid, level, limits.cap)
    src, dst, cnt = unit_starts(grid, level, slab)
    spans = _unit_spans(grid, level, cnt)
    runs_per_index = math.prod(grid.counts[level + 1 :]) if level < len(grid.counts) else 1
    rng, within, files, offs, lens = map_ranges(src, spans, *arrays)
    # a unit that is one piece of one file is widened to aligned bounds
    # (clamped to the file's end) so the engine can read it in place
    one = np.bincount(rng, minlength=len(src)) == 1
    head = np.zeros(len(src), dtype=np.int64)
    wide = np.array(spans, dtype=np.int64)
    single = one[rng]
    p_head = np.where(single, offs % a, 0)
    p_end = np.where(single, np.minimum(-(-(offs + lens) // a) * a, limits.file_sizes[files]), offs + lens)
    head[rng[single]] = p_head[single]
    wide[rng[single]] = (p_end - (offs - p_head))[single]
    sizes = -(-wide // a) * a
    unit_off = np.cumsum(sizes) - sizes
    jobs = []
    start = 0
    n = len(src)
    piece_start = np.searchsorted(rng, np.arange(n + 1), side="left")
    while start < n:
        # as many units as fit in one cap of arena
        end = int(np.searchsorted(unit_off + sizes, unit_off[start] + limits.cap, side="right"))
        end = max(end, start + 1)
        p0, p1 = piece_start[start], piece_start[end]
        base = int(unit_off[start])
        r = rng[p0:p1]
        pos = unit_off[r] - base + np.where(single[p0:p1], 0, head[r] + within[p0:p1])
        j_offs = offs[p0:p1] - p_head[p0:p1]
        j_lens = p_end[p0:p1] - j_offs
        u_off = unit_off[start:end] - base + head[start:end]
        d, c = dst[start:end], cnt[start:end]
        job_needed = int(c.sum()) * runs_per_index * grid.run

        def post(arena: Any, arena_off: int, u_off: np.ndarray = u_off, d: np.ndarray = d,
                 c: np.ndarray = c) -> None:
            copier(arena, arena_off, u_off, d, c)

        jobs.append(Job(files[p0:p1], j_offs, j_lens, pos, temp=int(unit_off[end - 1] + sizes[end - 1]) - base,
                        post=post, needed=job_needed, units=end - start))
        start = end
    return jobs


def _unit_shape(grid: Grid, level: int, count: int,
                esize: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Shape and source / destination strides (units of ``esize`` bytes) of a
    sub-grid over ``level..`` with ``count`` indices of its outer dimension."""
    g = len(grid.counts)
    shape = tuple([count] + list(grid.counts[level + 1 :])) if level < g else ()
    ss = tuple(s // esize for s in grid.src_strides[level:]) if level < g else ()
    ds = tuple(s // esize for s in grid.dst_strides[level:]) if level < g else ()
    return shape + (grid.run // esize,), ss + (1,), ds + (1,)


def numpy_copier(buf: np.ndarray, grid: Grid, level: int, esize: int):
    """Strided copies from the arena into the target's bytes, whole elements
    at a time (a transposed target has one-element runs)."""
    kind = np.dtype(f"u{esize}") if esize in (1, 2, 4, 8) else np.dtype(f"V{esize}")
    strides = _unit_shape(grid, level, 1, esize)

    def copy(arena, arena_off: int, u_off, dst, cnt) -> None:
        for o, d, c in zip(u_off.tolist(), dst.tolist(), cnt.tolist()):
            shape = (c,) + strides[0][1:] if level < len(grid.counts) else strides[0]
            ss = tuple(x * esize for x in strides[1])
            ds = tuple(x * esize for x in strides[2])
            src = np.ndarray(shape, kind, arena.np, arena_off + o, ss)
            np.copyto(np.ndarray(shape, kind, buf, d, ds), src)

    return copy


def torch_copier(dest: torch.Tensor, dtype: torch.dtype, grid: Grid, level: int):
    """Strided copies from the arena (stored dtype) into ``dest`` (any dtype or
    device): ``copy_`` casts as the stock reader does.  A copy to a CUDA
    device is queued on its current stream (the load waits for it before
    the arena is read into again)."""
    esize = dtype.itemsize
    cuda = dest.is_cuda

    def copy(arena, arena_off: int, u_off, dst, cnt) -> None:
        typed = arena.typed(dtype)
        for o, d, c in zip(u_off.tolist(), dst.tolist(), cnt.tolist()):
            shape, ss, ds = _unit_shape(grid, level, c, esize)
            src = typed.as_strided(shape, ss, (arena_off + o) // esize)
            dest.as_strided(shape, ds, dest.storage_offset() + d // esize).copy_(src, non_blocking=cuda)

    return copy


def packed_temp_jobs(grid: Grid, arrays, needed: int, target: torch.Tensor, dtype: torch.dtype,
                     limits: Limits) -> list[Job]:
    """Runs into a packed temporary of the stored dtype, then ``target.copy_``."""
    src, dst, _ = unit_starts(grid, len(grid.counts))
    rng, within, files, offs, lens = map_ranges(src, np.full(len(src), grid.run, dtype=np.int64), *arrays)
    a = limits.alignment
    return [Job(files, offs, lens, dst[rng] + within, temp=-(-needed // a) * a,
                post=arena_copier(target, dtype, needed), needed=needed, units=1)]


def arena_copier(target: torch.Tensor, dtype: torch.dtype, needed: int):
    """``post`` of a job that read ``target``'s packed bytes (stored dtype)
    into the arena: one ``copy_`` (which casts); to a CUDA device queued on its
    current stream, waited for as :func:`torch_copier`'s are."""
    esize = dtype.itemsize
    shape = tuple(target.shape)

    def post(arena, arena_off: int) -> None:
        t = arena.typed(dtype).narrow(0, arena_off // esize, needed // esize).view(shape)
        target.copy_(t, non_blocking=target.is_cuda)

    return post
