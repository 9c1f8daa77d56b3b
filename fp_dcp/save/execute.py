"""One rank's write (:func:`write_rank`): its pieces into one host file and one
CUDA file per device, one thread per device; the caller's ``with_results``
work runs while the last batch is written (one device, many pieces) or while
the files are synced; staged checksums are reused."""

from __future__ import annotations

import concurrent.futures
import io
import os
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from fp_dcp import _native
from fp_dcp import format as fmt
from fp_dcp.checksums import crc_hex, piece_checksums
from fp_dcp.engine import IOSession, tensor_bytes
from fp_dcp.gc_freeze import paused
from fp_dcp.options import FastPersistOptions
from fp_dcp.save import balance
from fp_dcp.save.commit import sync_directory
from fp_dcp.save.device_copy import write_cuda
from fp_dcp.save.layout import align_up, place_extents
from fp_dcp.save.plan import Assignment, expected_nbytes, item_name
from fp_dcp.save.recycle import open_recycled
from fp_dcp.save.results import RankResults, add_stats
from fp_dcp.staging.crc_registry import any_staged_checksums, forget_staged_checksums, staged_checksums

__all__ = ["write_rank"]


def write_rank(
    assignment: Assignment,
    items: list[WriteItem],
    resolve_data: Callable[[WriteItem], Any],
    *,
    dirs: list[tuple[str, bool]],
    session_for: Callable[[str], IOSession],
    tag_devices: bool,
    options: FastPersistOptions,
    while_writing: Callable[[], None] | None = None,
    with_results: Callable[[RankResults], None] | None = None,
) -> tuple[RankResults, dict[str, Any]]:
    """Write rank ``assignment.rank``'s pieces of ``items`` (resolved by
    ``resolve_data``) into ``dirs`` (by device), each through
    ``session_for(directory)``.  ``while_writing()`` runs (on a thread that
    would wait) once the last host batch is resolved, while a batch is written;
    ``with_results(results)`` as soon as the results are known: a one-device
    write of many pieces checksums its last batch (a short tail) beside the
    engine and makes the results while that batch is written, any other while
    the files are made durable (what either hook raises fails the write).
    Returns the results and the statistics once every file is durable."""
    t0 = time.perf_counter()
    rank = assignment.rank
    pieces = assignment.pieces
    assert pieces is not None
    if assignment.n_items != len(items):
        raise RuntimeError(
            f"rank {rank}: the global plan was made for {assignment.n_items} items of this rank, "
            f"but its prepare_local_plan recorded {len(items)} (was the writer reused by another save?)"
        )
    sources = _Sources(items, resolve_data)
    resolve_s = 0.0

    def resolved(which: np.ndarray) -> tuple[list, list]:
        """The pieces ``which`` (indices, in order) resolved:
        ([(item, item_offset, host bytes)], [(item, item_offset, CUDA bytes)])."""
        nonlocal resolve_s
        t = time.perf_counter()
        out: tuple[list, list] = ([], [])
        with paused():  # a few objects per item, no cyclic garbage: no collections walking them
            for li, off, length in zip(
                pieces.local[which].tolist(), pieces.offset[which].tolist(), pieces.length[which].tolist()
            ):
                kind, buf = sources.get(li)
                n = len(buf) if kind == "cpu" else int(buf.numel())
                if length == balance.UNSIZED:
                    off, length = 0, n
                if off + length > n:
                    raise RuntimeError(
                        f"{item_name(items[li])}: the plan assigns bytes {off}..{off + length} of an item of {n} bytes"
                    )
                # a whole item is passed as it is (no slice object to make)
                piece = buf if off == 0 and length == n else buf[off : off + length]
                out[0 if kind == "cpu" else 1].append((li, off, piece))
        resolve_s += time.perf_counter() - t
        return out

    devices = sorted(set(pieces.device.tolist()))
    if any(d >= len(dirs) for d in devices):
        raise RuntimeError(f"rank {rank}: the plan uses device {max(devices)} but this rank has {len(dirs)}")
    # device -> (batches of host pieces, CUDA pieces): with one device and
    # many pieces, they are resolved batch by batch while the batch before is written
    by_device: dict[int, tuple[Iterable[tuple[list, bool]], list]] = {}
    batched = len(devices) == 1 and len(pieces) >= _BATCHED_PIECES
    if batched:
        cuda: list = []
        by_device[devices[0]] = (_batches(resolved, pieces.length, cuda), cuda)
    else:
        for d in devices:
            cpu, cuda = resolved(np.flatnonzero(pieces.device == d))
            by_device[d] = ([(cpu, True)] if cpu else [], cuda)
    if not devices and while_writing is not None:
        while_writing()  # nothing to write on this rank

    used: set[int] = set()  # arenas whose staging checksums this save used
    unsynced: dict[int, list[tuple[int, str]]] = {d: [] for d in devices}  # device -> its open host files
    recycled: list[tuple[int, str, int]] = []  # (fd, path, size) of the host files written over a retired file
    early: list[RankResults] = []  # the results, made while the last batch is written

    def results_early(done: tuple) -> None:
        with paused():  # one result per item, no cyclic garbage
            out = _results(items, [done], {"bytes": 0, "requests": 0})  # (the statistics come with the write)
        if with_results is not None:
            with_results(out)
        early.append(out)

    def write_device(dev: int):
        directory, by_path = dirs[dev]
        return _write_device(
            session_for(directory), directory, by_path, by_device[dev], sources,
            assignment.save_id, rank, dev if tag_devices else None, options, used, unsynced[dev],
            while_writing if dev == devices[0] else None, results_early if batched else None,
            "" if by_path else assignment.recycle, recycled,
        )

    stats: dict[str, Any] = {"engine": None, "direct_io": None, "bytes": 0, "requests": 0,
                             "staged_checksum_bytes": 0}
    try:
        try:
            if len(devices) > 1:  # one thread per device: the engine releases the GIL
                with concurrent.futures.ThreadPoolExecutor(len(devices), thread_name_prefix="fp_dcp-device") as pool:
                    done = list(pool.map(write_device, devices))
            else:
                done = [write_device(d) for d in devices]
        finally:
            forget_staged_checksums(used)  # they belong to this save only
        for fd, path, size in recycled:  # (its writes have ended) the retired file's bytes past this one's end
            try:
                os.ftruncate(fd, size)
            except OSError as e:
                raise OSError(e.errno, f"{e.strerror} (ftruncate of a recycled data file)", path) from None
        # Each device's files are made durable on a thread of its own (the
        # calls release the GIL) while this thread makes the results.
        syncs = concurrent.futures.ThreadPoolExecutor(max(1, len(devices)), thread_name_prefix="fp_dcp-sync")
        with syncs:
            durable = [
                syncs.submit(_sync_device, unsynced[d], *dirs[d]) for d in devices if options.sync_files
            ]
            try:
                if early:  # made while the last batch was written (with_results has run)
                    results = early[0]
                    _device_stats(done, stats)
                else:
                    with paused():  # one result per item, no cyclic garbage
                        results = _results(items, done, stats)
                    if with_results is not None:
                        with_results(results)
            finally:
                t_wait = time.perf_counter()
                concurrent.futures.wait(durable)
                stats["sync_wait_seconds"] = time.perf_counter() - t_wait
            stats["sync_seconds"] = max((f.result() for f in durable), default=0.0)  # raises a failed sync
    finally:
        for files in unsynced.values():
            for fd, _ in files:
                os.close(fd)
    if stats["engine"] is None:  # nothing to write on this rank
        session = session_for(dirs[0][0])
        stats["engine"], stats["direct_io"] = session.kind, session.direct
    seconds = time.perf_counter() - t0
    stats.update(
        seconds=seconds,
        resolve_seconds=resolve_s,
        gbps=stats["bytes"] / seconds / 1e9 if seconds > 0 else 0.0,
        items=len(results),
        pieces=len(pieces),
        devices=len(devices),
    )
    return results, stats


def _results(items: list[WriteItem], done: list[tuple], stats: dict[str, Any]) -> RankResults:
    """DCP's write results, one per item written, in item order, from each
    device's extents; adds each device's statistics to ``stats``."""
    _device_stats(done, stats)
    sizes: dict[str, int] = {}
    for _, file_sizes, _, _, _ in done:
        sizes.update(file_sizes)
    return RankResults.of_rows([item.index for item in items], [e for extents, *_ in done for e in extents], sizes)


def _device_stats(done: list[tuple], stats: dict[str, Any]) -> None:
    """Add each device's statistics (of :func:`_write_device`'s ``done``) to ``stats``."""
    for _, _, s, kind, direct in done:
        stats["engine"], stats["direct_io"] = kind, direct
        add_stats(stats, s)


# A one-device write of at least _BATCHED_PIECES pieces resolves them in
# batches, each written while the next is resolved: the first of this many
# bytes (the disk starts early), each next at most _BATCH_GROWTH times the one
# before (the resolving, ~15 us a piece, keeps ahead of the disk), so a save
# of thousands of small tensors makes a few engine calls instead of waiting
# for every piece first.  Fewer pieces resolve in a few ms: one call.  The
# last batch is the last 1/_TAIL_PARTS of the bytes: while it is written, the
# writer checksums it and makes the save's results (see _write_device).
_BATCHED_PIECES = 512
_FIRST_BATCH_BYTES = 16 << 20
_BATCH_GROWTH = 8
_TAIL_PARTS = 16


def _batches(resolved: Callable[[np.ndarray], tuple[list, list]], lengths: np.ndarray,
             cuda: list) -> Iterator[tuple[list, bool]]:
    """The host pieces in batches of growing size (``resolved`` of consecutive
    pieces, by ``lengths``), the last from the piece that starts the last
    1/_TAIL_PARTS of the bytes, each with whether it is the last; the CUDA
    pieces are added to ``cuda`` as they come."""
    sizes = np.maximum(lengths, 0)
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    tail = int(np.searchsorted(ends - sizes, total - total // _TAIL_PARTS, side="left"))  # its first piece
    at, goal = 0, _FIRST_BATCH_BYTES
    while at < len(lengths):
        done = int(ends[at - 1]) if at else 0
        stop = max(at + 1, int(np.searchsorted(ends, done + goal, side="right")))
        stop = len(lengths) if at >= tail else min(stop, tail)
        host, device = resolved(np.arange(at, stop))
        cuda += device
        if host:
            yield host, stop == len(lengths)
        at, goal = stop, goal * _BATCH_GROWTH


class _Sources:
    """Each item's bytes, resolved once: ``("cpu", uint8 numpy array /
    memoryview)`` or ``("cuda", flat uint8 tensor)``."""

    def __init__(self, items: list[WriteItem], resolve_data: Callable[[WriteItem], Any]) -> None:
        self._items = items
        self._resolve_data = resolve_data
        self._sources: dict[int, tuple[str, Any]] = {}

    def get(self, li: int) -> tuple[str, Any]:
        if li in self._sources:
            return self._sources[li]
        item = self._items[li]
        data = self._resolve_data(item)
        name = item_name(item)
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise TypeError(f"{name}: the planner resolved a bytes item to {type(data).__name__}, not BytesIO")
            # its bytes, not a view of them (getbuffer): a view held by a
            # failed save's traceback keeps the BytesIO from being freed, and
            # Python 3.13 then reports a BufferError when the cycle is collected
            out: tuple[str, Any] = ("cpu", memoryview(data.getvalue()))
        else:
            if not isinstance(data, torch.Tensor):
                raise TypeError(f"{name}: the planner resolved a tensor item to {type(data).__name__}")
            expected = expected_nbytes(item)
            actual = data.numel() * data.element_size()
            if expected is not None and expected != actual:
                raise ValueError(
                    f"{name}: the planner planned {expected} bytes but resolved a tensor of "
                    f"{actual} bytes ({tuple(data.shape)}, {data.dtype})"
                )
            if data.is_cpu:
                out = ("cpu", tensor_bytes(data, name))
            elif data.is_cuda:
                t = data.detach()
                flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
                out = ("cuda", flat)
            else:
                out = ("cpu", tensor_bytes(data.detach().cpu(), name))
        self._sources[li] = out
        return out


def _write_device(
    session: IOSession,
    directory: str,
    by_path: bool,
    groups: tuple[Iterable[tuple[list, bool]], list],
    sources: _Sources,
    save_id: str,
    rank: int,
    tag: int | None,
    options: FastPersistOptions,
    used: set[int],
    unsynced: list[tuple[int, str]],
    while_writing: Callable[[], None] | None = None,
    results_early: Callable[[tuple], None] | None = None,
    recycle: str = "",
    recycled: list[tuple[int, str, int]] | None = None,
) -> tuple[list[tuple], list[tuple[str, int]], dict[str, Any], str, bool]:
    """One device's pieces into a file per kind in ``directory``: the host
    pieces batch by batch (each written on a thread while the next is
    resolved), then the CUDA pieces; the host file is left open and unsynced
    in ``unsynced``.  Returns extents, file sizes, stats and the engine's kind
    and direct-I/O flag.  ``while_writing()`` runs once the last host batch
    is resolved, while the batch before it (else it) is written.  With
    ``results_early`` and no CUDA pieces, the last batch's checksums are
    computed here while the engine writes it, and ``results_early`` gets
    what this returns (but the statistics) before that write ends.  ``recycle``:
    a retired checkpoint's data file to rename and write over as the host
    file (else a new file is made); the host file is then added to
    ``recycled`` with its size, for the caller to cut it to once written."""
    batches, cuda = groups
    extents: list[tuple] = []  # (item, file, file_offset, item_offset, length, crc32c)
    file_sizes: list[tuple[str, int]] = []
    stats: dict[str, Any] = {"bytes": 0, "requests": 0, "staged_checksum_bytes": 0}
    name = fmt.data_file_name(save_id, rank, 0, tag)
    path = os.path.join(directory, name)
    recorded = path if by_path else name
    end = 0
    fd = -1
    over = False  # the host file is a retired one, written over
    started = threading.Event()  # set as a batch's engine call lets the GIL go

    def write(batch: list, offsets: list[int], in_place: int, checksums: bool) -> list[tuple]:
        # the first batch's pieces written in place (while the bounce buffers
        # may still be being settled, on a thread from set-up) go in a call of
        # their own, which does not wait for it
        out = []
        for part, at in ((batch, offsets),) if not in_place else (
                (batch[:in_place], offsets[:in_place]), (batch[in_place:], offsets[in_place:])):
            crcs, s = _write_host_batch(session, fd, path, part, at, sources, options, used, checksums, started)
            add_stats(stats, s)
            out += [(li, recorded, fo, io_, len(b), crc) for (li, io_, b), fo, crc in zip(part, at, crcs)]
        return out

    pending: concurrent.futures.Future | None = None
    last: tuple | None = None  # the last batch and its offsets, when its checksums are made here
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fp_dcp-write") as writer:
        try:
            for batch, is_last in batches:  # the next batch is resolved here while the one before is written
                in_place = 0
                if fd < 0:
                    fd = open_recycled(recycle, directory, name, bool(session.direct)) if recycle else -1
                    over = fd >= 0
                    if not over:
                        fd = session.engine.open(path, "w", session.direct if session.direct else False)
                    unsynced.append((fd, path))
                    batch, in_place = _in_place_first(session.engine, batch)
                # each batch from a multiple of the request size: a write covers
                # whole blocks, and the batch's requests stay aligned to their
                # size (a request across that boundary is split on the way to
                # the disk: ~1.5 I/Os per request on a disk that charges per I/O)
                offsets, end = place_extents(
                    [len(b) for _, _, b in batch], session.alignment,
                    options.pack_threshold_bytes, options.pack_alignment_bytes,
                    start=align_up(end, session.engine.block_size),
                )
                if is_last and pending is not None and while_writing is not None:
                    while_writing()  # while the batch before is written
                    while_writing = None
                if pending is not None:
                    extents += pending.result()
                here = is_last and results_early is not None and not cuda
                started.clear()
                pending = writer.submit(write, batch, offsets, in_place, not here)
                if here:
                    last = (batch, offsets)
                # the engine's requests out before this thread takes the GIL
                # again (to resolve the next batch, or for while_writing)
                while not started.wait(0.05) and not pending.done():
                    pass
            if while_writing is not None:  # one batch, or none: while it is written
                while_writing()
            if last is not None:
                assert pending is not None and results_early is not None  # (pending: the last batch's write)
                batch, offsets = last
                crcs, staged_bytes = _checksums_beside(batch, sources, options, used)
                extents += [(li, recorded, fo, io_, len(b), crc) for (li, io_, b), fo, crc in zip(batch, offsets, crcs)]
                file_sizes.append((recorded, align_up(end, session.alignment)))
                if over and recycled is not None:
                    recycled.append((fd, path, file_sizes[-1][1]))
                results_early((extents, file_sizes, {}, session.kind, session.direct))
                pending.result()  # (its extents are those above, without checksums)
                stats["staged_checksum_bytes"] += staged_bytes
                return extents, file_sizes, stats, session.kind, session.direct
            if pending is not None:
                extents += pending.result()
        finally:
            if pending is not None:
                concurrent.futures.wait([pending])  # (a batch that failed to resolve: the write before ends first)
    if fd >= 0:
        file_sizes.append((recorded, align_up(end, session.alignment)))
        if over and recycled is not None:
            recycled.append((fd, path, file_sizes[-1][1]))
    if cuda:
        name = fmt.data_file_name(save_id, rank, 1, tag)
        path = os.path.join(directory, name)
        recorded = path if by_path else name
        offsets, lengths, end, crcs = write_cuda(
            session, path, [b for _, _, b in cuda], stats,
            chunk_bytes=options.cuda_chunk_bytes, checksums=options.write_checksums, sync=options.sync_files,
        )
        file_sizes.append((recorded, align_up(end, session.alignment)))
        extents += [
            (li, recorded, fo, io_, n, crc)
            for (li, io_, _), fo, n, crc in zip(cuda, offsets, lengths, crcs)
        ]
    return extents, file_sizes, stats, session.kind, session.direct


def _in_place_first(engine: Any, batch: list) -> tuple[list, int]:
    """A first batch, written while the bounce buffers may still be being
    settled: the pieces the engine writes in place first (in the file too:
    :func:`place_extents` gives a piece of at least ``pack_threshold_bytes``
    an aligned offset; where it does not, that call waits for the buffers:
    slower, not wrong), and how many (0: all or none, or the buffers are
    settled)."""
    if engine.pool_settled:
        return batch, 0
    first: list = []
    rest: list = []
    for p in batch:
        (first if engine.writes_in_place(p[2]) else rest).append(p)
    if not first or not rest:
        return batch, 0
    return first + rest, len(first)


def _write_host_batch(
    session: IOSession, fd: int, path: str, batch: list, offsets: list[int], sources: _Sources,
    options: FastPersistOptions, used: set[int], checksums: bool = True, started: threading.Event | None = None,
) -> tuple[list[str | None], dict[str, Any]]:
    """Write a batch of host pieces at ``offsets`` of ``fd``: each piece's
    ``Extent.crc32c`` (None without checksums, or with ``checksums=False``:
    the caller makes them) and the engine's statistics.  ``started`` is set
    as the engine lets the GIL go for the I/O."""
    lengths = [len(b) for _, _, b in batch]
    # The staging copy may have checksummed these bytes already
    # (an async save's arena): then the engine need not read them twice.
    # (a save that staged nothing: no look-ups)
    reuse = checksums and options.write_checksums and any_staged_checksums()
    if reuse:
        staged = [_staged_crc_hex(sources.get(li)[1], io_, len(b), used) for li, io_, b in batch]
        # ... or most of them: the rest (pickled values, tensors
        # the staging copy did not checksum) are checksummed here.
        missing = [i for i, c in enumerate(staged) if c is None]
        reuse = 2 * sum(lengths[i] for i in missing) <= sum(lengths)
    if reuse:
        for i, c in zip(missing, _crc_hex_many([batch[i][2] for i in missing])):
            staged[i] = c
    s = session.write_fds(
        [fd],
        [path],
        np.zeros(len(batch), dtype=np.int64),
        np.asarray(offsets, dtype=np.int64),
        [b for _, _, b in batch],
        sync=False,  # the caller syncs it while it makes the results
        checksums=fmt.CHECKSUM_BLOCK_BYTES if checksums and options.write_checksums and not reuse else False,
        **({} if started is None else {"on_start": started.set}),
    )
    if reuse:
        s["staged_checksum_bytes"] = sum(lengths) - sum(lengths[i] for i in missing)
        return list[str | None](staged), s
    if "crc32c" in s:
        return list[str | None](piece_checksums(s, len(batch))), s
    return [None] * len(batch), s


def _checksums_beside(batch: list, sources: _Sources, options: FastPersistOptions,
                      used: set[int]) -> tuple[list[str | None], int]:
    """The ``Extent.crc32c`` of each host piece of ``batch``, made on this
    thread while the engine writes them without checksums (a staging copy's
    where it made them), and the bytes whose staged checksums were taken."""
    if not options.write_checksums:
        return [None] * len(batch), 0
    crcs: list[str | None] = [None] * len(batch)
    if any_staged_checksums():
        crcs = [_staged_crc_hex(sources.get(li)[1], io_, len(b), used) for li, io_, b in batch]
    staged_bytes = sum(len(b) for (_, _, b), c in zip(batch, crcs) if c is not None)
    missing = [i for i, c in enumerate(crcs) if c is None]
    for i, c in zip(missing, _crc_hex_many([batch[i][2] for i in missing])):
        crcs[i] = c
    return crcs, staged_bytes


def _crc_hex_many(buffers: list) -> list[str]:
    """Each buffer's ``Extent.crc32c``, in one native call."""
    crcs, first = _native.crc32c_many(buffers, fmt.CHECKSUM_BLOCK_BYTES)
    return piece_checksums({"crc32c": crcs, "crc32c_first": first}, len(buffers))


def _sync_device(files: list[tuple[int, str]], directory: str, by_path: bool) -> float:
    """``fdatasync`` a device's written host files (``(fd, path)``), then,
    for a data directory, sync its entries (the coordinator syncs the
    checkpoint directory's).  Returns the seconds it took."""
    t0 = time.perf_counter()
    for fd, path in files:
        try:
            os.fdatasync(fd)
        except OSError as e:
            raise OSError(e.errno, f"{e.strerror} (fdatasync)", path) from None
    if by_path:
        sync_directory(directory)  # the new files' entries
    return time.perf_counter() - t0


def _staged_crc_hex(item: Any, offset: int, length: int, used: set[int]) -> str | None:
    """``Extent.crc32c`` of a piece a staging copy already checksummed on its grid,
    else None; records the arena used in ``used``."""
    if length == 0:
        return crc_hex(np.zeros(1, dtype=np.uint32))  # as the engine reports an empty piece
    if not isinstance(item, np.ndarray):
        return None
    block = fmt.CHECKSUM_BLOCK_BYTES
    n = item.size
    if offset % block or (offset + length != n and length % block):
        return None
    hit = staged_checksums(item.__array_interface__["data"][0], n)
    if hit is None:
        return None
    base, crcs = hit
    used.add(base)
    first = offset // block
    return crc_hex(crcs[first : first - (-length // block)])
