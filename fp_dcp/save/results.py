"""What each rank reports of its write (:class:`Written`), and the
coordinator's merge into the storage layout (:func:`layout_from_results`),
checked to store every item's bytes exactly once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
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
    """The storage layout of a save from every rank's write results."""
    files: dict[str, int] = {}
    sizes: dict[str, int] = {}
    extents: dict[Any, list[fmt.Extent]] = {}
    for rank_results in results:
        for wr in rank_results:
            written = wr.storage_data
            if not isinstance(written, Written):
                raise RuntimeError(f"{wr.index.fqn}: write result without an fp_dcp record")
            for fname, size in written.file_sizes:
                sizes[fname] = size
            for fname, fo, io_, ln, *crc in written.extents:
                fid = files.setdefault(fname, len(files))
                extents.setdefault(wr.index, []).append(fmt.Extent(fid, fo, io_, ln, crc[0] if crc else None))
    for exts in extents.values():
        exts.sort(key=lambda e: e.item_offset)
    missing = [f for f in files if f not in sizes]
    if missing:
        raise RuntimeError(f"no size reported for data file(s) {missing}")
    return fmt.StorageLayout(
        save_id=save_id,
        alignment=alignment,
        files=[(f, sizes[f]) for f in files],
        extents=extents,
        checksum_block_bytes=fmt.CHECKSUM_BLOCK_BYTES
        if any(e.crc32c is not None for exts in extents.values() for e in exts)
        else None,
    )


def check_layout_covers(metadata: Metadata, layout: fmt.StorageLayout) -> None:
    """Before the commit: every stored item's extents, merged from all ranks,
    tile its bytes exactly once (a tensor's size comes from the metadata; a
    bytes item must be gap-free from 0)."""
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
