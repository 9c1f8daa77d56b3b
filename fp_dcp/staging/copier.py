"""The staging copy: a state dict's tensors into the arena and the spill file."""

# CPU tensors go through _native.copy_gather with the GIL released, fused
# with the CRC-32C of every checksum block (one pass over memory; the CRCs go
# to crc_registry) and, for eager staging, split over a few threads.  CUDA
# tensors are copied on a side stream per device that first waits for the work
# queued on the tensors' streams when stage was called (device-to-host DMA
# into the registered arena); those copies are queued first, so the DMA runs
# while the CPU copies.  Tensors past the memory limit stream through a ring
# of two arena slots into the spill file: the copy of slot k+1 overlaps the
# write of slot k, and waits for a slot's write before copying into it again.

from __future__ import annotations

import concurrent.futures
from typing import Any

import numpy as np
import torch

from fp_dcp import _native
from fp_dcp.engine import contiguous_bytes
from fp_dcp.staging.layout import ARENA, SPILL, Layout, chunk_windows

__all__ = ["Copier", "eager_copy_threads", "MAX_COPY_THREADS", "COPY_PIECE_BYTES"]

# Eager staging holds the training until the copy is done, so the copy takes
# the cores the training would use (torch.get_num_threads()), at most this
# many.  A judgement, not a measured optimum: the copy is bound by memory
# bandwidth, which two threads already reach (docs/NATIVE.md); the cap
# leaves room for machines with more memory channels without starting a
# thread per core.  Lazy staging copies in one thread.
MAX_COPY_THREADS = 4
# The pieces a split copy hands out, at most this large: large enough that
# a piece's overhead (a task, a GIL round trip) is noise beside copying it,
# small enough that a few large tensors still split
# evenly over the threads; a multiple of CHECKSUM_BLOCK_BYTES, so that the
# pieces cut each tensor on its checksum grid.
COPY_PIECE_BYTES = 64 << 20


def eager_copy_threads() -> int:
    """Threads of an eager staging copy: the training's, within MAX_COPY_THREADS."""
    return max(1, min(torch.get_num_threads(), MAX_COPY_THREADS))


def flat_bytes(t: torch.Tensor) -> np.ndarray | None:
    """A uint8 numpy view of a contiguous CPU tensor's bytes; None if a plain
    memcpy cannot copy it."""
    if not t.is_contiguous() or t.is_conj() or t.is_neg() or t.layout != torch.strided:
        return None
    return contiguous_bytes(t)


class Copier:
    """A writer's copy machinery, kept across saves: a side stream per CUDA
    device, the threads of split copies and of spill writes."""

    def __init__(self) -> None:
        self.piece_bytes = COPY_PIECE_BYTES
        self.streams: dict[torch.device, Any] = {}
        self.copy_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.ring_pool: concurrent.futures.ThreadPoolExecutor | None = None

    def cuda_events(self, leaves: list[torch.Tensor]) -> dict:
        """On the calling (training) thread: mark where each device's current
        stream is, so the side-stream copies start after the work queued so far."""
        if not torch.cuda.is_initialized():  # no tensor can be on a CUDA device
            return {}
        devices = {t.device for t in leaves if t.is_cuda}
        events = {}
        for d in devices:
            if d not in self.streams:
                self.streams[d] = torch.cuda.Stream(device=d)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(d))
            events[d] = ev
        return events

    def copy(self, buf: Any, layout: Layout, views: list[torch.Tensor | None], leaves, events: dict, spill: Any,
             threads: int, block: int = 0) -> dict[int, tuple[int, np.ndarray]]:
        """Copy the leaves into the arena ``buf`` and the ``spill`` file; returns
        ``{arena offset: (bytes, CRCs)}`` of the CPU-copied tensors (empty when
        ``block`` is 0)."""
        offsets: list[int] = []
        sources: list[np.ndarray] = []
        slow: list[tuple[torch.Tensor, torch.Tensor]] = []
        cuda: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for i, t in enumerate(leaves):
            if layout.where[i] != ARENA:
                continue
            view = views[i]
            assert view is not None  # every tensor placed in the arena has a view
            if t.device.type == "cuda":
                cuda.setdefault(t.device, []).append((view, t))
                continue
            b = flat_bytes(t) if t.device.type == "cpu" else None
            if b is None:
                slow.append((view, t))
            else:
                offsets.append(layout.offset[i])
                sources.append(b)
        done = []
        for d, pairs in cuda.items():  # queued first: the DMA runs while the CPU copies
            s = self.streams[d]
            with torch.cuda.device(d), torch.cuda.stream(s):
                s.wait_event(events[d])
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(s)
                ev = torch.cuda.Event(blocking=True)  # waited for beside training: sleep, do not spin a core
                ev.record(s)
                done.append(ev)
        crcs: dict[int, tuple[int, np.ndarray]] = {}
        try:
            if sources:
                got = self._gather(buf, offsets, sources, threads, block)
                if got is not None:
                    crcs = {off: (len(b), c) for off, b, c in zip(offsets, sources, got)}
            for dst, src in slow:
                dst.copy_(src)
        finally:  # the device's copies into the arena end here, also when a CPU copy failed
            for ev in done:
                ev.synchronize()
        del views
        if spill is not None:
            self._stream(buf, layout, leaves, events, spill)
        return crcs

    def _gather(self, buf: Any, offsets: list[int], sources: list[np.ndarray], threads: int,
                block: int = 0) -> list[np.ndarray] | None:
        """memcpy every source to its arena offset over ``threads`` threads, the GIL
        released; with ``block``, checksummed in the same pass."""
        k = threads
        piece_max = self.piece_bytes
        if block and piece_max % block:
            block = 0  # pieces must cut sources on the checksum grid
        lens = np.fromiter(map(len, sources), dtype=np.int64, count=len(sources))
        if k <= 1 or int(lens.sum()) < 2 * piece_max:
            got = _native.copy_gather(buf, np.asarray(offsets, dtype=np.int64), sources, checksum_block=block)
            if not block:
                return None
            crcs, first = got
            return [crcs[a:b] for a, b in zip(first[:-1].tolist(), first[1:].tolist())]
        # the sources cut in pieces of at most piece_max (on the checksum grid),
        # in order; each thread copies a run of them of about total / k bytes
        counts = -(-lens // piece_max)  # an empty source has no piece
        src = np.repeat(np.arange(len(sources)), counts)
        lo = (np.arange(len(src)) - np.repeat(np.cumsum(counts) - counts, counts)) * piece_max
        n = np.minimum(lens[src] - lo, piece_max)
        dst = np.asarray(offsets, dtype=np.int64)[src] + lo
        ends = np.cumsum(n)
        cuts = [0, *np.searchsorted(ends, ends[-1] * np.arange(1, k) // k, side="right").tolist(), len(n)]
        whole = (lo == 0) & (n == lens[src])  # a source in one piece: passed as it is
        pieces = [sources[i] if w else sources[i][a:a + m]
                  for i, w, a, m in zip(src.tolist(), whole.tolist(), lo.tolist(), n.tolist())]
        groups = [(dst[a:b], pieces[a:b]) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
        if self.copy_pool is None or self.copy_pool._max_workers < k - 1:
            if self.copy_pool is not None:
                self.copy_pool.shutdown(wait=True)
            self.copy_pool = concurrent.futures.ThreadPoolExecutor(k - 1, thread_name_prefix="fp_dcp-copy")
        futs = [self.copy_pool.submit(_native.copy_gather, buf, o, b, block) for o, b in groups[1:]]
        results = []
        try:
            results.append(_native.copy_gather(buf, groups[0][0], groups[0][1], block))
        finally:
            results += [f.result() for f in futs]
        if not block:
            return None
        # the pieces' CRCs in piece order are the sources' in source order (the
        # pieces cut on the checksum grid); an empty source's is one 0
        crcs = np.concatenate([c for c, _ in results])
        blocks = -(-lens // block)
        return [crcs[b - m:b] if m else np.zeros(1, dtype=np.uint32)
                for b, m in zip(np.cumsum(blocks).tolist(), blocks.tolist())]

    def _stream(self, buf: Any, layout: Layout, leaves, events: dict, spill: Any) -> None:
        """Tensors past the limit: copy a slot, write it while the next slot is
        copied, wait for a slot's write before copying into it again."""
        spill.resize(layout.spill_bytes)
        items = []
        for i, t in enumerate(leaves):
            if layout.where[i] != SPILL:
                continue
            if t.device.type == "cuda":
                st = self.streams[t.device]
                with torch.cuda.device(t.device), torch.cuda.stream(st):
                    st.wait_event(events[t.device])
                    src: Any = t.contiguous().reshape(-1).view(torch.uint8)
                    t.record_stream(st)
            else:
                src = flat_bytes(t)
                if src is None:
                    src = flat_bytes(t.resolve_conj().resolve_neg().contiguous().cpu())
            items.append((layout.offset[i], layout.nbytes[i], src, t.device))
        if self.ring_pool is None:
            self.ring_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fp_dcp-spill")
        slot = layout.slot_bytes
        items.sort(key=lambda it: it[0])  # (in spill order: each slot looks only at the tensors it holds)
        windows = chunk_windows([it[0] for it in items], [it[1] for it in items], slot, layout.spill_bytes)
        pending: list[concurrent.futures.Future | None] = [None, None]
        try:
            for k, (start, window) in enumerate(windows):
                s = k % 2
                fut = pending[s]
                if fut is not None:
                    fut.result()  # back-pressure: the slot is free again
                    pending[s] = None
                stop = min(start + slot, layout.spill_bytes)
                base = layout.ring_offset + s * slot
                offs, srcs, evs = [], [], []
                for i, a, b in window:
                    off, _, src, dev = items[i]
                    if dev.type == "cuda":
                        st = self.streams[dev]
                        with torch.cuda.device(dev), torch.cuda.stream(st):
                            host = torch.frombuffer(buf, dtype=torch.uint8, count=b - a, offset=base + a - start)
                            host.copy_(src[a - off : b - off], non_blocking=True)
                            ev = torch.cuda.Event(blocking=True)
                            ev.record(st)
                            evs.append(ev)
                    else:
                        offs.append(base + a - start)
                        srcs.append(src[a - off : b - off])
                if srcs:
                    _native.copy_gather(buf, np.asarray(offs, dtype=np.int64), srcs)
                for ev in evs:
                    ev.synchronize()
                view = memoryview(buf)[base : base + (stop - start)]
                pending[s] = self.ring_pool.submit(spill.write, start, view)
            for k in range(2):
                fut = pending[k]
                if fut is not None:
                    fut.result()
                    pending[k] = None
        finally:
            for dev in {it[3] for it in items if it[3].type == "cuda"}:
                self.streams[dev].synchronize()  # no copy into the ring still queued (one that raised part-way)
            for p in pending:
                if p is not None:
                    p.exception()  # no write may outlive this call

    def shutdown(self) -> None:
        """Wait for the pools' threads to end; forget the streams."""
        if self.ring_pool is not None:
            self.ring_pool.shutdown(wait=True)
        if self.copy_pool is not None:
            self.copy_pool.shutdown(wait=True)
        self.streams.clear()
