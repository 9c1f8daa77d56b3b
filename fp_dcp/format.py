"""The on-disk format (docs/FORMAT.md): file names, layout records, the metadata
codec; pure Python, nothing unpickled.  Version 3 stores the per-item sections
as columns (one decoder); for versions 1 and 2 each has a fast column decoder
and a reference decoder that tests compare (why this module is over the size
limit): keep both in step."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import operator
import os
import re
import struct
import zlib
from collections.abc import Mapping
from itertools import chain, repeat
from typing import Any, Iterator, cast

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from fp_dcp import coverage

__all__ = [
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "CHECKSUM_ALGORITHM",
    "CHECKSUM_BLOCK_BYTES",
    "METADATA_NAME",
    "CheckpointFormatError",
    "check_chunks_cover",
    "check_metadata_header",
    "Extent",
    "ExtentColumns",
    "StorageLayout",
    "EncodedStructure",
    "encode_structure",
    "encode_metadata",
    "decode_metadata",
    "data_file_name",
    "data_file_paths",
    "data_subdir_name",
    "valid_data_file_name",
]

FORMAT_NAME = "fp_dcp"
# 2: extents may carry a 5th field, the CRC-32C of each checksum block.
# 3: the per-item sections (state_dict_metadata, extents) stored as columns.
# Versions 1 (4-field extents, no checksums) and 2 are still read.
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
CHECKSUM_ALGORITHM = "crc32c"
# Each extent's bytes are checksummed in blocks of this size from the
# extent's start, so that a partial read (resharding) can verify every whole
# block it covers.  Recorded in the metadata; a reader uses the recorded size.
CHECKSUM_BLOCK_BYTES = 1 << 20
METADATA_NAME = ".fp_dcp.meta"
# flock'ed by the coordinator from planning to commit, and by rotation
LOCK_NAME = ".fp_dcp.lock"
STOCK_METADATA_NAME = ".metadata"
DATA_SUFFIX = ".fpd"

# header: magic (8) | format version u32 | crc32 of body u32 | body length u64
_MAGIC = b"FPDCP\x00\r\n"
_HEADER = struct.Struct("<8sIIQ")
HEADER_SIZE = _HEADER.size
# Refuse absurd metadata sizes before allocating (a corrupt length field).
_MAX_BODY = 1 << 34
# Sizes and offsets beyond this are refused: far past any file system, and
# every sum of two of them still fits an int64 (the native layer's type).
_MAX_FILE = 1 << 60


class CheckpointFormatError(ValueError):
    """A checkpoint's metadata or layout is not something this version can load."""


def data_file_name(save_id: str, rank: int, k: int, device: int | None = None) -> str:
    if device is None:
        return f"{save_id}.r{rank}.{k}{DATA_SUFFIX}"
    return f"{save_id}.r{rank}.d{device}.{k}{DATA_SUFFIX}"


def data_subdir_name(checkpoint_dir: str) -> str:
    """The sub-directory of a data directory that holds one checkpoint's
    files: the checkpoint directory's name and a hash of its absolute path
    (two checkpoints never share one, so removing one's files cannot touch
    another's)."""
    path = os.path.abspath(checkpoint_dir)
    digest = hashlib.blake2b(path.encode(), digest_size=6).hexdigest()
    return f"{os.path.basename(path) or 'checkpoint'}-{digest}"


# What the writer names things, and so all a reader accepts (the
# confinement rule, docs/FORMAT.md "Files"): a save id, data files of that
# save id, and (data directories) one sub-directory per checkpoint.
_SAVE_ID_PATTERN = r"[0-9A-Za-z][0-9A-Za-z_-]{0,63}"
_SAVE_ID = re.compile(_SAVE_ID_PATTERN)
_DATA_NAME = re.compile(rf"(?P<sid>{_SAVE_ID_PATTERN})\.r\d{{1,9}}(?P<dev>\.d\d{{1,9}})?\.[01]\.fpd")
_SUBDIR_NAME = re.compile(r".+-[0-9a-f]{12}")


def valid_data_file_name(name: object, save_id: str | None = None) -> bool:
    """Whether ``name`` follows the writer's naming of data files (in the
    checkpoint, or in a data directory), of ``save_id`` when given; anything
    else (paths, ``..``, NUL, empty components) is refused."""
    if not isinstance(name, str) or not name or "\0" in name:
        return False
    base = name.rsplit("/", 1)[-1]
    m = _DATA_NAME.fullmatch(base)
    if m is None or (save_id is not None and m.group("sid") != save_id):
        return False
    if "/" not in name:
        return True
    if not name.startswith("/") or m.group("dev") is None:
        return False
    parts = name[1:].split("/")
    return (
        len(parts) >= 3
        and all(part not in ("", ".", "..") for part in parts)
        and _SUBDIR_NAME.fullmatch(parts[-2]) is not None
    )


def data_file_paths(directory: str, layout: "StorageLayout") -> list[str]:
    """The path of each of ``layout.files`` for the checkpoint in ``directory``,
    proven to stay inside it or its own data-directory sub-directories.
    Raises :class:`CheckpointFormatError` naming the entry."""
    mine = {data_subdir_name(directory), data_subdir_name(os.path.realpath(directory))}
    out = []
    for name, _ in layout.files:
        if not valid_data_file_name(name, layout.save_id):
            raise CheckpointFormatError(f"{directory}: bad data file name {name!r}")
        if "/" not in name:
            out.append(os.path.join(directory, name))
            continue
        subdir = os.path.basename(os.path.dirname(name))
        if subdir not in mine:
            raise CheckpointFormatError(
                f"{directory}: data file {name!r} lies in {subdir!r}, which is not this checkpoint's "
                f"sub-directory of its data directory ({sorted(mine)[0]!r}): a checkpoint saved with "
                f"data_dirs loads only from the path it was saved at (or one resolving to it)"
            )
        out.append(name)
    return out


@dataclasses.dataclass(frozen=True)
class Extent:
    """``length`` bytes of an item from ``item_offset`` of its row-major image,
    stored at ``file_offset`` of file ``file``; ``crc32c``: 8 hex digits per
    checksum block of the extent, or ``None``."""

    file: int
    file_offset: int
    item_offset: int
    length: int
    crc32c: str | None = None


def item_key(index: MetadataIndex) -> tuple:
    """``index`` as a plain hashable ``(fqn, chunk offset tuple or None)``:
    how :class:`ExtentColumns` keys its items (a ``MetadataIndex`` hashes
    its ``torch.Size`` offset more slowly)."""
    return index.fqn, None if index.offset is None else tuple(index.offset)


class ExtentColumns(Mapping):
    """``StorageLayout.extents`` as the decoder reads it: the extents' fields in
    columns, read-only, and a ``MetadataIndex -> [Extent]`` mapping to whoever
    reads it as one (built once, on first such use)."""

    def __init__(self, item_keys: list[tuple], counts: np.ndarray, file: np.ndarray, file_offset: np.ndarray,
                 item_offset: np.ndarray, length: np.ndarray, crc32c: list[str | None]) -> None:
        self.item_keys = item_keys
        self.counts = counts
        self.file, self.file_offset, self.item_offset, self.length = file, file_offset, item_offset, length
        self.crc32c = crc32c
        self._dict: dict[MetadataIndex, list[Extent]] | None = None
        # (EncodedStructure.item_numbers: the structure's item numbering and each item's number)
        self.numbers: tuple[dict, np.ndarray] | None = None

    @classmethod
    def of(cls, extents: Mapping[MetadataIndex, list[Extent]]) -> ExtentColumns:
        """``extents`` as columns: itself when it is columns already (a
        decoded layout), else a dict of ``Extent`` lists (a layout a writer
        made) laid out the same way."""
        if isinstance(extents, ExtentColumns):
            return extents
        keys = list(map(item_key, extents))
        rows = [e for exts in extents.values() for e in exts]
        counts = np.fromiter(map(len, extents.values()), dtype=np.int64, count=len(keys))
        flat = np.fromiter((x for e in rows for x in (e.file, e.file_offset, e.item_offset, e.length)),
                           dtype=np.int64, count=4 * len(rows)).reshape(-1, 4).T
        f, fo, io_, ln = (np.ascontiguousarray(c) for c in flat)
        return cls(keys, counts, f, fo, io_, ln, [e.crc32c for e in rows])

    def _extents(self) -> dict[MetadataIndex, list[Extent]]:
        if self._dict is None:
            exts = list(map(Extent, self.file.tolist(), self.file_offset.tolist(), self.item_offset.tolist(),
                            self.length.tolist(), self.crc32c))
            ends = np.cumsum(self.counts).tolist()
            self._dict = {MetadataIndex(fqn, offset): exts[end - count:end]
                          for (fqn, offset), count, end in zip(self.item_keys, self.counts.tolist(), ends)}
        return self._dict

    def __getitem__(self, key: MetadataIndex) -> list[Extent]:
        return self._extents()[key]

    def __iter__(self) -> Iterator[MetadataIndex]:
        return iter(self._extents())

    def __len__(self) -> int:
        return len(self.item_keys)

    def __repr__(self) -> str:
        return repr(self._extents())

    def __reduce__(self) -> tuple:  # pickled as columns (DCP sends the metadata to every rank)
        return (ExtentColumns, (self.item_keys, self.counts, self.file, self.file_offset, self.item_offset,
                                self.length, self.crc32c))


@dataclasses.dataclass
class StorageLayout:
    """``Metadata.storage_data`` of an fp_dcp checkpoint: ``files[i]`` is
    ``(name, size_on_disk)``; ``extents[index]`` the extents of one item, sorted by
    ``item_offset``, covering it exactly once."""

    save_id: str
    alignment: int
    files: list[tuple[str, int]]
    extents: Mapping[MetadataIndex, list[Extent]]
    checksum_block_bytes: int | None = None


def checksum_blocks(length: Any, block_bytes: int) -> Any:
    """How many checksum blocks an extent of ``length`` bytes has (at least
    one: an empty extent has one block, of CRC 0); ``length`` may be an int
    or an integer numpy array (one count per element)."""
    n = -(-length // block_bytes)
    return np.maximum(n, 1) if isinstance(n, np.ndarray) else max(1, n)


def align_up(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment``."""
    return -(-value // alignment) * alignment


def check_extents_cover(name: str, extents: list[Extent], nbytes: int) -> None:
    """Raise unless ``extents`` (sorted by item_offset) tile ``[0, nbytes)`` exactly."""
    pos = 0
    for e in extents:
        if e.item_offset != pos:
            what = "overlap" if e.item_offset < pos else "a gap"
            raise CheckpointFormatError(
                f"{name}: the stored extents have {what} at byte {min(pos, e.item_offset)} "
                f"of {nbytes}; the checkpoint metadata is corrupt"
            )
        pos += e.length
    if pos != nbytes:
        raise CheckpointFormatError(
            f"{name}: the stored extents hold {pos} bytes, the item has {nbytes}; "
            f"the checkpoint metadata is corrupt"
        )


# ---------------------------------------------------------------- encoding


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Only names of torch dtypes, looked up in a table: a name never reaches
# getattr(torch, ...), whose lazy attributes import modules.
_DTYPES = {k: v for k, v in vars(torch).items() if isinstance(v, torch.dtype)}


def _dtype_from_name(name: Any, where: str) -> torch.dtype:
    value = _DTYPES.get(name) if isinstance(name, str) else None
    if value is None:
        raise CheckpointFormatError(
            f"{where}: unknown dtype {name!r} (written by a newer torch?)"
        )
    return value


def _enc(value: Any) -> Any:
    """Plain data to JSON, keeping tuples and non-string keys apart."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Size):
        return {"__size__": list(value)}
    if isinstance(value, tuple):
        if all(type(v) is str for v in value):  # DCP's planner data: a path of keys per item
            return {"__tuple__": list(value)}
        return {"__tuple__": [_enc(v) for v in value]}
    if isinstance(value, list):
        return [_enc(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            if any(k.startswith("__") and k.endswith("__") for k in value):
                return {"__dict__": [[_enc(k), _enc(v)] for k, v in value.items()]}
            return {k: _enc(v) for k, v in value.items()}
        return {"__dict__": [[_enc(k), _enc(v)] for k, v in value.items()]}
    raise TypeError(
        f"cannot store a {type(value).__name__} in fp_dcp metadata (only plain data: "
        f"None, bool, int, float, str, tuple, list, dict); a custom planner's "
        f"planner_data must be plain data"
    )


def _dec(value: Any) -> Any:
    if isinstance(value, list):
        return [_dec(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            ((tag, inner),) = value.items()
            if tag == "__size__":
                return torch.Size(_int_list(inner, "size"))
            if tag == "__tuple__":
                if type(inner) is list and all(type(v) is str for v in inner):
                    return tuple(inner)  # DCP's planner data: a path of keys per item
                return tuple(_dec(v) for v in _list(inner, "tuple"))
            if tag == "__dict__":
                out = {}
                for pair in _list(inner, "dict"):
                    if not isinstance(pair, list) or len(pair) != 2:
                        raise CheckpointFormatError("metadata: malformed dict entry")
                    key = _dec(pair[0])
                    try:
                        out[key] = _dec(pair[1])
                    except TypeError:
                        raise CheckpointFormatError("metadata: unhashable dict key") from None
                return out
        paths = _key_paths(value)
        if paths is not None:
            return paths
        return {k: _dec(v) for k, v in value.items()}
    return value


def _key_paths(value: dict) -> dict | None:
    """``_dec(value)`` when every value is ``{"__tuple__": [str, ...]}``
    (DCP's planner data: a path of keys per item), decoded at once; None
    for any other mapping."""
    inner = list(value.values())
    if not _all_type(inner, dict) or set(map(len, inner)) != {1}:
        return None
    paths = [v.get("__tuple__") for v in inner]
    if not _all_type(paths, list) or not _all_type(list(chain.from_iterable(paths)), str):
        return None
    return dict(zip(value, map(tuple, paths)))


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise CheckpointFormatError(f"metadata: {what} is not a list")
    return value


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointFormatError(f"metadata: {what} is not an integer: {value!r}")
    return value


def _int_list(value: Any, what: str) -> list[int]:
    if type(value) is list and all(type(v) is int for v in value):
        return value  # the common case, checked without a call per element (JSON gives exact ints)
    return [_int(v, what) for v in _list(value, what)]


def _shared_size(seen: dict[tuple, torch.Size], values: list[int]) -> torch.Size:
    """``torch.Size(values)``, one object per distinct value (they are immutable)."""
    t = tuple(values)
    out = seen.get(t)
    if out is None:
        out = seen[t] = torch.Size(t)
    return out


def _index_key(index: MetadataIndex) -> list:
    return [index.fqn, None if index.offset is None else list(index.offset)]


def _index_from_key(key: Any) -> MetadataIndex:
    if not (isinstance(key, list) and len(key) == 2 and isinstance(key[0], str)):
        raise CheckpointFormatError(f"metadata: malformed item key {key!r}")
    # MetadataIndex makes its own torch.Size of the offset
    return MetadataIndex(key[0], None if key[1] is None else _int_list(key[1], "item offset"))


@dataclasses.dataclass(frozen=True)
class EncodedStructure:
    """The JSON of the metadata that depends on the structure alone (state dict
    metadata, planner data), so a writer can encode it while its files are
    written; ``version``: the format it is in; ``items`` (version 3): each
    stored item's number, by ``(fqn, chunk offsets or None)``."""

    state_dict_metadata: str
    planner_data: str
    version: int = FORMAT_VERSION
    items: dict[tuple, int] | None = None
    # (version 3) each stored item's bytes, by number; -1: a bytes item
    nbytes: np.ndarray | None = dataclasses.field(default=None, compare=False)

    def item_numbers(self, extents: ExtentColumns) -> np.ndarray:
        """Each of ``extents``' items' number (-1: not in the metadata),
        looked up once per ``extents``."""
        assert self.items is not None
        cached = extents.numbers
        if cached is None or cached[0] is not self.items:
            keys = extents.item_keys
            cached = self.items, np.fromiter(map(self.items.get, keys, repeat(-1)), np.int64, len(keys))
            extents.numbers = cached
        return cached[1]


def encode_structure(metadata: Metadata, version: int = FORMAT_VERSION) -> EncodedStructure:
    """The :class:`EncodedStructure` of ``metadata`` in format ``version``."""
    planner_data = _json(_enc(metadata.planner_data))
    if version >= 3:
        text, items, nbytes = _sd_columns_doc(metadata.state_dict_metadata)
        return EncodedStructure(text, planner_data, version, items, nbytes)
    sd_md: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            sd_md[fqn] = {
                "type": "tensor",
                "dtype": _dtype_name(md.properties.dtype),
                "requires_grad": bool(md.properties.requires_grad),
                "size": list(md.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
            }
        elif isinstance(md, BytesStorageMetadata):
            sd_md[fqn] = {"type": "bytes"}
        else:
            raise TypeError(f"{fqn}: unknown storage metadata {type(md).__name__}")
    return EncodedStructure(_json(sd_md), planner_data, version)


def _int64_text(values: Any) -> str:
    """A column of integers as version 3 stores it: base64 of int64 little-endian."""
    return base64.b64encode(np.asarray(values, dtype="<i8").tobytes()).decode("ascii")


def _sd_columns_doc(sd: Mapping[str, Any]) -> tuple[str, dict[tuple, int], np.ndarray]:
    """Version 3's ``state_dict_metadata`` (its JSON text), each stored
    item's number (the items in the order of the keys, a tensor's chunks in
    its order, a bytes item one number) and bytes (-1: a bytes item)."""
    kinds: list[str] = []
    dtypes: list[str] = []
    grads: list[int] = []
    ndims: list[int] = []
    sizes: list[int] = []
    counts: list[int] = []
    offs: list[int] = []
    lens: list[int] = []
    items: dict[tuple, int] = {}
    nbytes: list[int] = []
    for fqn, md in sd.items():
        if isinstance(md, TensorStorageMetadata):
            nd = len(md.size)
            esize = md.properties.dtype.itemsize
            if md.properties.requires_grad:
                grads.append(len(dtypes))
            kinds.append("t")
            dtypes.append(_dtype_name(md.properties.dtype))
            ndims.append(nd)
            sizes.extend(md.size)
            counts.append(len(md.chunks))
            for c in md.chunks:
                if len(c.offsets) != nd or len(c.sizes) != nd:
                    raise ValueError(f"{fqn}: a chunk of {len(c.offsets)} dimensions in a tensor of {nd}")
                offs.extend(c.offsets)
                lens.extend(c.sizes)
                items[(fqn, tuple(c.offsets))] = len(items)
                nbytes.append(math.prod(c.sizes) * esize)
        elif isinstance(md, BytesStorageMetadata):
            kinds.append("b")
            items[(fqn, None)] = len(items)
            nbytes.append(-1)
        else:
            raise TypeError(f"{fqn}: unknown storage metadata {type(md).__name__}")
    doc = {"keys": list(sd), "kinds": "".join(kinds), "dtypes": dtypes, "requires_grad": grads,
           "ndim": _int64_text(ndims), "size": _int64_text(sizes), "chunks": _int64_text(counts),
           "chunk_offsets": _int64_text(offs), "chunk_sizes": _int64_text(lens)}
    return _json(doc), items, np.array(nbytes, dtype=np.int64)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def encode_metadata(
    metadata: Metadata, layout: StorageLayout, extra: dict[str, Any], structure: EncodedStructure | None = None,
    version: int = FORMAT_VERSION,
) -> bytes:
    """The bytes of the metadata file in format ``version`` (2 or 3): header +
    JSON body.  ``structure``: :func:`encode_structure` of ``metadata``, made
    earlier (else made here)."""
    if version not in (2, 3):
        raise ValueError(f"fp_dcp writes format versions 2 and 3, not {version}")
    if structure is None or structure.version != version:
        structure = encode_structure(metadata, version)
    sm = metadata.storage_meta
    block = layout.checksum_block_bytes
    extents: Any
    if version >= 3:
        extents = _extents_columns_doc(ExtentColumns.of(layout.extents), block, structure)
    else:
        extents = _extents_doc_columns(layout.extents, block) if isinstance(layout.extents, ExtentColumns) else None
        if extents is None:
            extents = _extents_doc(layout.extents, block)
    # One JSON object, its members' texts joined (the structure's are made
    # already): the same bytes json.dumps gives for the whole document.
    doc = {
        "format": FORMAT_NAME,
        "format_version": version,
        **extra,
        "dcp_version": metadata.version,
        "save_id": layout.save_id,
        "alignment": layout.alignment,
        "files": [[name, size] for name, size in layout.files],
        "state_dict_metadata": _ENCODED,
        "extents": extents,
        **({} if block is None else {"checksum": {"algorithm": CHECKSUM_ALGORITHM, "block_bytes": block}}),
        "planner_data": _ENCODED,
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": list(sm.modules),
        },
    }
    encoded = {"state_dict_metadata": structure.state_dict_metadata, "planner_data": structure.planner_data}
    body = (
        "{" + ",".join(_json(k) + ":" + (encoded[k] if v is _ENCODED else _json(v)) for k, v in doc.items()) + "}"
    ).encode()
    return _HEADER.pack(_MAGIC, version, zlib.crc32(body), len(body)) + body


_ENCODED = object()  # a member of the document whose text the structure holds


def _extents_doc(extents: Mapping[MetadataIndex, list[Extent]], block: int | None) -> list:
    """The document's ``extents`` section, item by item (the reference);
    raises where an extent's checksum does not fit its length."""
    for index, exts in extents.items():
        for e in exts:
            crc = e.crc32c
            # 8 hex digits per checksum block
            if crc is not None and (
                block is None or type(crc) is not str or len(crc) != 8 * checksum_blocks(e.length, block)
            ):
                raise ValueError(f"{index.fqn}: extent checksum {crc!r} does not match its length {e.length}")
    return [
        [
            _index_key(index),
            [[e.file, e.file_offset, e.item_offset, e.length] + ([] if e.crc32c is None else [e.crc32c]) for e in exts],
        ]
        for index, exts in extents.items()
    ]


def _extents_doc_columns(extents: ExtentColumns, block: int | None) -> list | None:
    """:func:`_extents_doc` from the columns: the same section (the same JSON
    text), or None where an extent is not plainly valid or only some extents
    have checksums (then the reference decides)."""
    crcs = extents.crc32c
    columns = [extents.file.tolist(), extents.file_offset.tolist(), extents.item_offset.tolist(),
               extents.length.tolist()]
    if crcs and crcs[0] is not None:
        if not _crcs_fit(crcs, extents.length, block):
            return None
        columns.append(crcs)
    elif any(c is not None for c in crcs):
        return None
    rows = list(map(list, zip(*columns)))
    counts = extents.counts
    if (counts == 1).all():
        per_item = [[r] for r in rows]
    else:
        ends = np.cumsum(counts).tolist()
        per_item = [rows[end - n:end] for n, end in zip(counts.tolist(), ends)]
    return [[[fqn, None if offset is None else list(offset)], exts]
            for (fqn, offset), exts in zip(extents.item_keys, per_item)]


def _extents_columns_doc(extents: ExtentColumns, block: int | None, structure: EncodedStructure) -> dict:
    """Version 3's ``extents``: each listed item's number and extent count,
    the extents' fields as columns, the checksums of those that have one
    joined, and the numbers of those that have none."""
    numbers = structure.item_numbers(extents)
    unknown = np.flatnonzero(numbers < 0)
    if len(unknown):
        raise ValueError(f"{extents.item_keys[unknown[0]][0]}: extents for an item the metadata does not list")
    crcs = extents.crc32c
    has = np.fromiter((c is not None for c in crcs), dtype=bool, count=len(crcs))
    given = [c for c in crcs if c is not None]
    if given and not _crcs_fit(given, extents.length[has], block):
        raise ValueError("an extent checksum does not match its length (or the layout declares no checksum block)")
    return {"items": _int64_text(numbers), "counts": _int64_text(extents.counts), "file": _int64_text(extents.file),
            "file_offset": _int64_text(extents.file_offset), "item_offset": _int64_text(extents.item_offset),
            "length": _int64_text(extents.length), "crc32c": None if block is None else "".join(given),
            **({} if block is None else {"unchecked": _int64_text(np.flatnonzero(~has))})}


def read_header(head: bytes, path: str) -> tuple[int, int, int]:
    """(format_version, crc, body_length) from the first HEADER_SIZE bytes."""
    if len(head) < HEADER_SIZE:
        raise CheckpointFormatError(
            f"{path}: metadata is truncated ({len(head)} bytes, the header alone is "
            f"{HEADER_SIZE}); the checkpoint is incomplete or damaged"
        )
    magic, version, crc, length = _HEADER.unpack_from(head)
    if magic != _MAGIC:
        raise CheckpointFormatError(f"{path}: not an fp_dcp metadata file (bad magic bytes)")
    if version not in READABLE_VERSIONS:
        raise CheckpointFormatError(
            f"{path}: fp_dcp format version {version}; this fp_dcp reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}. Load it with the fp_dcp release that wrote it"
            + (" (a newer one)." if version > FORMAT_VERSION else ".")
        )
    if length > _MAX_BODY:
        raise CheckpointFormatError(f"{path}: metadata length field is corrupt ({length})")
    return version, crc, length


def check_metadata_header(head: bytes, file_size: int, path: str) -> int:
    """The body length of a metadata file of ``file_size`` bytes starting with
    ``head``: magic, version and exact size checked before the body is read."""
    _, _, length = read_header(head, path)
    if HEADER_SIZE + length != file_size:
        raise CheckpointFormatError(
            f"{path}: metadata is truncated or has trailing bytes (file {file_size} bytes, its header says "
            f"{HEADER_SIZE + length}); the checkpoint is incomplete or damaged"
        )
    return length


def decode_metadata(data: bytes, path: str) -> tuple[Metadata, StorageLayout, dict[str, Any]]:
    """Parse and validate a metadata file's bytes.  Never executes anything."""
    version, crc, length = read_header(data, path)
    body = data[HEADER_SIZE:]
    if len(body) != length:
        raise CheckpointFormatError(
            f"{path}: metadata is truncated or has trailing bytes (body {len(body)} bytes, "
            f"header says {length})"
        )
    if zlib.crc32(body) != crc:
        raise CheckpointFormatError(f"{path}: metadata checksum mismatch: the file is corrupt")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise CheckpointFormatError(f"{path}: metadata is not valid JSON: {e}") from None
    try:
        return _from_doc(doc, version)
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
        raise CheckpointFormatError(f"{path}: malformed metadata ({type(e).__name__}: {e})") from None


def _alignment(value: Any) -> int:
    a = _int(value, "alignment")
    if not 0 < a <= 1 << 30 or a & (a - 1):
        raise CheckpointFormatError(f"alignment {a} is not a power of two in [1, 2^30]")
    return a


def _checksum_block(doc: dict, version: int) -> int | None:
    """The checksum block size the body declares (None: no checksums)."""
    spec = doc.get("checksum")
    if spec is None:
        return None
    if version < 2 or not isinstance(spec, dict):
        raise CheckpointFormatError(f"malformed checksum entry {spec!r}")
    if spec.get("algorithm") != CHECKSUM_ALGORITHM:
        raise CheckpointFormatError(
            f"checksum algorithm {spec.get('algorithm')!r}; this fp_dcp knows {CHECKSUM_ALGORITHM!r}"
        )
    block = _int(spec.get("block_bytes"), "checksum block_bytes")
    if not 0 < block <= 1 << 40:
        raise CheckpointFormatError(f"checksum block_bytes {block} out of range")
    return block


_HEX = frozenset("0123456789abcdef")


def _extent_crc(value: Any, length: int, block: int | None, where: str) -> str:
    if block is None:
        raise CheckpointFormatError(f"{where}: an extent has a checksum but the metadata declares none")
    if (
        not isinstance(value, str)
        or len(value) != 8 * checksum_blocks(length, block)
        or not _HEX.issuperset(value)
    ):
        raise CheckpointFormatError(f"{where}: malformed extent checksum {str(value)[:40]!r}")
    return value


def _check_items_known(extents: Mapping[MetadataIndex, list[Extent]], sd_md: dict[str, Any]) -> None:
    """Every extent list belongs to an item the metadata describes: a
    chunk of a tensor (its offset) or a bytes item (no offset)."""
    offsets: dict[str, set] = {}
    for index in extents:
        md = sd_md.get(index.fqn)
        if isinstance(md, BytesStorageMetadata):
            known = index.offset is None
        elif md is None or index.offset is None:
            known = False
        else:
            chunks = offsets.get(index.fqn)
            if chunks is None:
                chunks = offsets[index.fqn] = {tuple(c.offsets) for c in md.chunks}
            known = tuple(index.offset) in chunks
        if not known:
            raise CheckpointFormatError(
                f"extents for {index.fqn!r} at offset {None if index.offset is None else list(index.offset)[:8]}, "
                f"which the metadata does not list: the checkpoint metadata is corrupt"
            )


def _check_no_overlap(extents: Mapping[MetadataIndex, list[Extent]]) -> None:
    """No two extents share a byte of a file: a layout where they do was not
    written by fp_dcp (and would let one item's bytes pass for another's)."""
    spans = sorted(
        (e.file, e.file_offset, e.file_offset + e.length, index.fqn)
        for index, exts in extents.items()
        for e in exts
        if e.length > 0
    )
    for (f0, _, end0, name0), (f1, start1, _, name1) in zip(spans, spans[1:]):
        if f0 == f1 and start1 < end0:
            raise CheckpointFormatError(
                f"extents of {name0} and {name1} overlap in data file {f0} (offset {start1})"
            )


def _from_doc(doc: Any, version: int = FORMAT_VERSION) -> tuple[Metadata, StorageLayout, dict[str, Any]]:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CheckpointFormatError("metadata does not describe an fp_dcp checkpoint")
    if doc.get("format_version") != version:
        raise CheckpointFormatError(f"format version {doc.get('format_version')!r} in body, {version} in header")
    block = _checksum_block(doc, version)
    raw_sd = doc["state_dict_metadata"]
    if not isinstance(raw_sd, dict):
        raise CheckpointFormatError("state_dict_metadata is not a mapping")
    item_keys: list[tuple] = []
    if version >= 3:
        sd_md, item_keys = _state_dict_md_v3(raw_sd)
    else:
        columns = _state_dict_md_columns(raw_sd)
        if columns is None:
            sd_md = _state_dict_md_checked(raw_sd)
            stored = _stored_keys(sd_md)
        else:
            sd_md, stored = columns

    save_id = doc["save_id"]
    if not isinstance(save_id, str) or not _SAVE_ID.fullmatch(save_id):
        raise CheckpointFormatError(f"bad save id {str(save_id)[:80]!r}")
    files = []
    seen: set[str] = set()
    for entry in _list(doc["files"], "files"):
        name, size = _list(entry, "files entry")
        if not valid_data_file_name(name, save_id) or name in seen:
            raise CheckpointFormatError(f"bad data file name {str(name)[:200]!r}")
        seen.add(name)
        size = _int(size, f"size of {name}")
        if not 0 <= size <= _MAX_FILE:
            raise CheckpointFormatError(f"data file {name!r}: size {size} out of range")
        files.append((name, size))
    file_sizes = [size for _, size in files]
    n_fields = (4, 5) if version >= 2 else (4,)
    extents: Mapping[MetadataIndex, list[Extent]]
    if version >= 3:
        extents = _extents_v3(doc["extents"], file_sizes, block, item_keys)
    else:
        columns = _extents_columns(doc["extents"], file_sizes, block, n_fields)
        if columns is None:
            extents = _extents_checked(doc["extents"], file_sizes, block, n_fields)
            _check_items_known(extents, sd_md)
            _check_no_overlap(extents)
        else:
            extents, keys, spans = columns
            if not stored.issuperset(keys):
                _check_items_known(extents, sd_md)  # raises, naming the item
            if not _no_overlap_columns(*spans):
                _check_no_overlap(extents)  # raises, naming the two items
    layout = StorageLayout(
        save_id=save_id,
        alignment=_alignment(doc["alignment"]),
        files=files,
        extents=extents,
        checksum_block_bytes=block,
    )
    sm_doc = doc.get("storage_meta")
    storage_meta = None
    if sm_doc is not None:
        storage_meta = StorageMeta(
            checkpoint_id=sm_doc.get("checkpoint_id"),
            save_id=sm_doc.get("save_id"),
            modules=list(sm_doc.get("modules") or []),
        )
    metadata = Metadata(
        state_dict_metadata=sd_md,
        planner_data=_dec(doc.get("planner_data")),
        storage_data=layout,
        storage_meta=storage_meta,
        version=doc.get("dcp_version"),
    )
    extra = {k: doc.get(k) for k in ("writer", "torch_version", "created", "world_size")}
    return metadata, layout, extra


# The two decoders of the per-item sections (state_dict_metadata, extents)
# are deliberate: keep both, and change them together.
# ``_*_checked`` is the reference: it walks the items one by one, checks
# every field and raises naming the item and what is wrong.  ``_*_columns``
# decodes the same sections with each check done once over a column of
# every item's values (types with set(map(type, ...)), ranges with numpy),
# which is what makes decoding a checkpoint of many small items fast (the
# extents stay columns, :class:`ExtentColumns`: no object per item).  It
# returns None at the first thing that is not plainly valid -- it never
# raises and never accepts what the reference refuses -- and the caller then
# runs the reference, which accepts the document or raises the reference's
# error; what both accept they decode to equal objects (tests/test_format.py
# checks this on mutated documents).
#
# The two decoders are why this module is longer than the project's 700
# lines: the format stays in one module, so that a reader of the format
# never needs another (docs/FORMAT.md).


def _all_type(values: list, cls: type) -> bool:
    """Every element of ``values`` is exactly a ``cls`` (a bool is no int)."""
    return not values or set(map(type, values)) == {cls}


def _int64(values: list[int]) -> np.ndarray | None:
    """``values`` (exact ints) as int64, or None where one does not fit."""
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        return None


def _outside_tensors(size: np.ndarray, ndim: np.ndarray, counts: np.ndarray, offs: np.ndarray,
                     lens: np.ndarray) -> np.ndarray:
    """Per value of the chunks' offsets and sizes (each chunk as many as its
    tensor's rank ``ndim``, ``counts`` chunks per tensor, the tensors'
    dimensions one after another in ``size``): whether it is negative or
    reaches past its tensor's dimension."""
    rank = np.repeat(ndim, counts)  # each chunk's
    first = np.repeat(np.repeat(np.cumsum(ndim) - ndim, counts), rank)  # each value's tensor's first dimension
    within = np.arange(len(offs), dtype=np.int64) - np.repeat(np.cumsum(rank) - rank, rank)
    d = size[first + within]  # the tensor's extent beside each value
    return (offs < 0) | (lens < 0) | (offs > d) | (lens > d - offs)


def _size_table(tuples: Any) -> dict[tuple, torch.Size]:
    """One ``torch.Size`` per distinct tuple (they are immutable: the decoders
    share them, as the reference does)."""
    unique = dict.fromkeys(tuples)
    return dict(zip(unique, map(torch.Size, unique)))


def _in_files(files: np.ndarray, file_offset: np.ndarray, item_offset: np.ndarray, length: np.ndarray,
              file_sizes: list[int]) -> np.ndarray:
    """Per extent: whether it lies inside a data file of ``file_sizes`` (and
    its item offset in range)."""
    sizes = np.array(file_sizes + [0], dtype=np.int64)
    known = (files >= 0) & (files < len(file_sizes))
    room = sizes[np.where(known, files, len(file_sizes))] - file_offset  # bytes of the file from the extent's start
    return (known & (file_offset >= 0) & (item_offset >= 0) & (item_offset <= _MAX_FILE) & (length >= 0)
            & (length <= room))


def _crcs_fit(crcs: list, lengths: np.ndarray, block: int | None) -> bool:
    """Whether ``crcs`` are strings of 8 hex digits per checksum block of each length."""
    return block is not None and _all_type(crcs, str) and np.array_equal(
        np.fromiter(map(len, crcs), np.int64, len(crcs)), 8 * checksum_blocks(lengths, block))


def _state_dict_md_checked(raw_sd: dict) -> dict[str, Any]:
    """``state_dict_metadata`` decoded item by item (the reference)."""
    sd_md: dict[str, Any] = {}
    sizes_seen: dict[tuple, torch.Size] = {}  # torch.Size objects are immutable: equal ones are shared
    for fqn, md in raw_sd.items():
        if not isinstance(md, dict):
            raise CheckpointFormatError(f"{fqn}: entry is not a mapping")
        if md.get("type") == "bytes":
            sd_md[fqn] = BytesStorageMetadata()
            continue
        if md.get("type") != "tensor":
            raise CheckpointFormatError(f"{fqn}: unknown entry type {md.get('type')!r}")
        size = _int_list(md["size"], f"{fqn} size")
        dtype = _dtype_from_name(md["dtype"], fqn)
        if len(size) > 64 or any(d < 0 for d in size) or math.prod(size) * dtype.itemsize > _MAX_FILE:
            raise CheckpointFormatError(f"{fqn}: tensor size {size[:8]} out of range")
        tsize = _shared_size(sizes_seen, size)
        chunks = []
        raw_chunks = md["chunks"]
        for c in raw_chunks if type(raw_chunks) is list else _list(raw_chunks, f"{fqn} chunks"):
            if type(c) is not list or len(c) != 2:
                raise CheckpointFormatError(f"{fqn}: malformed chunk {str(c)[:80]}")
            offs, sizes = _int_list(c[0], f"{fqn} chunk offsets"), _int_list(c[1], f"{fqn} chunk sizes")
            if sizes == size and not any(offs) and len(offs) == len(size):
                # the whole tensor (sizes checked above)
                chunks.append(ChunkStorageMetadata(_shared_size(sizes_seen, offs), tsize))
                continue
            if len(offs) != len(size) or len(sizes) != len(size) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(offs, sizes, size)
            ):
                raise CheckpointFormatError(f"{fqn}: chunk {offs}+{sizes} outside tensor {size}")
            chunks.append(ChunkStorageMetadata(_shared_size(sizes_seen, offs), _shared_size(sizes_seen, sizes)))
        props = TensorProperties(
            dtype=dtype, requires_grad=bool(md.get("requires_grad", False))
        )
        check_chunks_cover(fqn, size, [(c.offsets, c.sizes) for c in chunks])
        sd_md[fqn] = TensorStorageMetadata(properties=props, size=tsize, chunks=chunks)
    return sd_md


def _state_dict_md_columns(raw_sd: dict) -> tuple[dict[str, Any], set[tuple]] | None:
    """``state_dict_metadata`` decoded column by column, with its
    :func:`_stored_keys`, or None (then :func:`_state_dict_md_checked`
    decides)."""
    mds = list(raw_sd.values())
    if not _all_type(mds, dict):
        return None
    kinds = [md.get("type") for md in mds]
    tensors = [md for md, kind in zip(mds, kinds) if kind == "tensor"]
    if len(tensors) + kinds.count("bytes") != len(mds):
        return None
    try:
        sizes = [md["size"] for md in tensors]
        names = [md["dtype"] for md in tensors]
        chunk_lists = [md["chunks"] for md in tensors]
    except KeyError:
        return None
    if not (_all_type(sizes, list) and _all_type(names, str) and _all_type(chunk_lists, list)):
        return None
    dtypes = list(map(_DTYPES.get, names))
    ndims = list(map(len, sizes))
    dims = list(chain.from_iterable(sizes))
    if None in dtypes or max(ndims, default=0) > 64 or not _all_type(dims, int) or min(dims, default=0) < 0:
        return None
    known_dtypes = cast("list[torch.dtype]", dtypes)  # no None: checked above
    if max(map(operator.mul, map(math.prod, sizes), [d.itemsize for d in known_dtypes]), default=0) > _MAX_FILE:
        return None
    # chunks: [offsets, sizes] of the tensor's rank, inside the tensor
    counts = list(map(len, chunk_lists))
    chunks = list(chain.from_iterable(chunk_lists))
    if not _all_type(chunks, list) or (chunks and set(map(len, chunks)) != {2}):
        return None
    offs = [c[0] for c in chunks]
    lens = [c[1] for c in chunks]
    if not (_all_type(offs, list) and _all_type(lens, list)):
        return None
    flat_offs = list(chain.from_iterable(offs))
    flat_lens = list(chain.from_iterable(lens))
    if not (_all_type(flat_offs, int) and _all_type(flat_lens, int)):
        return None
    rank = np.repeat(np.array(ndims, dtype=np.int64), counts)  # each chunk's tensor's rank
    if not (np.array_equal(np.fromiter(map(len, offs), np.int64, len(offs)), rank)
            and np.array_equal(np.fromiter(map(len, lens), np.int64, len(lens)), rank)):
        return None
    d, o, n = _int64(dims), _int64(flat_offs), _int64(flat_lens)
    if d is None or o is None or n is None:
        return None
    ndim_col, count_col = np.array(ndims, dtype=np.int64), np.array(counts, dtype=np.int64)
    if _outside_tensors(d, ndim_col, count_col, o, n).any():
        return None
    if not coverage.all_covered(ndim_col, d, count_col, o, n):
        return None
    tuples = list(map(tuple, chain(sizes, offs, lens)))
    shared = list(map(_size_table(tuples).__getitem__, tuples))
    tsizes, csizes = shared[:len(sizes)], shared[len(sizes):]
    chunk_md = list(map(ChunkStorageMetadata, csizes[:len(offs)], csizes[len(offs):]))
    if all(count == 1 for count in counts):
        grouped = list(map(list, zip(chunk_md)))
    else:
        grouped, at = [], 0
        for count in counts:
            grouped.append(chunk_md[at:at + count])
            at += count
    grads = [bool(md.get("requires_grad", False)) for md in tensors]
    props = list(map(TensorProperties, known_dtypes, [torch.strided] * len(dtypes), grads))
    made = iter(map(TensorStorageMetadata, props, tsizes, grouped))
    sd_md = {fqn: next(made) if kind == "tensor" else BytesStorageMetadata() for fqn, kind in zip(raw_sd, kinds)}
    tensor_names = (fqn for fqn, kind in zip(raw_sd, kinds) if kind == "tensor")
    owners = chain.from_iterable(map(repeat, tensor_names, counts))
    stored: set[tuple[str, tuple | None]] = set(zip(owners, tuples[len(sizes):len(sizes) + len(offs)]))
    stored.update((fqn, None) for fqn, kind in zip(raw_sd, kinds) if kind == "bytes")
    return sd_md, stored


def check_chunks_cover(fqn: str, size: Any, chunks: list[tuple[Any, Any]]) -> None:
    """Raise :class:`CheckpointFormatError` unless the ``(offsets, sizes)``
    chunks (each inside the tensor of shape ``size``) store every element of
    it exactly once.  A tensor the metadata claims but does not store would
    otherwise load, or convert, as zeros of any size."""
    what = coverage.uncovered(size, chunks)
    if what is not None:
        raise CheckpointFormatError(
            f"{fqn}: the metadata describes a tensor of shape {list(size)[:8]} with {what}; every element of "
            f"a tensor must be stored exactly once, so the checkpoint metadata is corrupt or was not written by DCP"
        )


def _extents_checked(raw: Any, file_sizes: list[int], block: int | None,
                     n_fields: tuple[int, ...]) -> dict[MetadataIndex, list[Extent]]:
    """The ``extents`` section decoded item by item (the reference)."""
    extents: dict[MetadataIndex, list[Extent]] = {}
    for pair in _list(raw, "extents"):
        if type(pair) is not list or len(pair) != 2:
            raise CheckpointFormatError(f"metadata: malformed extents entry {str(pair)[:80]}")
        key, raw_exts = pair
        index = _index_from_key(key)
        exts = []
        for r in _list(raw_exts, f"extents of {index.fqn}"):
            if type(r) is not list or len(r) not in n_fields:
                r = _list(r, f"extent of {index.fqn}")
                raise CheckpointFormatError(f"{index.fqn}: an extent has {len(r)} fields")
            f, fo, io_, ln = r[0], r[1], r[2], r[3]
            if not (type(f) is int and type(fo) is int and type(io_) is int and type(ln) is int):
                f, fo, io_, ln = (_int(v, f"extent of {index.fqn}") for v in r[:4])
            if not 0 <= f < len(file_sizes) or fo < 0 or not 0 <= io_ <= _MAX_FILE or ln < 0 or fo + ln > file_sizes[f]:
                raise CheckpointFormatError(
                    f"{index.fqn}: extent (file {f}, offset {fo}, length {ln}) lies outside the data files"
                )
            crc = None
            if len(r) == 5:
                crc = r[4]
                # the common case checked inline; _extent_crc says what is wrong
                if not (block is not None and type(crc) is str and len(crc) == 8 * checksum_blocks(ln, block)
                        and _HEX.issuperset(crc)):
                    crc = _extent_crc(crc, ln, block, index.fqn)
            exts.append(Extent(f, fo, io_, ln, crc))
        if len(exts) > 1:
            exts.sort(key=lambda e: e.item_offset)
        if index in extents:
            raise CheckpointFormatError(f"{index.fqn}: two extent lists for one item")
        extents[index] = exts
    return extents


def _extents_columns(raw: Any, file_sizes: list[int], block: int | None, n_fields: tuple[int, ...]):
    """The ``extents`` section decoded by columns: ``(extents, keys, (files,
    starts, lengths))``, or None (then :func:`_extents_checked` decides)."""
    if type(raw) is not list or not _all_type(raw, list) or (raw and set(map(len, raw)) != {2}):
        return None
    keys = [pair[0] for pair in raw]
    lists = [pair[1] for pair in raw]
    if not (_all_type(keys, list) and (not keys or set(map(len, keys)) == {2}) and _all_type(lists, list)):
        return None
    fqns = [key[0] for key in keys]
    offsets = [key[1] for key in keys]
    given = [o for o in offsets if o is not None]
    if not (_all_type(fqns, str) and _all_type(given, list) and _all_type(list(chain.from_iterable(given)), int)):
        return None
    counts = list(map(len, lists))
    rows = list(chain.from_iterable(lists))
    if not _all_type(rows, list):
        return None
    widths = list(map(len, rows))
    if not set(widths) <= set(n_fields):
        return None
    f, fo, io_, ln = ([r[k] for r in rows] for k in range(4))
    if not _all_type(f + fo + io_ + ln, int):
        return None
    F, FO, IO, LN = (_int64(c) for c in (f, fo, io_, ln))
    if F is None or FO is None or IO is None or LN is None:
        return None
    if not _in_files(F, FO, IO, LN, file_sizes).all():
        return None
    crcs: list = [None] * len(rows)
    if 5 in widths:
        with_crc = np.array(widths) == 5
        given_crcs = [r[4] for r in rows if len(r) == 5]
        if (block is None or not _all_type(given_crcs, str)
                or not np.array_equal(np.fromiter(map(len, given_crcs), np.int64, len(given_crcs)),
                                      8 * checksum_blocks(LN[with_crc], block))
                or not _HEX.issuperset("".join(given_crcs))):
            return None
        crcs = [r[4] if len(r) == 5 else None for r in rows]
    item_keys = list(zip(fqns, (None if o is None else tuple(o) for o in offsets)))
    if len(set(item_keys)) != len(item_keys):
        return None  # two extent lists for one item
    counts_ = np.array(counts, dtype=np.int64)
    if max(counts, default=0) > 1:  # each item's extents sorted by item offset
        order = np.lexsort((IO, np.repeat(np.arange(len(raw)), counts_)))  # stable, as list.sort
        F, FO, IO, LN = F[order], FO[order], IO[order], LN[order]
        crcs = [crcs[k] for k in order.tolist()]
    extents = ExtentColumns(item_keys, counts_, F, FO, IO, LN, crcs)
    return extents, item_keys, (F, FO, LN)


def _stored_keys(sd_md: dict[str, Any]) -> set[tuple]:
    """The items ``sd_md`` describes, as ``(fqn, chunk offset tuple)`` for
    each chunk of a tensor and ``(fqn, None)`` for a bytes item: the keys
    :func:`_check_items_known` accepts."""
    known: set[tuple[str, tuple | None]] = {
        (fqn, None) for fqn, md in sd_md.items() if type(md) is BytesStorageMetadata
    }
    known.update((fqn, tuple(c.offsets)) for fqn, md in sd_md.items() if type(md) is TensorStorageMetadata
                 for c in md.chunks)
    return known


def _no_overlap_columns(files: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> bool:
    """:func:`_check_no_overlap` over the extents' columns: True, or False
    (then it decides).  Sorted by start, spans overlap somewhere iff two
    neighbours do."""
    keep = lengths > 0
    files, starts, ends = files[keep], starts[keep], starts[keep] + lengths[keep]
    order = np.lexsort((ends, starts, files))
    files, starts, ends = files[order], starts[order], ends[order]
    return not ((files[1:] == files[:-1]) & (starts[1:] < ends[:-1])).any()


# Version 3 stores the per-item sections as columns: one decoder, each check
# done once over a column with numpy, and an error that names the first item
# that fails it.


def _int64_column(section: dict, name: str, count: int | None = None) -> np.ndarray:
    """Column ``name`` of a version-3 section (base64 of int64 little-endian),
    of ``count`` values where given."""
    text = section.get(name)
    if type(text) is not str:
        raise CheckpointFormatError(f"column {name!r} is not a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise CheckpointFormatError(f"column {name!r} is not valid base64") from None
    if len(raw) % 8 or (count is not None and len(raw) != 8 * count):
        raise CheckpointFormatError(
            f"column {name!r} holds {len(raw) / 8:g} values" + ("" if count is None else f", not {count}")
        )
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _exact_list(value: Any, cls: type, what: str) -> list:
    if type(value) is not list or not _all_type(value, cls):
        raise CheckpointFormatError(f"{what} is not a list of {cls.__name__}")
    return value


def _state_dict_md_v3(raw: dict) -> tuple[dict[str, Any], list[tuple]]:
    """Version 3's ``state_dict_metadata``, and each stored item's
    ``(fqn, chunk offsets or None)`` by number."""
    keys = _exact_list(raw.get("keys"), str, "state_dict_metadata keys")
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        for k in keys:
            if k in seen:
                raise CheckpointFormatError(f"{k!r} is listed twice")
            seen.add(k)
    kinds = raw.get("kinds")
    if type(kinds) is not str or len(kinds) != len(keys) or not set(kinds) <= {"t", "b"}:
        raise CheckpointFormatError("state_dict_metadata kinds do not give each key 't' or 'b'")
    names = [k for k, kind in zip(keys, kinds) if kind == "t"]
    n = len(names)
    dtype_names = _exact_list(raw.get("dtypes"), str, "state_dict_metadata dtypes")
    if len(dtype_names) != n:
        raise CheckpointFormatError(f"{len(dtype_names)} dtypes for {n} tensors")
    dtypes = [_DTYPES.get(name) for name in dtype_names]
    if None in dtypes:
        t = dtypes.index(None)
        _dtype_from_name(dtype_names[t], names[t])  # raises, naming the tensor
    grad = np.zeros(n, dtype=bool)
    marked = _exact_list(raw.get("requires_grad"), int, "state_dict_metadata requires_grad")
    if marked:
        if min(marked) < 0 or max(marked) >= n:
            raise CheckpointFormatError(f"requires_grad names a tensor out of range (of {n})")
        grad[marked] = True
    ndim = _int64_column(raw, "ndim", n)
    if ((ndim < 0) | (ndim > 64)).any():
        raise CheckpointFormatError(f"{names[_first((ndim < 0) | (ndim > 64))]}: a rank out of range")
    size = _int64_column(raw, "size", int(ndim.sum()))
    counts = _int64_column(raw, "chunks", n)
    owner = np.repeat(np.arange(n), ndim)  # each dimension's tensor
    if (size < 0).any():
        raise CheckpointFormatError(f"{names[int(owner[_first(size < 0)])]}: a negative dimension")
    # every chunk of a tensor of rank r holds r offsets (a 0-d tensor: its one chunk)
    if (counts < 0).any() or ((ndim == 0) & (counts > 1)).any():
        raise CheckpointFormatError(f"{names[_first((counts < 0) | ((ndim == 0) & (counts > 1)))]}: "
                                    f"a chunk count out of range")
    offs_col = _int64_column(raw, "chunk_offsets")
    many = (ndim > 0) & (counts > len(offs_col))
    if many.any():
        raise CheckpointFormatError(f"{names[_first(many)]}: more chunks than the offsets hold")
    needed = float((counts.astype(np.float64) * ndim).sum())  # (in float: no wrapping past int64)
    if needed != len(offs_col):
        raise CheckpointFormatError(f"column 'chunk_offsets' holds {len(offs_col)} values, not {needed:.0f}")
    rank = np.repeat(ndim, counts)  # each chunk's rank (as many chunks as offsets, and a 0-d tensor's one)
    lens_col = _int64_column(raw, "chunk_sizes", len(offs_col))
    sizes = [tuple(size[a:b].tolist()) for a, b in zip((np.cumsum(ndim) - ndim).tolist(), np.cumsum(ndim).tolist())]
    if max(map(operator.mul, map(math.prod, sizes), [d.itemsize for d in cast("list[torch.dtype]", dtypes)]),
           default=0) > _MAX_FILE:
        raise CheckpointFormatError("a tensor larger than a data file can hold")
    bad = _outside_tensors(size, ndim, counts, offs_col, lens_col)
    if bad.any():
        t = int(np.repeat(np.repeat(np.arange(n), counts), rank)[_first(bad)])
        raise CheckpointFormatError(f"{names[t]}: a chunk outside the tensor {list(sizes[t])}")
    offs = _split_tuples(offs_col.tolist(), rank)
    lens = _split_tuples(lens_col.tolist(), rank)
    count_list = counts.tolist()
    if not coverage.all_covered(ndim, size, counts, offs_col, lens_col):
        at = 0
        for t, c in enumerate(count_list):
            check_chunks_cover(names[t], sizes[t], list(zip(offs[at:at + c], lens[at:at + c])))  # raises
            at += c
    shared = _size_table(chain(sizes, offs, lens)).__getitem__
    chunk_md = list(map(ChunkStorageMetadata, map(shared, offs), map(shared, lens)))
    ends = np.cumsum(counts).tolist()
    grouped = [chunk_md[e - c:e] for c, e in zip(count_list, ends)]
    props = list(map(TensorProperties, cast("list[torch.dtype]", dtypes), [torch.strided] * n, grad.tolist()))
    made = iter(map(TensorStorageMetadata, props, map(shared, sizes), grouped))
    sd_md = {fqn: next(made) if kind == "t" else BytesStorageMetadata() for fqn, kind in zip(keys, kinds)}
    by_tensor = iter([(name, offs[e - c:e]) for name, c, e in zip(names, count_list, ends)])
    items: list[tuple] = []
    for fqn, kind in zip(keys, kinds):
        if kind == "t":
            name, chunk_offs = next(by_tensor)
            items.extend(zip(repeat(name, len(chunk_offs)), chunk_offs))
        else:
            items.append((fqn, None))
    return sd_md, items


def _split_tuples(flat: list[int], rank: np.ndarray) -> list[tuple]:
    """``flat`` cut into tuples of ``rank[i]`` values each."""
    if len(rank) and (rank == rank[0]).all():
        k = int(rank[0])
        return list(zip(*[iter(flat)] * k)) if k else [()] * len(rank)
    ends = np.cumsum(rank).tolist()
    return [tuple(flat[e - r:e]) for r, e in zip(rank.tolist(), ends)]


_HEX_TEXT = re.compile(r"[0-9a-f]*")


def _extents_v3(raw: Any, file_sizes: list[int], block: int | None, item_keys: list[tuple]) -> ExtentColumns:
    """Version 3's ``extents``, checked as the earlier versions' are; each
    item's extents sorted by item offset."""
    if type(raw) is not dict:
        raise CheckpointFormatError("extents are not a column section")
    numbers = _int64_column(raw, "items")
    m = len(numbers)
    unknown = (numbers < 0) | (numbers >= len(item_keys))
    if unknown.any():
        raise CheckpointFormatError(f"extents for item {int(numbers[_first(unknown)])}, which the metadata does "
                                    f"not list (it lists {len(item_keys)})")
    keys = list(map(item_keys.__getitem__, numbers.tolist()))
    listed = np.bincount(numbers, minlength=len(item_keys))
    if (listed > 1).any():
        twice = item_keys[_first(listed > 1)]
        raise CheckpointFormatError(f"two extent lists for {twice[0]!r} at offset {_offset_text(twice[1])}")
    counts = _int64_column(raw, "counts", m)
    files = _int64_column(raw, "file")
    if ((counts < 0) | (counts > len(files))).any():
        raise CheckpointFormatError(f"{keys[_first((counts < 0) | (counts > len(files)))][0]}: an extent count "
                                    f"out of range")
    total = int(counts.sum())
    if len(files) != total:
        raise CheckpointFormatError(f"column 'file' holds {len(files)} values, not {total}")
    fo, io_, ln = (_int64_column(raw, name, total) for name in ("file_offset", "item_offset", "length"))
    owner = np.repeat(np.arange(m), counts)
    bad = ~_in_files(files, fo, io_, ln, file_sizes)
    if bad.any():
        fqn, offset = keys[int(owner[_first(bad)])]
        raise CheckpointFormatError(f"{fqn} at offset {_offset_text(offset)}: an extent outside its data file "
                                    f"(file {int(files[_first(bad)])} of {len(file_sizes)})")
    crcs: list[str | None] = [None] * total
    text = raw.get("crc32c")
    if block is None:
        if text is not None or "unchecked" in raw:
            raise CheckpointFormatError("extents have checksums but the metadata declares none")
    else:
        unchecked = _int64_column(raw, "unchecked")
        has = np.ones(total, dtype=bool)
        if len(unchecked) and (unchecked.min() < 0 or unchecked.max() >= total or len(np.unique(unchecked))
                               != len(unchecked)):
            raise CheckpointFormatError("column 'unchecked' lists an extent out of range or twice")
        has[unchecked] = False
        need = 8 * checksum_blocks(ln[has], block)  # (past int64 for an extent of 2^60 bytes in 1-byte blocks)
        if (type(text) is not str or (need < 0).any() or float(need.sum(dtype=np.float64)) != len(text)
                or not _HEX_TEXT.fullmatch(text)):
            raise CheckpointFormatError("malformed extent checksums (8 lowercase hex digits per block of each "
                                        "checksummed extent)")
        cut = np.cumsum(need).tolist()
        given: list[str | None] = [text[e - k:e] for k, e in zip(need.tolist(), cut)]
        if len(given) == total:
            crcs = given
        else:
            for at, c in zip(np.flatnonzero(has).tolist(), given):
                crcs[at] = c
    if (counts > 1).any():  # each item's extents sorted by item offset
        order = np.lexsort((io_, owner))  # stable, as list.sort
        files, fo, io_, ln = files[order], fo[order], io_[order], ln[order]
        crcs = [crcs[k] for k in order.tolist()]
    extents = ExtentColumns(keys, counts, files, fo, io_, ln, crcs)
    if not _no_overlap_columns(files, fo, ln):
        _check_no_overlap(extents)  # raises, naming the two items
    return extents


def _offset_text(offset: tuple | None) -> str:
    return "None" if offset is None else str(list(offset)[:8])
