"""Checking a data file's bytes against its metadata's checksums while copied
or received, in one pass; whole files or *ranges* (unions of whole extents,
:func:`extent_ranges`).  Extents without checksums pass unchecked."""

from __future__ import annotations

import bisect
import dataclasses
import errno
import os
import uuid
from typing import Iterable, Iterator, Sequence

import numpy as np

from fp_dcp import _native, files
from fp_dcp import format as fmt
from fp_dcp.checksums import crc_array, item_name
from fp_dcp.tiers import store

__all__ = ["IntegrityError", "check_buffer", "check_file", "copy_checked",
           "extent_ranges", "ranges_bytes", "split_ranges"]

_PIECE = 16 << 20

Ranges = Sequence[tuple[int, int]]  # sorted, disjoint (file offset, length), each a union of whole extents


class IntegrityError(OSError):
    """A tier's copy of a data file is missing, short or fails its checksums."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(errno.EIO, reason, path)
        self.reason = reason

    def __reduce__(self) -> tuple:  # whole across ranks (pickled by DCP's and the tiers' gathers)
        return type(self), (self.filename, self.reason), self.__dict__


@dataclasses.dataclass(frozen=True)
class _Piece:
    offset: int
    length: int
    expected: np.ndarray | None  # CRC of each block, None: padding or unchecked
    item: str | None


def _pieces(layout: fmt.StorageLayout, fid: int) -> Iterator[_Piece]:
    size = layout.files[fid][1]
    block = layout.checksum_block_bytes or (1 << 20)
    step = max(block, _PIECE // block * block)
    exts = sorted(((e, idx) for idx, es in layout.extents.items() for e in es if e.file == fid),
                  key=lambda p: p[0].file_offset)
    pos = 0
    for e, idx in exts:
        if e.file_offset > pos:
            yield _Piece(pos, e.file_offset - pos, None, None)
        crcs = crc_array(e.crc32c) if e.crc32c is not None and layout.checksum_block_bytes else None
        for start in range(0, max(e.length, 1), step):
            n = min(step, e.length - start)
            exp = None if crcs is None else crcs[start // block: start // block + fmt.checksum_blocks(n, block)]
            yield _Piece(e.file_offset + start, n, exp, item_name(idx))
        pos = max(pos, e.file_offset + e.length)
    if size > pos:
        yield _Piece(pos, size - pos, None, None)


def extent_ranges(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` spans (whole extents) sorted, with overlapping
    and touching ones merged."""
    out: list[list[int]] = []
    for off, n in sorted(spans):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + n - out[-1][0])
        else:
            out.append([off, n])
    return [(o, n) for o, n in out]


def ranges_bytes(ranges: Ranges) -> int:
    return sum(n for _, n in ranges)


def split_ranges(layout: fmt.StorageLayout, fid: int, ranges: Ranges, limit: int) -> list[list[tuple[int, int]]]:
    """``ranges`` of file ``fid`` cut into consecutive parts of at most
    ``limit`` bytes each (or one piece, when a piece is larger), every cut
    at a piece boundary, so that each part is checked alone.  At least one
    part (empty when ``ranges`` are)."""
    size = layout.files[fid][1]
    cuts = sorted({p.offset for p in _pieces(layout, fid)} | {size})
    parts: list[list[tuple[int, int]]] = [[]]
    room = limit
    for off, n in ranges:
        pos, end = off, off + n
        while pos < end:
            if room <= 0:
                parts.append([])
                room = limit
            stop = end if end - pos <= room else cuts[bisect.bisect_right(cuts, pos + room) - 1]
            if stop <= pos:  # no boundary within the room: this part is done, or one piece is larger
                if parts[-1]:
                    room = 0
                    continue
                stop = min(end, cuts[bisect.bisect_right(cuts, pos)])
            parts[-1].append((pos, stop - pos))
            room -= stop - pos
            pos = stop
    return parts


def _pieces_in(layout: fmt.StorageLayout, fid: int, ranges: Ranges | None, path: str) -> Iterator[tuple[_Piece, int]]:
    """The pieces of file ``fid`` inside ``ranges`` (``None``: all) with their
    positions; ``ValueError`` when a range is not whole pieces or past the end."""
    size = layout.files[fid][1]
    if ranges is None:
        ranges = [(0, size)] if size else []
    starts = [o for o, _ in ranges]
    base = [0]
    for o, n in ranges:
        if o < 0 or n < 0 or o + n > size:
            raise ValueError(f"{path}: range {o}+{n} outside the file's {size} bytes")
        base.append(base[-1] + n)
    covered = 0
    for p in _pieces(layout, fid):
        i = bisect.bisect_right(starts, p.offset) - 1
        if i < 0 or p.offset >= starts[i] + ranges[i][1]:
            continue
        if p.offset + p.length > starts[i] + ranges[i][1]:
            raise ValueError(f"{path}: range {starts[i]}+{ranges[i][1]} cuts an extent at file offset {p.offset}")
        covered += p.length
        yield p, base[i] + p.offset - starts[i]
    if covered != base[-1]:
        raise ValueError(f"{path}: ranges of {base[-1]} bytes hold only {covered} bytes of whole extents")


def _check(piece: _Piece, data, block: int, path: str) -> None:
    if piece.expected is None:
        return
    got = _native.crc32c_blocks(data, block)
    if len(got) != len(piece.expected) or not np.array_equal(got, piece.expected):
        bad = int(np.argmax(got != piece.expected)) if len(got) == len(piece.expected) else 0
        raise IntegrityError(path, f"checksum mismatch in {piece.item} at file offset "
                                   f"{piece.offset + bad * block}")


def check_buffer(data: np.ndarray | memoryview, layout: fmt.StorageLayout, fid: int, path: str,
                 ranges: Ranges | None = None) -> None:
    """Raise :class:`IntegrityError` unless ``data`` is file ``fid`` of
    ``layout`` (``ranges``: only those ranges of it, concatenated): the
    recorded size at least, every checksum block right."""
    view = (data if isinstance(data, memoryview) else data.data).cast("B")
    size = layout.files[fid][1] if ranges is None else ranges_bytes(ranges)
    if len(view) < size:
        raise IntegrityError(path, f"short: {len(view)} bytes, the checkpoint recorded {size}")
    block = layout.checksum_block_bytes or (1 << 20)
    for p, at in _pieces_in(layout, fid, ranges, path):
        _check(p, view[at: at + p.length], block, path)


def _pread_full(fd: int, view: memoryview, off: int, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done: done + _PIECE]], off + done)
        if n == 0:
            raise IntegrityError(path, f"short: it ends at {off + done} bytes, the checkpoint recorded more")
        done += n


def check_file(path: str, layout: fmt.StorageLayout, fid: int, ranges: Ranges | None = None) -> None:
    """:func:`check_buffer` of a file on disk (``ranges``: only those), read
    piece by piece."""
    copy_checked(path, None, layout, fid, ranges=ranges)


def copy_checked(src: str, dst: str | None, layout: fmt.StorageLayout, fid: int, sync: bool = True,
                 ranges: Ranges | None = None) -> int:
    """Copy data file ``fid`` from ``src`` to ``dst`` (a temporary renamed when
    every piece passed; ``None``: only check), checking every piece.
    ``ranges``: only those (the rest a hole).  Returns the bytes read."""
    with store.opened(os.path.dirname(src)) as sdir:
        try:
            fd, _ = sdir.open_read(os.path.basename(src))
        except FileNotFoundError:
            raise IntegrityError(src, "missing") from None
        except files.UnsafePathError:
            raise IntegrityError(src, "a symbolic link or not a regular file (a FIFO, a device); never read") \
                from None
    try:
        if dst is None:
            return _copy_pieces(fd, None, src, layout, fid, ranges)
        with store.opened(os.path.dirname(dst)) as ddir:
            name = os.path.basename(dst)
            tmp = f"{name}.{uuid.uuid4().hex[:12]}{store.TMP_SUFFIX}"
            out = ddir.create_exclusive(tmp)
            try:
                try:
                    os.ftruncate(out, layout.files[fid][1])
                    read = _copy_pieces(fd, out, src, layout, fid, ranges)
                    if sync:
                        os.fsync(out)
                finally:
                    os.close(out)
                ddir.rename(tmp, name)
            except BaseException:
                ddir.unlink(tmp)
                raise
            return read
    finally:
        os.close(fd)


def _copy_pieces(fd: int, out: int | None, src: str, layout: fmt.StorageLayout, fid: int,
                 ranges: Ranges | None) -> int:
    size = layout.files[fid][1]
    block = layout.checksum_block_bytes or (1 << 20)
    buf = np.empty(min(size, max(_PIECE, block)) or 1, dtype=np.uint8)
    read = 0
    for p, _ in _pieces_in(layout, fid, ranges, src):
        view = buf.data[: p.length]
        try:
            _pread_full(fd, view, p.offset, src)
        except IntegrityError:
            raise IntegrityError(src, f"short: the checkpoint recorded {size} bytes") from None
        read += p.length
        _check(p, view, block, src)
        if out is not None:
            w = 0
            while w < p.length:
                w += os.pwrite(out, view[w:], p.offset + w)
    return read
