"""What each rank reports of its write (:class:`Written`), and the
coordinator's merge into the storage layout (:func:`layout_from_results`),
checked to store every item's bytes exactly once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from itertools import chain
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from fp_dcp import format as fmt
from fp_dcp.save.layout import check_extents_cover

__all__ = ["Written", "add_stats", "layout_from_results", "check_layout_covers"]


@dataclasses.dataclass(frozen=True)
class Written:
    """``WriteResult.storage_data``: where an item's bytes went.  ``extents``:
    ``(file_name, file_offset, item_offset, length, crc32c)``; ``file_sizes`` is
    set on one result per file (its size on disk)."""

    extents: tuple[tuple[str, int, int, int, str | None], ...]
    file_sizes: tuple[tuple[str, int], ...] = ()


def add_stats(stats: dict[str, Any], s: dict[str, Any]) -> None:
    """Add an engine call's statistics ``s`` to a rank's ``stats``."""
    stats["bytes"] += s.get("bytes", 0)
    stats["requests"] += s.get("requests", 0)
    stats["zero_copy_bytes"] = stats.get("zero_copy_bytes", 0) + s.get("zero_copy_bytes", 0)
    if "staged_checksum_bytes" in s:
        stats["staged_checksum_bytes"] = stats.get("staged_checksum_bytes", 0) + s["staged_checksum_bytes"]


def layout_from_results(results: list[list[WriteResult]], save_id: str, alignment: int) -> fmt.StorageLayout:
    """The storage layout of a save from every rank's write results: its
    extents as columns (:class:`~fp_dcp.format.ExtentColumns`) where each
    item was written by one rank, else item by item."""
    indexes = [wr.index for rank_results in results for wr in rank_results]
    written = [wr.storage_data for rank_results in results for wr in rank_results]
    bad = next((i for i, w in zip(indexes, written) if not isinstance(w, Written)), None)
    if bad is not None:
        raise RuntimeError(f"{bad.fqn}: write result without an fp_dcp record")
    files: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for w in written:
        for fname, size in w.file_sizes:
            sizes[fname] = size
    extents: Mapping[MetadataIndex, list[fmt.Extent]] | None = _extent_columns(indexes, written, files)
    if extents is None:
        files.clear()
        extents = _extent_lists(indexes, written, files)
    missing = [f for f in files if f not in sizes]
    if missing:
        raise RuntimeError(f"no size reported for data file(s) {missing}")
    return fmt.StorageLayout(
        save_id=save_id,
        alignment=alignment,
        files=[(f, sizes[f]) for f in files],
        extents=extents,
        checksum_block_bytes=fmt.CHECKSUM_BLOCK_BYTES
        if any(len(e) > 4 and e[4] is not None for w in written for e in w.extents)
        else None,
    )


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
    if len(rows) > len(keys):  # each item's extents sorted by item offset (stable, as list.sort)
        order = np.lexsort((io_a, np.repeat(np.arange(len(keys)), counts)))
        f, fo_, io_a, ln_ = f[order], fo_[order], io_a[order], ln_[order]
        crcs = [crcs[k] for k in order.tolist()]
    return fmt.ExtentColumns(keys, counts, f, fo_, io_a, ln_, crcs)


def check_layout_covers(metadata: Metadata, layout: fmt.StorageLayout) -> None:
    """Before the commit: every stored item's extents, merged from all ranks,
    tile its bytes exactly once (a tensor's size comes from the metadata; a
    bytes item must be gap-free from 0), and every item of the metadata is
    stored."""
    if isinstance(layout.extents, fmt.ExtentColumns) and _covers_columns(metadata, layout.extents):
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


def _covers_columns(metadata: Metadata, extents: fmt.ExtentColumns) -> bool:
    """:func:`check_layout_covers`' checks over the columns: True where the
    stored items are exactly the metadata's and each is tiled exactly, else
    False (then the reference decides, and names what is wrong)."""
    want: dict[tuple, int] = {}  # item key -> its bytes (-1: a bytes item, any length)
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            esize = md.properties.dtype.itemsize
            for c in md.chunks:
                want[(fqn, tuple(c.offsets))] = math.prod(c.sizes) * esize
        else:
            want[(fqn, None)] = -1
    if len(want) != len(extents.item_keys):
        return False
    nbytes = [want.get(k) for k in extents.item_keys]  # the keys are distinct: all found = the same set
    if None in nbytes:
        return False
    counts, io_, ln = extents.counts, extents.item_offset, extents.length
    if (counts == 0).any():
        return False
    firsts = np.cumsum(counts) - counts
    later = np.ones(len(io_), dtype=bool)
    later[firsts] = False
    if (io_[firsts] != 0).any() or (io_[1:][later[1:]] != (io_ + ln)[:-1][later[1:]]).any():
        return False  # a gap or an overlap
    totals = np.add.reduceat(ln, firsts) if len(ln) else np.zeros(0, dtype=np.int64)
    want_n = np.array(nbytes, dtype=np.int64)
    return bool(((want_n == -1) | (want_n == totals)).all())
