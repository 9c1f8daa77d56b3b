"""What each rank reports of its write (:class:`RankResults`: one
:class:`Written` per item, sent as columns), and the coordinator's merge
into the storage layout (:func:`layout_from_results`), checked to store
every item's bytes exactly once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from itertools import chain, groupby
from operator import itemgetter
from typing import Any, overload

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from fp_dcp import format as fmt
from fp_dcp.save.layout import check_extents_cover

__all__ = ["Written", "RankResults", "add_stats", "layout_from_results", "check_layout_covers"]


@dataclasses.dataclass(frozen=True)
class Written:
    """``WriteResult.storage_data``: where an item's bytes went.  ``extents``:
    ``(file_name, file_offset, item_offset, length, crc32c)``; ``file_sizes`` is
    set on one result per file (its size on disk)."""

    extents: tuple[tuple[str, int, int, int, str | None], ...]
    file_sizes: tuple[tuple[str, int], ...] = ()


class RankResults(Sequence):
    """A rank's write results: DCP's ``WriteResult`` for each item written, in
    item order, each with its :class:`Written` (made on first look), held and
    sent to the coordinator as columns.  DCP gathers every rank's results on
    the coordinator, where an object per item is slow to unpickle at scale;
    these columns are a few arrays per rank, and :func:`layout_from_results`
    reads them as they are (``tools/plan_caching_time.py --restart`` times
    both gathers).

    ``keys``: each item's :func:`~fp_dcp.format.item_key`; ``hints``: its
    ``MetadataIndex.index``; ``counts``: its number of extents; the extents'
    ``file`` (a number into ``names``), ``file_offset``, ``item_offset``,
    ``length`` and ``crc32c``, item after item; ``file_sizes``: this rank's
    files and their sizes on disk."""

    __slots__ = ("keys", "hints", "counts", "names", "file", "file_offset", "item_offset", "length", "crc32c",
                 "file_sizes", "_made")

    def __init__(self, keys: list[tuple], hints: list[int | None], counts: np.ndarray, names: list[str],
                 file: np.ndarray, file_offset: np.ndarray, item_offset: np.ndarray, length: np.ndarray,
                 crc32c: list[str | None], file_sizes: tuple[tuple[str, int], ...]) -> None:
        self.keys, self.hints, self.counts, self.names = keys, hints, counts, names
        self.file, self.file_offset, self.item_offset, self.length = file, file_offset, item_offset, length
        self.crc32c, self.file_sizes = crc32c, file_sizes
        self._made: list[WriteResult] | None = None

    @classmethod
    def of_rows(cls, indexes: list[MetadataIndex], rows: list[tuple], file_sizes: Mapping[str, int]) -> RankResults:
        """From extent rows ``(item, file name, file offset, item offset,
        length, crc32c)``, ``item`` a position in ``indexes``: one result per
        item with rows, in item order, its extents in the order of the rows."""
        rows = sorted(rows, key=itemgetter(0))  # (stable)
        counts = [(li, len(list(group))) for li, group in groupby(rows, key=itemgetter(0))]
        index = [indexes[li] for li, _ in counts]
        names: dict[str, int] = {}
        file = np.fromiter((names.setdefault(r[1], len(names)) for r in rows), np.int64, len(rows))
        fo, io_, ln = (np.fromiter(map(itemgetter(k), rows), np.int64, len(rows)) for k in (2, 3, 4))
        return cls(list(map(fmt.item_key, index)), [i.index for i in index],
                   np.fromiter(map(itemgetter(1), counts), np.int64, len(counts)), list(names), file, fo, io_, ln,
                   list(map(itemgetter(5), rows)), tuple(file_sizes.items()))

    def inconsistency(self) -> str | None:
        """What does not hold together in these columns (as another rank sent
        them), or None."""
        arrays = (self.counts, self.file, self.file_offset, self.item_offset, self.length)
        if not all(isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype == np.int64 for a in arrays):
            return "columns that are not one-dimensional int64 arrays"
        if not len(self.keys) == len(self.hints) == len(self.counts):
            return f"{len(self.keys)} items, {len(self.hints)} hints and {len(self.counts)} extent counts"
        n = len(self.file)
        if (self.counts < 1).any() or int(self.counts.sum()) != n:
            return f"extent counts that do not add up to its {n} extents (or an item without one)"
        if not len(self.file_offset) == len(self.item_offset) == len(self.length) == len(self.crc32c) == n:
            return "extent columns of different lengths"
        if n and (int(self.file.min()) < 0 or int(self.file.max()) >= len(self.names)):
            return f"extents in files outside its {len(self.names)} file names"
        return None

    def __reduce__(self) -> tuple:
        return (RankResults, (self.keys, self.hints, self.counts, self.names, self.file, self.file_offset,
                              self.item_offset, self.length, self.crc32c, self.file_sizes))

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, i: int) -> WriteResult: ...

    @overload
    def __getitem__(self, i: slice) -> list[WriteResult]: ...

    def __getitem__(self, i: int | slice) -> WriteResult | list[WriteResult]:
        return self._results()[i]

    def __iter__(self) -> Iterator[WriteResult]:
        return iter(self._results())

    def _results(self) -> list[WriteResult]:
        """The ``WriteResult`` of each item (made once), each file's size on
        the result of the first item with bytes in it."""
        if self._made is not None:
            return self._made
        names = [self.names[f] for f in self.file.tolist()]
        rows = list(zip(names, self.file_offset.tolist(), self.item_offset.tolist(), self.length.tolist(),
                        self.crc32c))
        sizes = dict(self.file_sizes)
        out = []
        at = 0
        for (fqn, offset), hint, n in zip(self.keys, self.hints, self.counts.tolist()):
            extents = tuple(rows[at:at + n])
            first = tuple((name, sizes.pop(name)) for name in dict.fromkeys(e[0] for e in extents) if name in sizes)
            out.append(WriteResult(index=MetadataIndex(fqn, offset, hint), size_in_bytes=sum(e[3] for e in extents),
                                   storage_data=Written(extents, first)))
            at += n
        self._made = out
        return out


def add_stats(stats: dict[str, Any], s: dict[str, Any]) -> None:
    """Add an engine call's statistics ``s`` to a rank's ``stats``."""
    stats["bytes"] += s.get("bytes", 0)
    stats["requests"] += s.get("requests", 0)
    stats["zero_copy_bytes"] = stats.get("zero_copy_bytes", 0) + s.get("zero_copy_bytes", 0)
    if "staged_checksum_bytes" in s:
        stats["staged_checksum_bytes"] = stats.get("staged_checksum_bytes", 0) + s["staged_checksum_bytes"]


def layout_from_results(results: Sequence[Sequence[WriteResult]], save_id: str,
                        alignment: int) -> fmt.StorageLayout:
    """The storage layout of a save from every rank's write results: its
    extents as columns (:class:`~fp_dcp.format.ExtentColumns`) where each
    item was written by one rank, else item by item."""
    files: dict[str, int] = {}
    sizes: dict[str, int] = {}
    extents: Mapping[MetadataIndex, list[fmt.Extent]] | None = None
    if all(isinstance(r, RankResults) for r in results):  # as write_data sends them
        ranks: list[RankResults] = list(results)  # type: ignore[arg-type]
        for rank, r in enumerate(ranks):
            why = r.inconsistency()
            if why is not None:
                raise RuntimeError(f"rank {rank}: write results that do not hold together ({why}); "
                                   f"refusing to commit the checkpoint")
            sizes.update(r.file_sizes)
        extents = _rank_columns(ranks, files)
        crcs: Any = chain.from_iterable(r.crc32c for r in ranks)
    if extents is None:
        files.clear()
        indexes = [wr.index for rank_results in results for wr in rank_results]
        written = [wr.storage_data for rank_results in results for wr in rank_results]
        bad = next((i for i, w in zip(indexes, written) if not isinstance(w, Written)), None)
        if bad is not None:
            raise RuntimeError(f"{bad.fqn}: write result without an fp_dcp record")
        for w in written:
            sizes.update(w.file_sizes)
        extents = _extent_columns(indexes, written, files)
        if extents is None:
            files.clear()
            extents = _extent_lists(indexes, written, files)
        crcs = (e[4] if len(e) > 4 else None for w in written for e in w.extents)
    missing = [f for f in files if f not in sizes]
    if missing:
        raise RuntimeError(f"no size reported for data file(s) {missing}")
    return fmt.StorageLayout(
        save_id=save_id,
        alignment=alignment,
        files=[(f, sizes[f]) for f in files],
        extents=extents,
        checksum_block_bytes=fmt.CHECKSUM_BLOCK_BYTES if any(c is not None for c in crcs) else None,
    )


def _rank_columns(ranks: list[RankResults], files: dict[str, int]) -> fmt.ExtentColumns | None:
    """The extents of every rank's :class:`RankResults` as columns, each
    item's sorted by item offset; numbers the files in ``files``.  None where
    an item has results from several ranks (then the reference merges them)."""
    keys = list(chain.from_iterable(r.keys for r in ranks))
    if len(set(keys)) != len(keys):
        return None
    # each rank's file numbers -> the save's
    f = np.concatenate([np.fromiter((files.setdefault(n, len(files)) for n in r.names), np.int64,
                                    len(r.names))[r.file] for r in ranks]) if ranks else np.zeros(0, np.int64)
    counts, fo, io_, ln = (np.concatenate([getattr(r, c) for r in ranks]) if ranks else np.zeros(0, np.int64)
                           for c in ("counts", "file_offset", "item_offset", "length"))
    return _sorted_columns(keys, counts, f, fo, io_, ln, list(chain.from_iterable(r.crc32c for r in ranks)))


def _extent_lists(indexes: list[MetadataIndex], written: list[Written],
                  files: dict[str, int]) -> dict[MetadataIndex, list[fmt.Extent]]:
    """Each item's extents, sorted by item offset, merged across the ranks
    that wrote parts of it (the reference); numbers the files in ``files``."""
    extents: dict[Any, list[fmt.Extent]] = {}
    for index, w in zip(indexes, written):
        for fname, fo, io_, ln, *crc in w.extents:
            fid = files.setdefault(fname, len(files))
            extents.setdefault(index, []).append(fmt.Extent(fid, fo, io_, ln, crc[0] if crc else None))
    for exts in extents.values():
        exts.sort(key=lambda e: e.item_offset)
    return extents


def _extent_columns(indexes: list[MetadataIndex], written: list[Written],
                    files: dict[str, int]) -> fmt.ExtentColumns | None:
    """:func:`_extent_lists` as columns, or None where an item has parts
    from several results or none, or an extent is not a 5-tuple (then the
    reference merges them)."""
    keys = list(map(fmt.item_key, indexes))
    counts = np.fromiter(map(len, (w.extents for w in written)), np.int64, len(written))
    if len(set(keys)) != len(keys) or (counts == 0).any():
        return None
    rows = list(chain.from_iterable(w.extents for w in written))
    if rows and set(map(len, rows)) != {5}:
        return None
    names, fo, io_, ln, crcs = (list(c) for c in zip(*rows)) if rows else ([], [], [], [], [])
    f = np.fromiter((files.setdefault(n, len(files)) for n in names), np.int64, len(names))
    fo_, io_a, ln_ = (np.array(c, dtype=np.int64) for c in (fo, io_, ln))
    return _sorted_columns(keys, counts, f, fo_, io_a, ln_, crcs)


def _sorted_columns(keys: list[tuple], counts: np.ndarray, f: np.ndarray, fo: np.ndarray, io_: np.ndarray,
                    ln: np.ndarray, crcs: list[str | None]) -> fmt.ExtentColumns:
    """The columns with each item's extents sorted by item offset (stable, as list.sort)."""
    if len(io_) > len(keys):
        order = np.lexsort((io_, np.repeat(np.arange(len(keys)), counts)))
        f, fo, io_, ln = f[order], fo[order], io_[order], ln[order]
        crcs = [crcs[k] for k in order.tolist()]
    return fmt.ExtentColumns(keys, counts, f, fo, io_, ln, crcs)


def check_layout_covers(metadata: Metadata, layout: fmt.StorageLayout, structure: fmt.EncodedStructure) -> None:
    """Before the commit: every stored item's extents, merged from all ranks,
    tile its bytes exactly once (a tensor's size comes from the metadata; a
    bytes item must be gap-free from 0), and every item of the metadata is
    stored.  ``structure``: ``metadata``'s, encoded (:func:`~fp_dcp.format.encode_structure`;
    in version 3 its item numbers and sizes check the columns at once)."""
    if isinstance(layout.extents, fmt.ExtentColumns) and _covers_columns(layout.extents, structure):
        return
    for index, exts in layout.extents.items():
        md = metadata.state_dict_metadata.get(index.fqn)
        nbytes = sum(e.length for e in exts)
        if isinstance(md, TensorStorageMetadata):
            esize = md.properties.dtype.itemsize
            for chunk in md.chunks:
                if index.offset is None or chunk.offsets == index.offset:
                    nbytes = math.prod(chunk.sizes) * esize
                    break
        try:
            check_extents_cover(index.fqn, exts, nbytes)
        except fmt.CheckpointFormatError as e:
            raise RuntimeError(f"fp_dcp wrote an inconsistent layout, refusing to commit it: {e}") from None
    stored = set(map(fmt.item_key, layout.extents))
    for fqn, md in metadata.state_dict_metadata.items():
        keys = [(fqn, tuple(c.offsets)) for c in md.chunks] if isinstance(md, TensorStorageMetadata) else [(fqn, None)]
        for key in keys:
            if key not in stored:
                raise RuntimeError(f"fp_dcp wrote no bytes for {key}, refusing to commit the checkpoint")


def _covers_columns(extents: fmt.ExtentColumns, structure: fmt.EncodedStructure) -> bool:
    """:func:`check_layout_covers`' checks over the columns: True where the
    stored items are exactly the structure's and each is tiled exactly, else
    False (then the reference decides, and names what is wrong; so too for a
    version-2 structure, which numbers no items)."""
    if structure.nbytes is None:
        return False
    numbers = structure.item_numbers(extents)
    if len(numbers) != len(structure.nbytes) or (numbers < 0).any() or (
            np.bincount(numbers, minlength=len(numbers)) != 1).any():
        return False  # not each item of the metadata once
    want_n = structure.nbytes[numbers]
    counts, io_, ln = extents.counts, extents.item_offset, extents.length
    if (counts == 0).any():
        return False
    firsts = np.cumsum(counts) - counts
    later = np.ones(len(io_), dtype=bool)
    later[firsts] = False
    if (io_[firsts] != 0).any() or (io_[1:][later[1:]] != (io_ + ln)[:-1][later[1:]]).any():
        return False  # a gap or an overlap
    totals = np.add.reduceat(ln, firsts) if len(ln) else np.zeros(0, dtype=np.int64)
    return bool(((want_n == -1) | (want_n == totals)).all())
