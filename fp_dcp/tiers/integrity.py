"""Checking a data file's bytes against the checksums its metadata records,
while they are copied (drain, restore) or received (replication).

Every extent of an fp_dcp data file carries the CRC-32C of each of its
``checksum_block_bytes`` blocks (``docs/FORMAT.md``).  A file is walked in
*pieces*: the gaps between extents (padding, copied as they are) and each
extent cut at block multiples from its start, each piece with the CRCs it
must have.  One pass reads, checks and (for a copy) writes, so a tier never
takes bytes it has not verified.  Extents written without checksums pass
unchecked, as they load.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from typing import Iterator

import numpy as np

from fp_dcp import _native
from fp_dcp import format as fmt
from fp_dcp.checksums import crc_array, item_name

__all__ = ["IntegrityError", "check_buffer", "check_file", "copy_checked", "read_file"]

_PIECE = 16 << 20


class IntegrityError(OSError):
    """A tier's copy of a data file is missing, short or fails its checksums."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(errno.EIO, reason, path)
        self.reason = reason


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


def _check(piece: _Piece, data, block: int, path: str) -> None:
    if piece.expected is None:
        return
    got = _native.crc32c_blocks(data, block)
    if len(got) != len(piece.expected) or not np.array_equal(got, piece.expected):
        bad = int(np.argmax(got != piece.expected)) if len(got) == len(piece.expected) else 0
        raise IntegrityError(path, f"checksum mismatch in {piece.item} at file offset "
                                   f"{piece.offset + bad * block}")


def check_buffer(data: np.ndarray | memoryview, layout: fmt.StorageLayout, fid: int, path: str) -> None:
    """Raise :class:`IntegrityError` unless ``data`` (a whole file's bytes)
    is file ``fid`` of ``layout``: its recorded size at least, every
    checksum block right."""
    view = memoryview(data).cast("B")
    size = layout.files[fid][1]
    if len(view) < size:
        raise IntegrityError(path, f"short: {len(view)} bytes, the checkpoint recorded {size}")
    block = layout.checksum_block_bytes or (1 << 20)
    for p in _pieces(layout, fid):
        _check(p, view[p.offset: p.offset + p.length], block, path)


def read_file(path: str, size: int) -> np.ndarray:
    """The first ``size`` bytes of a data file (a regular file, links not
    followed) as a uint8 array; :class:`IntegrityError` when shorter."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        buf = np.empty(size, dtype=np.uint8)
        view = memoryview(buf)
        done = 0
        while done < size:
            n = os.readv(fd, [view[done: done + _PIECE]])
            if n == 0:
                raise IntegrityError(path, f"short: {done} bytes, the checkpoint recorded {size}")
            done += n
        return buf
    finally:
        os.close(fd)


def check_file(path: str, layout: fmt.StorageLayout, fid: int) -> None:
    """:func:`check_buffer` of a file on disk, read piece by piece."""
    copy_checked(path, None, layout, fid)


def copy_checked(src: str, dst: str | None, layout: fmt.StorageLayout, fid: int, sync: bool = True) -> int:
    """Copy data file ``fid`` from ``src`` to ``dst`` (a temporary beside it,
    renamed when every piece passed; ``None``: only check), checking every
    piece on the way.  Returns the bytes read."""
    size = layout.files[fid][1]
    block = layout.checksum_block_bytes or (1 << 20)
    try:
        fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise IntegrityError(src, "missing") from None
    out = None
    tmp = None if dst is None else dst + ".tier-tmp"
    try:
        if tmp is not None:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        buf = np.empty(min(size, max(_PIECE, block)) or 1, dtype=np.uint8)
        for p in _pieces(layout, fid):
            view = memoryview(buf)[: p.length]
            got = os.preadv(fd, [view], p.offset) if p.length else 0
            while got < p.length:
                n = os.preadv(fd, [view[got:]], p.offset + got)
                if n == 0:
                    raise IntegrityError(src, f"short: {p.offset + got} bytes, the checkpoint recorded {size}")
                got += n
            _check(p, view, block, src)
            if out is not None:
                w = 0
                while w < p.length:
                    w += os.pwrite(out, view[w:], p.offset + w)
        if out is not None:
            if sync:
                os.fsync(out)
            os.close(out)
            out = None
            os.replace(tmp, dst)
        return size
    except BaseException:
        if out is not None:
            os.close(out)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise
    finally:
        os.close(fd)
