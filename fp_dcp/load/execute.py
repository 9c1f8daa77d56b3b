"""Running a load's jobs (:mod:`fp_dcp.load.jobs`) through the engine:
:class:`Run` is one load on one rank (the open files, the temporary buffer,
the over-read budget, the stats); it is given the sessions, the verifier and
the progress callback, and knows nothing of DCP or of the reader."""

# Run.execute batches jobs into engine calls within the buffer budget, lets
# the planner's plan_fillers read through the gaps it may, checks checksums
# through the verifier, sends long runs to the engine of large requests, then
# runs each job's copies and callbacks and reports progress.

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from fp_dcp import _native, pinned
from fp_dcp.checksums import ReadVerifier
from fp_dcp.engine import IOSession
from fp_dcp.load.jobs import MAX_BATCH_PIECES, Job, Limits
from fp_dcp.load.plan import plan_fillers

__all__ = ["Run", "in_long_runs", "LONG_RUN_BYTES"]

# Bytes of one engine call.  Bounds the memoryviews and arrays of a call; with
# a progress callback, calls are smaller so progress moves in visible steps.
_MAX_BATCH_BYTES = 1 << 30
_PROGRESS_BATCH_BYTES = 256 << 20
# Requests sized by what they move: with the engine's shape left to fp_dcp,
# pieces in a run of at least this many bytes back to back (after the
# verifier's cuts) go to a second engine of large requests
# (engine.large_read_shape); shorter, scattered runs stay on the engine of
# many small requests in flight.  A device that charges per operation pays
# for small requests (docs/NATIVE.md, "Request sizes").
LONG_RUN_BYTES = 1 << 20
# With read_threads > 1, long runs are read by several engines of large
# requests at once (``Run``'s ``more``), each on its own thread: an engine
# copies each completed request out of its bounce buffer (fused with the
# checksum) on the thread that called it, so one engine copies on one core,
# which a device faster than a core's memcpy outruns (docs/NATIVE.md).  Each
# thread gets at least this many bytes of a batch: small loads stay on one.
_MIN_BYTES_PER_THREAD = 64 << 20


class TempBuffer:
    """The load's temporary memory: one aligned buffer, grown when a batch
    needs more (never past the budget, which the caller holds it to) and
    reused, seen as bytes (``np``) and as any dtype (:meth:`typed`).
    Registered with CUDA (``cudaHostRegister``) once a batch copies to a
    CUDA device, so those copies are DMA transfers that run beside the
    CPU's."""

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.buffer: Any = None
        self.cuda = False  # asked to register (whether or not it worked: a failure warns once)
        self.cuda_registered = False
        self.np: np.ndarray | None = None
        self._t: torch.Tensor | None = None
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    @property
    def size(self) -> int:
        return 0 if self.buffer is None else self.buffer.size

    def ensure(self, size: int, cuda: bool = False) -> bool:
        """Make it at least ``size`` bytes, registered with CUDA if ``cuda``;
        whether it was (re)allocated."""
        if self.buffer is not None and self.buffer.size >= size and self.cuda >= cuda:
            return False
        size = max(size, self.size)
        self.close()
        size = -(-size // (1 << 20)) * (1 << 20)  # whole MiB: every dtype views it
        self.buffer = _native.AlignedBuffer(size, max(self.alignment, 4096), lock=False)
        self.cuda = cuda
        if cuda:
            self.cuda_registered = pinned.cuda_register(self.buffer.address, size, "load's read buffer", portable=True)
        self.np = np.frombuffer(self.buffer, dtype=np.uint8)
        self._t = torch.frombuffer(self.buffer, dtype=torch.uint8)
        return True

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        t = self._typed.get(dtype)
        if t is None:
            assert self._t is not None
            t = self._typed[dtype] = self._t.view(dtype)
        return t

    def view(self) -> memoryview | None:
        return None if self.buffer is None else memoryview(self.buffer)

    def close(self) -> None:
        self._typed = {}
        self._t = None
        self.np = None
        if self.cuda_registered:
            pinned.cuda_unregister(self.buffer.address)
            self.cuda_registered = False
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


class Run:
    """The state of one load on one rank: open files, the arena, the stats.
    ``large`` / ``more``: engines of large requests for long runs (each ``more``
    on a thread of its own); ``budget``: the most arena memory; ``verifier``:
    the stored checksums, or None; ``progress(done, total)``: after each batch."""

    def __init__(self, session: IOSession, paths: list[str], limits: Limits, *, large: IOSession | None,
                 more: Sequence[IOSession] = (), budget: int, coalesce_gap: int, max_overread_percent: int,
                 verifier: ReadVerifier | None, progress: Callable[[int, int], None] | None) -> None:
        self.session = session
        self.paths = paths
        self.limits = limits
        self.alignment = session.alignment
        self.large = large
        self.more = list(more) if large is not None else []
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._stats_lock = threading.Lock()
        self.budget = budget
        self.coalesce_gap = coalesce_gap
        self.max_overread_percent = max_overread_percent
        self.verifier = verifier
        self.progress = progress
        self.fds: dict[int, int] = {}
        self.arena = TempBuffer(self.alignment)
        self.scratch = np.empty(max(2 * self.alignment, coalesce_gap), dtype=np.uint8)
        self.stats: dict[str, Any] = {
            "engine": session.kind,
            "bytes": 0,
            "bytes_read": 0,
            "requests": 0,
            "pieces": 0,
            "fillers": 0,
            "filler_bytes_paid": 0,
            "engine_calls": 0,
            "temp_bytes": 0,
            "temp_units": 0,
            "checksum_verified_bytes": 0,
            "checksum_bytes": 0,  # bytes the engine fed to the CRC (each read byte at most once)
            "large_request_bytes": 0,  # bytes moved by the engines of large requests (long runs)
            "direct_bytes": 0,  # bytes read in place, without a bounce copy
            "long_run_threads": 1,  # the most engines of large requests that read at once
            "read_seconds": 0.0,
            "copy_seconds": 0.0,
        }
        self.total = 0
        self.done_bytes = 0
        self.paid_left = 0

    def with_session(self, session: IOSession, large: IOSession | None) -> "Run":
        """Another run of the same load through ``session`` and ``large`` (an engine
        serves one thread at a time)."""
        return Run(session, self.paths, self.limits, large=large, budget=self.budget,
                   coalesce_gap=self.coalesce_gap, max_overread_percent=self.max_overread_percent,
                   verifier=self.verifier, progress=self.progress)

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        self.arena.close()

    def _engine_read(self, session: IOSession, files, offs, views, check) -> None:
        kwargs = check.engine_kwargs if check is not None else {}
        used, local = np.unique(files, return_inverse=True)
        fds = [self._fd(int(f)) for f in used.tolist()]
        s = session.engine.read(
            fds, [self.paths[int(f)] for f in used.tolist()], local.astype(np.int64), offs, views,
            coalesce_gap=0, **kwargs
        )
        verified = check.verify(s) if check is not None else 0
        with self._stats_lock:  # engine calls of long runs run on several threads
            self.stats["checksum_verified_bytes"] += verified
            self.stats["checksum_bytes"] += s.get("checksum_bytes", 0)
            self.stats["bytes_read"] += s.get("bytes_read", 0)
            self.stats["requests"] += s.get("requests", 0)
            self.stats["direct_bytes"] += s.get("direct_bytes", 0)
            if session is self.large or session in self.more:
                self.stats["large_request_bytes"] += s.get("bytes", 0)
            self.stats["engine_calls"] += 1

    def _read_long(self, files, offs, views, lens: np.ndarray, check) -> None:
        """Long runs, through the engine of large requests, or split into stretches
        of about equal bytes read at once by it and the ``more`` engines."""
        large = self.large
        assert large is not None  # long runs are split off only with an engine of large requests
        k = min(1 + len(self.more), int(lens.sum()) // _MIN_BYTES_PER_THREAD, len(lens))
        if k <= 1:
            self._engine_read(large, files, offs, views, check)
            return
        ends = np.cumsum(lens)
        cuts = np.searchsorted(ends, ends[-1] * np.arange(1, k) // k, side="right")
        bounds = [0, *sorted(set(int(c) for c in cuts if 0 < c < len(lens))), len(lens)]
        parts = list(zip(bounds[:-1], bounds[1:]))
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(len(self.more), "fp_dcp-read")

        def read(session: IOSession, a: int, b: int) -> None:
            idx = np.arange(a, b)
            self._engine_read(session, files[a:b], offs[a:b], views[a:b], None if check is None else check.subset(idx))

        futures = [self._threads.submit(read, session, a, b) for session, (a, b) in zip(self.more, parts[1:])]
        with self._stats_lock:
            self.stats["long_run_threads"] = max(self.stats["long_run_threads"], len(parts))
        try:
            read(large, *parts[0])
        finally:
            for f in futures:  # every thread is done with the views before they go
                f.exception()
        for f in futures:
            f.result()

    def _fd(self, file: int) -> int:
        fd = self.fds.get(file)
        if fd is None:
            fd = self.fds[file] = self.session.engine.open(self.paths[file], "r", self.session.direct or False)
        return fd

    def execute(self, jobs: list[Job]) -> None:
        """Run ``jobs``: batches within the budget, each read, then copied out
        and handed on, one after the other (on this thread)."""
        for batch in self._batches(jobs):
            reads = self._prepare(batch)
            self._read_batch(reads)
            self._finish(batch)

    def stream(self, chunks: Iterable[list[Job]]) -> None:
        """Run the jobs of ``chunks`` (a generator that plans them), the engine calls
        on a thread of their own, each batch's copies and callbacks here in order.
        An error (of planning or a read) waits for the reads in flight, then raises."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fp_dcp-read")
        pending: list[tuple[list[Job], concurrent.futures.Future]] = []  # read or being read, in order
        try:
            for jobs in chunks:
                batches = self._batches(jobs, before_arena=lambda: self._drain(pending))
                for batch in batches:
                    reads = self._prepare(batch)
                    if pending and any(j.temp for j in batch) and any(j.temp for b, _ in pending for j in b):
                        self._drain(pending)  # the arena still holds what an earlier batch has to copy out
                    pending.append((batch, pool.submit(self._read_batch, reads)))
                    del reads  # the views live as long as the read, not until the next batch
                    while len(pending) > 1 and pending[0][1].done():  # read: its copies while the rest is
                        self._finish_next(pending)
            self._drain(pending)
        except BaseException:
            for _, fut in pending:  # nothing writes into the targets once the error is raised
                concurrent.futures.wait([fut])
            raise
        finally:
            pool.shutdown(wait=True)

    def _finish_next(self, pending: list) -> None:
        batch, fut = pending[0]
        fut.result()
        pending.pop(0)
        self._finish(batch)

    def _drain(self, pending: list) -> None:
        while pending:
            self._finish_next(pending)

    def _batches(self, jobs: list[Job], before_arena: Callable[[], None] | None = None) -> list[list[Job]]:
        """``jobs`` cut into batches of one engine call each, within the arena budget;
        the arena is grown for them first (after ``before_arena``)."""
        needed = sum(j.needed for j in jobs)
        planned_paid = sum(j.paid for j in jobs)
        self.total += needed
        self.stats["bytes"] += needed
        self.paid_left += needed * self.max_overread_percent // 100 - planned_paid
        self.stats["merged_bytes_paid"] = self.stats.get("merged_bytes_paid", 0) + planned_paid
        temp_total = sum(j.temp for j in jobs)
        cuda = self.arena.cuda or (bool(temp_total) and torch.cuda.is_available()
                                   and any(j.cuda is not None for j in jobs))
        if temp_total and (self.arena.size < min(self.budget, temp_total) or cuda > self.arena.cuda):
            if before_arena is not None:
                before_arena()  # no read in flight into the arena it replaces
            if self.arena.ensure(min(self.budget, temp_total), cuda):
                self.stats["temp_bytes"] = self.arena.size
        max_bytes = _PROGRESS_BATCH_BYTES if self.progress else _MAX_BATCH_BYTES
        batches: list[list[Job]] = []
        batch: list[Job] = []
        used = pieces = nbytes = 0
        for job in jobs:
            if batch and (used + job.temp > self.budget or pieces + len(job.offs) > MAX_BATCH_PIECES
                          or nbytes + job.needed > max_bytes):
                batches.append(batch)
                batch, used, pieces, nbytes = [], 0, 0, 0
            job.temp_off = used
            used += job.temp
            pieces += len(job.offs)
            nbytes += job.needed
            batch.append(job)
        if batch:
            batches.append(batch)
        return batches

    def _prepare(self, batch: list[Job]) -> list[tuple]:
        """The engine calls of a batch, ``(session, files, offsets, views, check,
        lengths)``: pieces sorted, fillers added, cut for the verifier, split
        between the engines of long and scattered runs."""
        if not batch:
            return []
        files = np.concatenate([j.files for j in batch])
        offs = np.concatenate([j.offs for j in batch])
        lens = np.concatenate([j.lens for j in batch])
        if not len(offs):
            return []
        keep = lens > 0
        views: list[memoryview] = []
        arena_mv = self.arena.view()
        for j in batch:
            if j.temp:
                assert arena_mv is not None  # the batch planner sized the arena for its temp jobs
                base = arena_mv[j.temp_off : j.temp_off + j.temp]
            else:
                base = memoryview(j.buf)
            views.extend(base[p : p + n] for p, n in zip(j.pos.tolist(), j.lens.tolist()))
        if not keep.all():
            idx = np.flatnonzero(keep)
            files, offs, lens = files[idx], offs[idx], lens[idx]
            views = [views[i] for i in idx.tolist()]
        order = np.lexsort((offs, files))
        files, offs, lens = files[order], offs[order], lens[order]
        views = [views[i] for i in order.tolist()]
        ffiles, foffs, flens, paid = plan_fillers(
            files, offs, lens, self.alignment, self.paid_left, self.coalesce_gap
        )
        self.paid_left -= paid
        self.stats["filler_bytes_paid"] += paid
        self.stats["fillers"] += len(foffs)
        self.stats["pieces"] += len(offs)
        if len(foffs):
            scratch = self.scratch.data
            views.extend(scratch[:n] for n in flens.tolist())
            files = np.concatenate([files, ffiles])
            offs = np.concatenate([offs, foffs])
            lens = np.concatenate([lens, flens])
            order = np.lexsort((offs, files))
            files, offs = files[order], offs[order]
            views = [views[i] for i in order.tolist()]
        check = None
        if self.verifier is not None:
            # pieces cut at extent boundaries; every checksum block a piece
            # covers whole is compared with the CRC stored at save time
            files, offs, views, check = self.verifier.plan(files, offs, views, skip=self.scratch)
        large = self.large
        if large is None:
            return [(self.session, files, offs, views, check, None)]
        # long runs as large requests, the rest (scattered small runs) as
        # small ones; a run is a stretch of pieces back to back in one
        # file (packed small tensors, pieces joined by fillers)
        lens = np.fromiter((v.nbytes for v in views), dtype=np.int64, count=len(views))
        long = in_long_runs(files, offs, lens)
        calls = []
        for session, mask in ((large, long), (self.session, ~long)):
            if mask.all():
                calls.append((session, files, offs, views, check, lens))
            elif mask.any():
                idx = np.flatnonzero(mask)
                calls.append((session, files[idx], offs[idx], [views[i] for i in idx.tolist()],
                              None if check is None else check.subset(idx), lens[idx]))
        return calls

    def _read_batch(self, calls: list[tuple]) -> None:
        """The engine calls :meth:`_prepare` made (on the calling thread)."""
        t0 = time.perf_counter()
        for session, files, offs, views, check, lens in calls:
            if session is self.large:  # long runs, over the engines of large requests
                self._read_long(files, offs, views, lens, check)
            else:
                self._engine_read(session, files, offs, views, check)
        self.stats["read_seconds"] += time.perf_counter() - t0

    def _finish(self, batch: list[Job]) -> None:
        """A read batch's copies out of the arena and callbacks, then progress."""
        t0 = time.perf_counter()
        devices = set()
        try:
            for j in batch:
                self.stats["temp_units"] += j.units
                if j.cuda is not None:
                    devices.add(j.cuda)
                if j.post is not None:
                    j.post(self.arena, j.temp_off)
        finally:  # the copies to CUDA done before the callbacks, and before the arena is read into again or freed
            for d in devices:
                torch.cuda.current_stream(d).synchronize()
        for j in batch:
            for fn in j.done:
                fn()
            self.done_bytes += j.needed
        self.stats["copy_seconds"] += time.perf_counter() - t0
        if self.progress is not None:
            self.progress(self.done_bytes, self.total)


def in_long_runs(files: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """For pieces sorted by (file, offset): whether each lies in a run of at
    least ``LONG_RUN_BYTES`` of pieces back to back (or overlapping) in one
    file, the requests of which the engine of large requests makes."""
    n = len(lens)
    if n == 0:
        return np.zeros(0, dtype=bool)
    shift = int(max(int((offs + lens).max()), 1)).bit_length() + 1
    keys = (files.astype(np.int64) << shift) + offs  # files far apart: a run never crosses one
    ends = np.maximum.accumulate(keys + lens)
    new = np.ones(n, dtype=bool)
    new[1:] = keys[1:] > ends[:-1]
    first = np.flatnonzero(new)
    span = np.maximum.reduceat(keys + lens, first) - keys[first]
    return span[np.cumsum(new) - 1] >= LONG_RUN_BYTES
