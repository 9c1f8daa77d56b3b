"""Checksums of a checkpoint's data: the CRC-32C of every block of every
extent, computed by the engine as the writer's bytes pass, stored as
``Extent.crc32c``, checked by :class:`ReadVerifier` on loads."""

from __future__ import annotations

import errno
from typing import Any, Sequence

import numpy as np
from torch.distributed.checkpoint.metadata import MetadataIndex

from fp_dcp import format as fmt

__all__ = ["ChecksumError", "crc_hex", "crc_array", "piece_checksums", "merge_block_crcs", "ReadVerifier", "BadBlock"]


class ChecksumError(OSError):
    """Bytes read do not match the checksum stored at save time (``errno`` EIO).
    ``filename``, ``tensor``, ``file_offset`` and ``length`` locate the first bad
    block; ``bad_blocks`` lists them all."""

    def __init__(self, message: str, path: str, bad: "list[BadBlock]") -> None:
        super().__init__(errno.EIO, message, path)
        first = bad[0]
        self.tensor = first.tensor
        self.file_offset = first.file_offset
        self.length = first.length
        self.bad_blocks = bad

    def __reduce__(self) -> tuple:  # whole across ranks (DCP gathers a rank's error by pickle)
        return type(self), (self.strerror, self.filename, self.bad_blocks), self.__dict__


class BadBlock:
    """One checksum block whose bytes do not match."""

    __slots__ = ("tensor", "path", "file_offset", "item_offset", "length", "expected", "actual")

    def __init__(self, tensor, path, file_offset, item_offset, length, expected, actual) -> None:
        self.tensor, self.path, self.file_offset = tensor, path, file_offset
        self.item_offset, self.length, self.expected, self.actual = item_offset, length, expected, actual

    def describe(self) -> str:
        return (
            f"{self.tensor}: bytes {self.item_offset}..{self.item_offset + self.length} at offset "
            f"{self.file_offset} of {self.path}: crc32c {self.actual:08x}, stored {self.expected:08x}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def crc_hex(crcs: np.ndarray) -> str:
    """CRC-32C values as the metadata stores them: 8 hex digits each, big-endian."""
    return np.asarray(crcs, dtype=">u4").tobytes().hex()


def crc_array(text: str) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(text), dtype=">u4").astype(np.uint32)


def piece_checksums(stats: dict[str, Any], n: int) -> list[str]:
    """The ``Extent.crc32c`` of each of the ``n`` pieces of an ``Engine.write``
    called with ``checksums=CHECKSUM_BLOCK_BYTES`` (pieces = whole extents)."""
    crcs, first = stats["crc32c"], stats["crc32c_first"]
    text = crc_hex(crcs)
    return [text[8 * int(a) : 8 * int(b)] for a, b in zip(first[:n].tolist(), first[1 : n + 1].tolist())]


def merge_block_crcs(parts: Sequence[tuple[int, int, Any]], block: int) -> np.ndarray:
    """The CRC-32C of each ``block``-byte block of a piece written in ``parts``
    (``(origin, length, crcs)`` in order, as ``Engine.write`` reports each);
    blocks cut by a part boundary are joined with ``crc32c_combine``."""
    from fp_dcp import _native

    out: list[int] = []
    pos = 0
    for origin, length, crcs in parts:
        if origin != pos:
            raise ValueError(f"parts are not consecutive: one starts at {origin}, the bytes so far end at {pos}")
        if length == 0:
            continue
        end = origin + length
        crcs = [int(c) for c in crcs]
        for c in crcs:
            if pos >= end:
                raise ValueError(f"a part of {length} bytes at {origin} has too many CRCs ({len(crcs)})")
            stop = min((pos // block + 1) * block, end)
            if pos % block:
                out[-1] = _native.crc32c_combine(out[-1], c, stop - pos)
            else:
                out.append(c)
            pos = stop
        if pos != end:
            raise ValueError(f"a part of {length} bytes at {origin} has too few CRCs ({len(crcs)})")
    return np.asarray(out or [0], dtype=np.uint32)


def item_name(index: Any) -> str:
    """A stored item for messages: the tensor's name, and the offset of its
    chunk unless that is the origin (a whole tensor, or a first shard)."""
    if index.offset is None or not any(index.offset):
        return index.fqn
    return f"{index.fqn} (chunk at {list(index.offset)})"


class ReadVerifier:
    """The stored checksums of a checkpoint, laid out for checking engine reads
    (:meth:`plan`, then the returned check's ``compare``)."""

    def __init__(self, layout: fmt.StorageLayout, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        self.block = layout.checksum_block_bytes
        columns = fmt.ExtentColumns.of(layout.extents)  # a decoded layout's: as they are
        self.items = columns.item_keys
        a, hexes = self._rows(columns)
        self.enabled = len(a) > 0
        if not self.enabled:
            return
        a = a[np.lexsort((a[:, 1], a[:, 0]))]
        self.e_file, self.e_off, self.e_len, self.e_base, self.e_item, self.e_io = (a[:, k] for k in range(6))
        self.crcs = crc_array("".join(hexes))
        top = int(max(int((self.e_off + self.e_len).max()), max((s for _, s in layout.files), default=0)))
        self.shift = max(1, top.bit_length() + 1)
        if (len(layout.files) + 1) << self.shift >= 1 << 62:
            raise fmt.CheckpointFormatError("data files too large to index their checksums")
        self.e_key = (self.e_file << self.shift) + self.e_off
        self.e_end = self.e_key + self.e_len
        self.bounds = _sorted_unique(np.concatenate([self.e_key, self.e_end]))

    def _rows(self, ext: fmt.ExtentColumns) -> tuple[np.ndarray, list[str]]:
        """One row (file, file offset, length, first CRC, item, item offset)
        per checksummed extent, in the layout's order, and their CRCs."""
        has = np.fromiter((c is not None for c in ext.crc32c), dtype=bool, count=len(ext.crc32c))
        if self.block is None or not has.any():
            return np.zeros((0, 6), dtype=np.int64), []
        hexes = [c for c in ext.crc32c if c is not None]
        blocks = np.fromiter(map(len, hexes), dtype=np.int64, count=len(hexes)) // 8
        item = np.repeat(np.arange(len(ext.counts), dtype=np.int64), ext.counts)
        cols = [ext.file[has], ext.file_offset[has], ext.length[has], np.cumsum(blocks) - blocks, item[has],
                ext.item_offset[has]]
        return np.stack(cols, axis=1), hexes

    # ------------------------------------------------------------- planning

    def plan(self, files: np.ndarray, offs: np.ndarray, views: list, skip: Any = None):
        """Cut every piece at the extent boundaries inside it; views of ``skip``
        (shared scratch) are never checked.  Returns ``(files, offs, views,
        check)``: pass ``check.engine_kwargs`` to ``Engine.read``."""
        files = np.asarray(files, dtype=np.int64)
        offs = np.asarray(offs, dtype=np.int64)
        n = len(views)
        lens = np.fromiter((v.nbytes for v in views), dtype=np.int64, count=n)
        if skip is not None:
            fill = np.fromiter((getattr(v, "obj", None) is skip for v in views), dtype=bool, count=n)
        else:
            fill = np.zeros(n, dtype=bool)
        keys = (files << self.shift) + offs
        lo = np.searchsorted(self.bounds, keys, side="right")
        hi = np.searchsorted(self.bounds, keys + lens, side="left")
        cuts = np.where(fill, 0, hi - lo)
        if cuts.any():
            files, offs, views, fill = self._cut(files, offs, lens, views, fill, lo, cuts)
            lens = np.fromiter((v.nbytes for v in views), dtype=np.int64, count=len(views))
            keys = (files << self.shift) + offs
        e = np.searchsorted(self.e_key, keys, side="right") - 1
        ec = np.maximum(e, 0)
        inside = (e >= 0) & ~fill & (keys < self.e_end[ec]) & (lens > 0)
        origin = np.where(inside, offs - self.e_off[ec], 0)
        # a piece that covers no checksum block whole (a few columns of a
        # row, a scratch filler) cannot be checked: the engine skips its CRC
        start = -(-origin // self.block) * self.block
        inside &= (start < self.e_len[ec]) & (np.minimum(start + self.block, self.e_len[ec]) <= origin + lens)
        return files, offs, views, _Check(self, ec, inside, origin, lens)

    def _cut(self, files, offs, lens, views, fill, lo, cuts):
        out_f, out_o, out_v, out_fill = [], [], [], []
        bounds = self.bounds
        for i in range(len(views)):
            k = int(cuts[i])
            if k == 0:
                out_f.append(files[i])
                out_o.append(offs[i])
                out_v.append(views[i])
                out_fill.append(fill[i])
                continue
            f, o, v = int(files[i]), int(offs[i]), views[i]
            points = (bounds[lo[i] : lo[i] + k] - (f << self.shift)).tolist()
            start = o
            for p in points + [o + int(lens[i])]:
                out_f.append(f)
                out_o.append(start)
                out_v.append(v[start - o : p - o])
                out_fill.append(False)
                start = p
        files, offs = np.array(out_f, dtype=np.int64), np.array(out_o, dtype=np.int64)
        fill = np.array(out_fill, dtype=bool)
        # pieces may overlap (two targets of the same bytes): cut, they must be sorted again
        order = np.lexsort((offs, files))
        if np.any(order != np.arange(len(order))):
            files, offs, fill = files[order], offs[order], fill[order]
            out_v = [out_v[i] for i in order.tolist()]
        return files, offs, out_v, fill


class _Check:
    """The pieces of one engine read, where each starts in its extent, and
    whether it covers a checksum block whole (``inside``; the engine
    checksums only those pieces)."""

    def __init__(self, verifier: ReadVerifier, ext, inside, origin, lens) -> None:
        self.v = verifier
        self.ext, self.inside, self.origin, self.lens = ext, inside, origin, lens

    def subset(self, idx: np.ndarray) -> "_Check":
        """The check of the pieces ``idx`` (ascending) alone, for an engine
        call that reads only those."""
        return _Check(self.v, self.ext[idx], self.inside[idx], self.origin[idx], self.lens[idx])

    @property
    def engine_kwargs(self) -> dict[str, Any]:
        return {"checksums": self.v.block, "checksum_origin": self.origin, "checksum_skip": ~self.inside}

    def compare(self, stats: dict[str, Any]) -> tuple[int, list[BadBlock]]:
        """(bytes verified, bad blocks) for the CRCs of an engine read."""
        v = self.v
        n = v.block
        crcs, first = stats["crc32c"], stats["crc32c_first"]
        counts = np.diff(first)
        p = np.repeat(np.arange(len(counts)), counts)
        j = np.arange(len(crcs)) - first[p]
        org = self.origin[p]
        gb = org // n + j
        start = gb * n
        cov_start = np.maximum(start, org)
        cov_end = np.minimum(start + n, org + self.lens[p])
        e = self.ext[p]
        full_end = np.minimum(start + n, v.e_len[e])
        ok = self.inside[p] & (cov_start == start) & (cov_end == full_end)
        if not ok.any():
            return 0, []
        idx = np.flatnonzero(ok)
        expected = v.crcs[v.e_base[e[idx]] + gb[idx]]
        verified = int((cov_end[idx] - cov_start[idx]).sum())
        bad = np.flatnonzero(crcs[idx] != expected)
        out = []
        for b in bad.tolist():
            k = idx[b]
            ek = e[k]
            out.append(BadBlock(
                item_name(MetadataIndex(*v.items[v.e_item[ek]])),
                v.paths[int(v.e_file[ek])],
                int(v.e_off[ek] + start[k]),
                int(v.e_io[ek] + start[k]),
                int(full_end[k] - start[k]),
                int(expected[b]),
                int(crcs[k]),
            ))
        return verified, out

    def verify(self, stats: dict[str, Any]) -> int:
        """Raise :class:`ChecksumError` on any bad block; the bytes verified."""
        verified, bad = self.compare(stats)
        if bad:
            more = f" (and {len(bad) - 1} more bad block(s) in this read)" if len(bad) > 1 else ""
            raise ChecksumError(
                f"checksum mismatch: {bad[0].describe()}{more}; the data file was damaged after the save. "
                f"Run `fp-dcp verify` on the checkpoint to list every bad extent; "
                f"FastPersistOptions(verify_checksums=False) loads without checking",
                bad[0].path,
                bad,
            )
        return verified


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` of a 1-D array, without the ``numpy.ma`` import that
    ``np.unique`` does on its first plain call in a process (about 10 ms,
    paid by a fresh process's first load)."""
    a = np.sort(a)
    if len(a) < 2:
        return a
    keep = np.empty(len(a), dtype=bool)
    keep[0] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]
