"""CUDA tensors to a data file through two page-locked buffers, each chunk
written while the next is copied; the extents' checksums equal those of a
CPU save of the same bytes."""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

import numpy as np
import torch

from fp_dcp import format as fmt
from fp_dcp.checksums import crc_hex, merge_block_crcs, piece_checksums
from fp_dcp.engine import IOSession, PinnedBuffer
from fp_dcp.save.layout import align_up, place_extents
from fp_dcp.save.results import add_stats
from fp_dcp.staging.layout import chunk_windows

__all__ = ["write_cuda"]


def write_cuda(
    session: IOSession,
    path: str,
    flat: list[torch.Tensor],
    stats: dict[str, Any],
    *,
    chunk_bytes: int,
    checksums: bool,
    sync: bool,
) -> tuple[list[int], list[int], int, list[str | None]]:
    """Write CUDA byte ranges (``flat``: uint8 tensors of one device) to a new file
    ``path``, one aligned extent each, through two page-locked buffers of
    ``chunk_bytes``.  Adds the engine's statistics to ``stats``.  Returns the
    extents' offsets, lengths, the end of the last one and their ``crc32c``
    (None without ``checksums``)."""
    align = session.alignment
    block = fmt.CHECKSUM_BLOCK_BYTES if checksums else 0
    lengths = [int(f.numel()) for f in flat]
    parts: list[list[tuple[int, int, Any]]] = [[] for _ in flat]  # per extent: (origin, length, crcs)

    def done(slot: int) -> None:
        entry = pending[slot]
        assert entry is not None  # called for a slot with a write in flight
        fut, where = entry
        s = fut.result()
        add_stats(stats, s)
        if block:
            first = s["crc32c_first"].tolist()
            for j, (i, origin, n) in enumerate(where):
                parts[i].append((origin, n, s["crc32c"][first[j] : first[j + 1]]))

    # Every CUDA extent starts aligned, so chunk windows never share a block.
    offsets, end = place_extents(lengths, align, 0, align)
    chunk = align_up(min(chunk_bytes, max(end, align)), align)
    buffers = [PinnedBuffer(chunk, align) for _ in range(2)]
    views = [memoryview(b.raw) for b in buffers]
    device = flat[0].device
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the tensors' producers first
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fp_dcp-cuda-write")
    fd = session.engine.open(path, "w", session.direct if session.direct else False)
    pending: list[tuple[concurrent.futures.Future, list[tuple[int, int, int]]] | None] = [None, None]
    srcs: list[memoryview] = []
    host: torch.Tensor | None = None
    try:
        k = -1
        for k, (start, window) in enumerate(chunk_windows(offsets, lengths, chunk, align_up(end, align))):
            slot = k % 2
            if pending[slot] is not None:
                done(slot)  # buffer free again
                pending[slot] = None
            host = buffers[slot].tensor
            srcs, offs, where = [], [], []
            with torch.cuda.stream(stream):
                for i, a, b in window:
                    off = offsets[i]
                    host[a - start : b - start].copy_(flat[i][a - off : b - off], non_blocking=True)
                    srcs.append(views[slot][a - start : b - start])
                    offs.append(a)
                    where.append((i, a - off, b - a))
            event = torch.cuda.Event()
            event.record(stream)
            event.synchronize()
            if srcs:
                fut = pool.submit(
                    session.write_fds, [fd], [path], np.zeros(len(srcs), np.int64), np.asarray(offs, np.int64),
                    srcs, sync=False, checksums=block or False,
                    checksum_origin=np.asarray([o for _, o, _ in where], np.int64) if block else None,
                )
                pending[slot] = (fut, where)
        for slot in ((k + 1) % 2, k % 2):  # the older chunk first: an extent's parts merge in order
            if pending[slot] is not None:
                done(slot)
                pending[slot] = None
        if sync:
            os.fdatasync(fd)
    finally:
        stream.synchronize()  # no copy into the buffers still queued (one that raised part-way)
        for p in pending:
            if p is not None:
                p[0].exception()  # wait before the buffers go away
        pool.shutdown(wait=True)
        os.close(fd)
        # drop the views before freeing the buffers
        pending.clear()
        srcs, host, views = [], None, []
        for buffer in buffers:
            buffer.close()
    crcs: list[str | None] = [None] * len(parts)
    if block:
        crcs[:] = extent_crcs(parts, lengths, block)
    return offsets, lengths, end, crcs


def extent_crcs(parts: list[list[tuple[int, int, Any]]], lengths: list[int], block: int) -> list[str]:
    """Each extent's stored checksums (hex) from the parts its chunks wrote:
    what ``crc_hex(merge_block_crcs(p, block))`` gives, with the extents
    written whole in one part (every small tensor) turned to hex in one call."""
    whole = [i for i, (p, n) in enumerate(zip(parts, lengths))
             if len(p) == 1 and p[0][0] == 0 and p[0][1] == n > 0 and len(p[0][2]) == -(-n // block)]
    out: list[str] = [""] * len(parts)
    if whole:
        arrays = [parts[i][0][2] for i in whole]
        first = np.cumsum([0] + [len(a) for a in arrays])
        made = piece_checksums({"crc32c": np.concatenate(arrays), "crc32c_first": first}, len(whole))
        for i, c in zip(whole, made):
            out[i] = c
    done = set(whole)
    for i, p in enumerate(parts):
        if i not in done:
            out[i] = crc_hex(merge_block_crcs(p, block))
    return out
