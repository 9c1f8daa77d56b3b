"""Format version 3: the per-item sections as columns.  Golden layout, the
same objects as version 2 decodes from the same checkpoint, every edit of
the columns refused with a format error or decoded to what version 2's
checks accept, and errors that name the item."""

from __future__ import annotations

import base64
import json
import struct
import zlib

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from fp_dcp import FastPersistReader, FastPersistWriter
from fp_dcp import format as fmt
from tests._sd import assert_sd_equal, mixed_state_dict, zeros_like_sd

_BLOCK = 16
_SAVE_ID = "20260101T000000-0123abcd"


def _column(text: str) -> list[int]:
    return np.frombuffer(base64.b64decode(text), dtype="<i8").tolist()


def _text(values) -> str:
    return base64.b64encode(np.asarray(values, dtype="<i8").tobytes()).decode()


def test_a_save_writes_version_3_columns_and_loads_back(tmp_path):
    sd = mixed_state_dict(5)
    path = tmp_path / "c"
    dcp.save(sd, storage_writer=FastPersistWriter(path))
    data = (path / fmt.METADATA_NAME).read_bytes()
    version, crc, length = struct.unpack_from("<IIQ", data, 8)
    assert version == fmt.FORMAT_VERSION == 3 and length == len(data) - 24 and crc == zlib.crc32(data[24:])
    doc = json.loads(data[24:])
    sd_doc, ext = doc["state_dict_metadata"], doc["extents"]
    assert doc["format_version"] == 3
    assert set(sd_doc) == {"keys", "kinds", "dtypes", "requires_grad", "ndim", "size", "chunks", "chunk_offsets",
                           "chunk_sizes"}
    assert sd_doc["keys"] == list(fmt.decode_metadata(data, "m")[0].state_dict_metadata)
    assert len(sd_doc["kinds"]) == len(sd_doc["keys"])
    n_tensors = sd_doc["kinds"].count("t")
    assert len(_column(sd_doc["ndim"])) == len(sd_doc["dtypes"]) == n_tensors
    lengths = _column(ext["length"])
    assert len(ext["crc32c"]) == sum(8 * max(1, -(-n // (1 << 20))) for n in lengths)
    assert _column(ext["unchecked"]) == []
    target = zeros_like_sd(sd)
    dcp.load(target, storage_reader=FastPersistReader(path))
    assert_sd_equal(sd, target)


def _rich() -> tuple[Metadata, fmt.StorageLayout, dict]:
    """Every shape the columns hold: a 2-d grid of chunks, 1-d shards, a 0-d
    tensor, an empty one, bytes items, requires_grad, an item in two
    extents listed out of order, an extent without a checksum."""
    f32, bf16 = TensorProperties(torch.float32), TensorProperties(torch.bfloat16, requires_grad=True)
    grid = [((r, c), (nr, nc)) for r, nr in ((0, 2), (2, 4)) for c, nc in ((0, 4), (4, 6))]
    tensors = {
        "w2d": (f32, (6, 10), grid),
        "step": None,
        "w1d": (bf16, (12,), [((0,), (4,)), ((4,), (4,)), ((8,), (4,))]),
        "scalar": (TensorProperties(torch.int64), (), [((), ())]),
        "empty": (TensorProperties(torch.float16), (0, 7), [((0, 0), (0, 7))]),
        "note": None,
    }
    sd_md: dict = {}
    extents: dict = {}
    at = [0, 0]

    def place(index, nbytes, parts=1):
        out = []
        for k in range(parts):
            f = k % 2
            n = nbytes // parts + (nbytes % parts if k == parts - 1 else 0)
            blocks = max(1, -(-n // _BLOCK))
            crc = None if index.fqn == "w1d" and k == 0 else "".join(f"{(at[f] + b) % 4096:08x}" for b in range(blocks))
            out.append(fmt.Extent(f, at[f], (nbytes // parts) * k, n, crc))
            at[f] += -(-max(n, 1) // 64) * 64
        extents[index] = out[::-1]  # out of order: the decoders sort by item offset

    for name, spec in tensors.items():
        if spec is None:
            sd_md[name] = BytesStorageMetadata()
            place(MetadataIndex(name), 40)
            continue
        props, size, chunks = spec
        sd_md[name] = TensorStorageMetadata(props, torch.Size(size), [
            ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks])
        for o, n in chunks:
            place(MetadataIndex(name, torch.Size(o)), int(np.prod(n, dtype=np.int64)) * props.dtype.itemsize,
                  parts=2 if (name, o) == ("w2d", (2, 4)) else 1)
    layout = fmt.StorageLayout(_SAVE_ID, 64, [(fmt.data_file_name(_SAVE_ID, 0, 0), at[0]),
                                              (fmt.data_file_name(_SAVE_ID, 1, 0), at[1])], extents, _BLOCK)
    metadata = Metadata(sd_md, planner_data={k: (k,) for k in sd_md})
    return metadata, layout, {"writer": "test", "torch_version": "", "created": 0.0, "world_size": 2}


def _decoded(blob: bytes) -> tuple:
    """What a decode gives, in comparable form."""
    metadata, layout, extra = fmt.decode_metadata(blob, "m")
    return (metadata.state_dict_metadata, list(metadata.state_dict_metadata), metadata.planner_data,
            layout.save_id, layout.alignment, layout.files, layout.checksum_block_bytes,
            {k: list(v) for k, v in layout.extents.items()}, list(layout.extents), extra)


def test_versions_2_and_3_decode_to_the_same_objects(tmp_path):
    for metadata, layout, extra in (_rich(), _saved(tmp_path)):
        v2 = _decoded(fmt.encode_metadata(metadata, layout, extra, version=2))
        v3 = _decoded(fmt.encode_metadata(metadata, layout, extra, version=3))
        assert v2 == v3
    md3 = fmt.decode_metadata(fmt.encode_metadata(*_rich()), "m")[0]
    shared = [c.sizes for c in md3.state_dict_metadata["w1d"].chunks]
    assert shared[0] is shared[1] is shared[2]  # one torch.Size per distinct value, as version 2's decoder


def _saved(tmp_path):
    path = tmp_path / "c"
    dcp.save(mixed_state_dict(3), storage_writer=FastPersistWriter(path))
    return fmt.decode_metadata((path / fmt.METADATA_NAME).read_bytes(), "c")


def _blob(doc: dict) -> bytes:
    body = json.dumps(doc).encode()
    return struct.pack("<8sIIQ", b"FPDCP\x00\r\n", 3, zlib.crc32(body), len(body)) + body


def _rich_doc() -> dict:
    return json.loads(fmt.encode_metadata(*_rich())[24:])


def _refused(doc: dict, words: str) -> None:
    with pytest.raises(fmt.CheckpointFormatError, match=words):
        fmt.decode_metadata(_blob(doc), "m")


def _set_column(doc, section, name, edit) -> dict:
    values = _column(doc[section][name])
    edit(values)
    doc[section][name] = _text(values)
    return doc


@pytest.mark.parametrize("section, name, edit, words", [
    ("state_dict_metadata", "chunk_offsets", lambda v: v.__setitem__(1, 7), "w2d: a chunk outside the tensor"),
    ("state_dict_metadata", "chunk_offsets", lambda v: v.__setitem__(3, 3), "w2d: .*overlap"),
    ("state_dict_metadata", "chunk_sizes", lambda v: v.__setitem__(8, 3), "w1d: .*holding 11 of its 12"),
    ("state_dict_metadata", "size", lambda v: v.__setitem__(2, -1), "w1d: a negative dimension"),
    ("state_dict_metadata", "ndim", lambda v: v.__setitem__(1, 65), "w1d: a rank out of range"),
    ("state_dict_metadata", "chunks", lambda v: v.__setitem__(2, 1 << 62), "scalar: a chunk count out of range"),
    ("state_dict_metadata", "chunks", lambda v: v.__setitem__(1, 1 << 40), "w1d: more chunks than the offsets"),
    ("state_dict_metadata", "chunks", lambda v: v.__setitem__(1, 2), "'chunk_offsets' holds 13 values, not 12"),
    ("extents", "file", lambda v: v.__setitem__(0, 2), "w2d at offset \\[0, 0\\]: an extent outside its data file"),
    ("extents", "length", lambda v: v.__setitem__(3, 1 << 40), "w2d at offset \\[2, 4\\]: an extent outside"),
    ("extents", "file_offset", lambda v: v.__setitem__(1, 0), "extents of .* overlap in data file"),
    ("extents", "items", lambda v: v.__setitem__(0, 1 << 40), "extents for item 1099511627776, which the metadata"),
    ("extents", "items", lambda v: v.__setitem__(1, v[0]), "two extent lists for 'w2d' at offset \\[0, 0\\]"),
    ("extents", "counts", lambda v: v.__setitem__(0, 1 << 50), "w2d: an extent count out of range"),
    ("extents", "unchecked", lambda v: v.append(10 ** 6), "'unchecked' lists an extent out of range"),
])
def test_a_bad_column_is_refused_naming_the_item(section, name, edit, words):
    _refused(_set_column(_rich_doc(), section, name, edit), words)


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["state_dict_metadata"]["dtypes"].__setitem__(0, "float99"), "w2d: unknown dtype 'float99'"),
    (lambda d: d["state_dict_metadata"]["keys"].__setitem__(1, "w2d"), "'w2d' is listed twice"),
    (lambda d: d["state_dict_metadata"].__setitem__("kinds", "tbtxtb"), "kinds"),
    (lambda d: d["state_dict_metadata"].__setitem__("kinds", "tbttt"), "kinds"),
    (lambda d: d["state_dict_metadata"].__setitem__("requires_grad", [True]), "requires_grad is not a list of int"),
    (lambda d: d["state_dict_metadata"].__setitem__("requires_grad", [9]), "requires_grad names a tensor out of"),
    (lambda d: d["state_dict_metadata"].__setitem__("size", "A" * 5), "column 'size' is not valid base64"),
    (lambda d: d["state_dict_metadata"].__setitem__("size", [1, 2]), "column 'size' is not a base64 string"),
    (lambda d: d["state_dict_metadata"].__setitem__("size", "AAAA"), "column 'size' holds 0.375 values"),
    (lambda d: d["extents"].__setitem__("crc32c", d["extents"]["crc32c"][:-1]), "malformed extent checksums"),
    (lambda d: d["extents"].__setitem__("crc32c", d["extents"]["crc32c"].upper()), "malformed extent checksums"),
    (lambda d: d.pop("checksum"), "extents have checksums but the metadata declares none"),
    (lambda d: d.__setitem__("checksum", {"algorithm": "crc32c", "block_bytes": 1}), "malformed extent checksums"),
    (lambda d: d.__setitem__("extents", [[0]]), "extents are not a column section"),
])
def test_a_bad_field_is_refused(edit, words):
    doc = _rich_doc()
    edit(doc)
    _refused(doc, words)


_COLUMNS = [("state_dict_metadata", n) for n in ("ndim", "size", "chunks", "chunk_offsets", "chunk_sizes")] + [
    ("extents", n) for n in ("items", "counts", "file", "file_offset", "item_offset", "length", "unchecked")]


@st.composite
def _edited_doc(draw):
    """The rich document with one to three edits: a column's value moved, a
    value added or dropped, a column or field replaced by any JSON value."""
    doc = _rich_doc()
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["move", "move", "add", "drop", "replace"]))
        section, name = draw(st.sampled_from(_COLUMNS + [("state_dict_metadata", n) for n in (
            "keys", "kinds", "dtypes", "requires_grad")] + [("extents", "crc32c")]))
        value = doc[section].get(name)
        if kind == "replace" or not (type(value) is str and (section, name) in _COLUMNS):
            doc[section][name] = draw(st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=6),
                                                st.lists(st.one_of(st.integers(-2, 12), st.text(max_size=3)),
                                                         max_size=8)))
            continue
        values = _column(value)
        if kind == "add" or not values:
            values.insert(draw(st.integers(0, len(values))), draw(st.integers(-2, 64)))
        elif kind == "drop":
            del values[draw(st.integers(0, len(values) - 1))]
        else:
            i = draw(st.integers(0, len(values) - 1))
            values[i] += draw(st.sampled_from([-64, -8, -1, 1, 2, 8, 64, 1 << 40, -(1 << 62)]))
        doc[section][name] = _text(values)
    return doc


@given(_edited_doc())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_edited_columns_are_refused_or_decode_to_what_version_2_accepts(doc):
    """Never another exception, and never anything version 2's item-by-item
    checks (coverage, bounds, items known, overlaps, checksum lengths) refuse."""
    try:
        metadata, layout, extra = fmt.decode_metadata(_blob(doc), "m")
    except fmt.CheckpointFormatError:
        return
    again = fmt.encode_metadata(metadata, layout, extra, version=2)
    assert _decoded(again) == _decoded(fmt.encode_metadata(metadata, layout, extra, version=3))


def test_chunks_too_costly_to_check_are_refused_naming_the_tensor(monkeypatch):
    """A crafted layout whose overlap only a long sweep decides: refused in
    bounded time, naming the tensor, rather than decoded for minutes."""
    from fp_dcp import coverage

    n = 6
    chunks = [((0, i), (2 * n, 1)) for i in range(n)] + [((j, n), (1, n)) for j in range(2 * n)]
    props = TensorProperties(torch.float32)
    md = Metadata({"t": TensorStorageMetadata(props, torch.Size((2 * n, 2 * n)), [
        ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])})
    extents, at = {}, 0
    for o, s in chunks:
        nbytes = s[0] * s[1] * 4
        extents[MetadataIndex("t", torch.Size(o))] = [fmt.Extent(0, at, 0, nbytes, None)]
        at += nbytes
    layout = fmt.StorageLayout(_SAVE_ID, 1, [(fmt.data_file_name(_SAVE_ID, 0, 0), at)], extents, None)
    blob = fmt.encode_metadata(md, layout, {})
    fmt.decode_metadata(blob, "m")  # checked: disjoint
    monkeypatch.setattr(coverage, "MAX_SWEPT_PAIRS", 20)
    with pytest.raises(fmt.CheckpointFormatError, match="t: .*refused rather than checked"):
        fmt.decode_metadata(blob, "m")
    with pytest.raises(fmt.CheckpointFormatError, match="t: .*refused rather than checked"):
        fmt.decode_metadata(fmt.encode_metadata(md, layout, {}, version=2), "m")


def test_checksum_lengths_past_int64_are_refused():
    """Two extents of 2^60 bytes in 1-byte checksum blocks: 8 hex digits per
    block is 2^63 each, which wraps in int64 and sums to 0 with the other;
    the body's checksum text, made for the remaining extents, must not pass."""
    doc = _rich_doc()
    doc["checksum"]["block_bytes"] = 1
    big = 1 << 60
    doc["files"] += [[fmt.data_file_name(_SAVE_ID, r, 0), big] for r in (2, 3)]
    ext = doc["extents"]
    cols = {name: _column(ext[name]) for name in ("file", "file_offset", "length")}
    unchecked = set(_column(ext["unchecked"]))
    for at, f in ((0, 2), (1, 3)):
        cols["file"][at], cols["file_offset"][at], cols["length"][at] = f, 0, big
    for name, values in cols.items():
        ext[name] = _text(values)
    ext["crc32c"] = "".join("0" * 8 * max(1, n) for i, n in enumerate(cols["length"])
                            if i not in unchecked and i > 1)
    _refused(doc, "malformed extent checksums")
