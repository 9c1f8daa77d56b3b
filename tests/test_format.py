"""The metadata file: golden header bytes, safe decoding, and every kind of
damage refused with an error that names the file."""

from __future__ import annotations

import json
import os
import pickle
import struct
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from fp_dcp import FastPersistReader, FastPersistWriter
from fp_dcp import format as fmt
from tests._sd import FAILED
from fp_dcp.load.reader import read_checkpoint_metadata
from tests._sd import assert_sd_equal, load, metadata_doc_v2, mixed_state_dict, zeros_like_sd


@pytest.fixture()
def ckpt(tmp_path):
    """A checkpoint whose metadata is rewritten in version 2 (per-item
    sections): what most tests here edit item by item."""
    sd = mixed_state_dict(11)
    path = tmp_path / "c"
    dcp.save(sd, storage_writer=FastPersistWriter(path))
    metadata_doc_v2(path)
    return sd, path


def meta_path(path):
    return os.path.join(path, fmt.METADATA_NAME)


def test_header_golden_bytes(ckpt):
    _, path = ckpt
    data = open(meta_path(path), "rb").read()
    assert data[:8] == b"FPDCP\x00\r\n"
    version, crc, length = struct.unpack_from("<IIQ", data, 8)
    assert version == 2
    assert length == len(data) - 24 and crc == zlib.crc32(data[24:])
    doc = json.loads(data[24:])
    assert doc["format"] == "fp_dcp" and doc["format_version"] == 2
    assert doc["checksum"] == {"algorithm": "crc32c", "block_bytes": 1 << 20}
    for _, exts in doc["extents"]:
        for e in exts:  # [file, file_offset, item_offset, length, crc32c hex per 1 MiB block]
            assert len(e) == 5 and len(e[4]) == 8 * max(1, -(-e[3] // (1 << 20)))


def test_version_1_checkpoints_still_load(ckpt):
    """Version 1 (4-field extents, no checksum entry) is read, unchecked."""
    sd, path = ckpt
    doc = json.loads(open(meta_path(path), "rb").read()[24:])
    doc["format_version"] = 1
    del doc["checksum"]
    for _, exts in doc["extents"]:
        for e in exts:
            del e[4:]
    _rewrite(path, json.dumps(doc).encode(), version=1)
    _, layout, _ = read_checkpoint_metadata(str(path))
    assert layout.checksum_block_bytes is None
    assert all(e.crc32c is None for es in layout.extents.values() for e in es)
    target = zeros_like_sd(sd)
    dcp.load(target, storage_reader=FastPersistReader(path))
    assert_sd_equal(sd, target)


def _refused_after(path, edit, message) -> None:
    """``edit`` the metadata document; its decoding must refuse it with ``message``."""
    doc = json.loads(open(meta_path(path), "rb").read()[24:])
    edit(doc)
    _rewrite(path, json.dumps(doc).encode())
    with pytest.raises(fmt.CheckpointFormatError, match=message):
        read_checkpoint_metadata(str(path))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda doc: doc["extents"][0][1][0].__setitem__(4, "xyz"), "malformed extent checksum"),
        (lambda doc: doc["extents"][0][1][0].__setitem__(4, 17), "malformed extent checksum"),
        (lambda doc: doc["extents"][0][1][0].append("00"), "has 6 fields"),
        (lambda doc: doc.__setitem__("checksum", {"algorithm": "xxh3", "block_bytes": 4096}), "checksum algorithm"),
        (lambda doc: doc.__setitem__("checksum", {"algorithm": "crc32c", "block_bytes": 0}), "out of range"),
        (lambda doc: doc.pop("checksum"), "declares none"),
    ],
)
def test_malformed_checksums_in_metadata_are_refused(ckpt, edit, message):
    _refused_after(ckpt[1], edit, message)


def test_checksums_in_a_version_1_body_are_refused(ckpt):
    _, path = ckpt
    doc = json.loads(open(meta_path(path), "rb").read()[24:])
    doc["format_version"] = 1
    _rewrite(path, json.dumps(doc).encode(), version=1)
    with pytest.raises(fmt.CheckpointFormatError, match="malformed checksum entry|5 fields"):
        read_checkpoint_metadata(str(path))


def test_metadata_round_trip_preserves_dcp_metadata(ckpt):
    _, path = ckpt
    metadata, layout, extra = read_checkpoint_metadata(str(path))
    blob = fmt.encode_metadata(metadata, layout, extra)
    again, layout2, _ = fmt.decode_metadata(blob, "x")
    assert again.state_dict_metadata == metadata.state_dict_metadata
    assert again.planner_data == metadata.planner_data
    assert layout2.extents == layout.extents and layout2.files == layout.files


def test_the_structure_encoded_ahead_gives_the_same_metadata_bytes(ckpt):
    """A writer encodes the metadata's structure while its files are
    written (encode_structure) and the rest after: the bytes are those of
    one encoding, also for planner data whose keys and values need the
    codec's tags (tuples, non-string keys, keys like a tag)."""
    _, path = ckpt
    metadata, layout, extra = read_checkpoint_metadata(str(path))
    for planner_data in (metadata.planner_data, {"a": (1, "x"), 2: [None, 1.5], "__t__": {"k": ("p", "q")}}):
        metadata.planner_data = planner_data
        structure = fmt.encode_structure(metadata)
        blob = fmt.encode_metadata(metadata, layout, extra, structure)
        assert blob == fmt.encode_metadata(metadata, layout, extra)
        body = blob[fmt.HEADER_SIZE:]
        assert body == json.dumps(json.loads(body), separators=(",", ":")).encode()
        again, layout2, extra2 = fmt.decode_metadata(blob, "x")
        assert again.planner_data == planner_data and again.state_dict_metadata == metadata.state_dict_metadata
        assert layout2.extents == layout.extents and extra2 == extra


def _rewrite(path, body: bytes, version=2):
    with open(meta_path(path), "wb") as f:
        f.write(struct.pack("<8sIIQ", b"FPDCP\x00\r\n", version, zlib.crc32(body), len(body)) + body)


def _load(path):
    load({"step": 0}, path)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d[:10], "truncated"),
        (lambda d: d[:-5], "truncated"),
        (lambda d: b"garbage!" + d[8:], "bad magic"),
        (lambda d: d[:30] + bytes([d[30] ^ 1]) + d[31:], "checksum mismatch"),
        (lambda d: b"", "truncated"),
    ],
)
def test_damaged_metadata_is_refused_naming_the_file(ckpt, damage, message):
    _, path = ckpt
    data = open(meta_path(path), "rb").read()
    with open(meta_path(path), "wb") as f:
        f.write(damage(data))
    with pytest.raises(fmt.CheckpointFormatError, match=message) as e:
        read_checkpoint_metadata(str(path))
    assert fmt.METADATA_NAME in str(e.value)
    with pytest.raises(FAILED, match=message):
        _load(path)


def test_unknown_format_version_is_refused(ckpt):
    _, path = ckpt
    body = open(meta_path(path), "rb").read()[24:]
    _rewrite(path, body, version=7)
    with pytest.raises(fmt.CheckpointFormatError, match="format version 7; this fp_dcp reads versions 1, 2"):
        read_checkpoint_metadata(str(path))


def test_stock_checkpoint_points_to_the_converter(tmp_path):
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(tmp_path / "s"))
    with pytest.raises(fmt.CheckpointFormatError, match="stock torch.distributed.checkpoint.*fp-dcp convert"):
        read_checkpoint_metadata(str(tmp_path / "s"))


def test_missing_directory_and_interrupted_save(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError) as e:
        read_checkpoint_metadata(str(tmp_path / "nope"))
    assert "nope" in str(e.value)
    _, path = ckpt
    os.unlink(meta_path(path))
    with pytest.raises(FileNotFoundError, match="interrupted before its commit"):
        read_checkpoint_metadata(str(path))


def test_truncated_or_missing_data_file_is_refused(ckpt):
    _, path = ckpt
    _, layout, _ = read_checkpoint_metadata(str(path))
    name, size = layout.files[0]
    os.truncate(os.path.join(path, name), size - 4096)
    with pytest.raises(fmt.CheckpointFormatError, match=f"{name}: data file is truncated"):
        read_checkpoint_metadata(str(path))
    os.unlink(os.path.join(path, name))
    with pytest.raises(FileNotFoundError, match="data file of the checkpoint is missing"):
        read_checkpoint_metadata(str(path))


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/fp_dcp_pwned",))


def test_metadata_crafted_to_run_code_runs_nothing(ckpt):
    _, path = ckpt
    if os.path.exists("/tmp/fp_dcp_pwned"):
        os.unlink("/tmp/fp_dcp_pwned")
    # a pickle payload as the whole file, and smuggled inside the JSON
    with open(meta_path(path), "wb") as f:
        f.write(pickle.dumps(_Boom()))
    with pytest.raises(fmt.CheckpointFormatError):
        read_checkpoint_metadata(str(path))
    body = json.dumps({"format": "fp_dcp", "format_version": 1, "planner_data": pickle.dumps(_Boom()).hex()}).encode()
    _rewrite(path, body)
    with pytest.raises(fmt.CheckpointFormatError):
        read_checkpoint_metadata(str(path))
    assert not os.path.exists("/tmp/fp_dcp_pwned")


def test_extent_outside_the_data_files_is_refused(ckpt):
    _, path = ckpt
    doc = json.loads(open(meta_path(path), "rb").read()[24:])
    doc["extents"][0][1][0][1] = 1 << 40
    _rewrite(path, json.dumps(doc).encode())
    with pytest.raises(fmt.CheckpointFormatError, match="outside the data files"):
        read_checkpoint_metadata(str(path))


@given(st.binary(max_size=300))
@settings(max_examples=200, deadline=None)
def test_fuzzed_metadata_bytes_never_crash(body):
    blob = struct.pack("<8sIIQ", b"FPDCP\x00\r\n", 1, zlib.crc32(body), len(body)) + body
    with pytest.raises(fmt.CheckpointFormatError):
        fmt.decode_metadata(blob, "fuzz")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)


@given(st.sampled_from(["state_dict_metadata", "files", "extents", "planner_data", "save_id", "alignment"]), json_values)
@settings(max_examples=200, deadline=None)
def test_fuzzed_metadata_fields_give_a_format_error_or_a_consistent_result(field, value):
    sd_doc = {
        "format": "fp_dcp", "format_version": 1, "save_id": "s", "alignment": 4096,
        "files": [["s.r0.0.fpd", 8192]],
        "state_dict_metadata": {"w": {"type": "tensor", "dtype": "float32", "size": [4], "chunks": [[[0], [4]]]}},
        "extents": [[["w", [0]], [[0, 0, 0, 16]]]],
        "planner_data": {"w": {"__tuple__": ["w"]}},
    }
    sd_doc[field] = value
    body = json.dumps(sd_doc).encode()
    blob = struct.pack("<8sIIQ", b"FPDCP\x00\r\n", 1, zlib.crc32(body), len(body)) + body
    try:
        metadata, layout, _ = fmt.decode_metadata(blob, "fuzz")
    except fmt.CheckpointFormatError:
        assert field != "planner_data" or not isinstance(value, (int, str, type(None))), "valid metadata refused"
        return
    for exts in layout.extents.values():
        for e in exts:
            assert 0 <= e.file < len(layout.files) and e.file_offset + e.length <= layout.files[e.file][1]


def test_metadata_survives_the_loaded_round_trip(ckpt):
    sd, path = ckpt
    target = zeros_like_sd(sd)
    dcp.load(target, storage_reader=FastPersistReader(path))
    assert_sd_equal(sd, target)


def test_overlapping_extents_are_refused(ckpt):
    """Two items claiming one byte of a file: not a layout fp_dcp writes (the
    fuzzed-layout test in test_faults.py found that it let one item's
    checksummed bytes be read for another's)."""
    _, path = ckpt
    doc = json.loads(open(meta_path(path), "rb").read()[24:])
    (_, a), (_, b) = doc["extents"][0], doc["extents"][1]
    b[0][0], b[0][1] = a[0][0], a[0][1] + max(0, a[0][3] // 2)
    _rewrite(path, json.dumps(doc).encode())
    with pytest.raises(fmt.CheckpointFormatError, match="overlap"):
        read_checkpoint_metadata(str(path))


@pytest.mark.parametrize(
    "edit, message",
    [
        # exact JSON types only: a bool or a float is not a file index, an offset or a length
        (lambda doc: doc["extents"][0][1][0].__setitem__(0, True), "is not an integer"),
        (lambda doc: doc["extents"][0][1][0].__setitem__(1, 0.0), "is not an integer"),
        (lambda doc: doc["extents"][0][1][0].__setitem__(3, "16"), "is not an integer"),
        (lambda doc: doc["extents"][0][1].__setitem__(0, {"file": 0}), "is not a list"),
        (lambda doc: doc["extents"].__setitem__(0, doc["extents"][0][0]), "malformed"),
        (lambda doc: doc["extents"].append(doc["extents"][0]), "two extent lists"),
        (lambda doc: next(m for m in doc["state_dict_metadata"].values() if m["type"] == "tensor")
         .__setitem__("size", [True]), "is not an integer"),
        (lambda doc: next(m for m in doc["state_dict_metadata"].values() if m["type"] == "tensor")
         ["chunks"].__setitem__(0, [[0]]), "malformed chunk|outside tensor"),
        (lambda doc: doc["extents"][0][0].__setitem__(1, [0.5]), "is not an integer"),
    ],
)
def test_malformed_extents_and_sizes_are_refused(ckpt, edit, message):
    """The decoder's fast paths (exact-type checks over whole lists) refuse
    what the per-field checks refused, with the same messages."""
    _refused_after(ckpt[1], edit, message)


def test_decoded_sizes_are_shared_and_equal(ckpt):
    """Equal chunk offsets and sizes decode to one shared ``torch.Size`` each
    (they are immutable), equal to what was saved."""
    sd, path = ckpt
    md, _, _ = read_checkpoint_metadata(str(path))
    by_value: dict = {}
    n = 0
    for fqn, value in sd.items():
        if isinstance(value, torch.Tensor):
            tmd = md.state_dict_metadata[fqn]
            assert tmd.size == value.shape
            for c in tmd.chunks:
                for size in (c.offsets, c.sizes):
                    assert type(size) is torch.Size
                    assert by_value.setdefault(tuple(size), size) is size
                    n += 1
    assert n > len(by_value)  # some were shared


# ------------------------------------------------- the column decoders
# fmt._*_columns decode the per-item sections with checks over whole columns
# and hand anything not plainly valid to the reference decoders
# (fmt._*_checked): they must never accept what the reference refuses, and
# must decode what they accept to equal objects.

_CRC = "0123abcd"


def _column_doc() -> dict:
    """Per-item sections with every shape the writer produces: sharded chunks,
    an item split over two files (listed out of order), a 0-d and an empty
    tensor, a 4-field extent, a two-block checksum, a bytes item."""
    return {
        "state_dict_metadata": {
            "w": {"type": "tensor", "dtype": "float32", "requires_grad": False, "size": [4, 6],
                  "chunks": [[[0, 0], [2, 6]], [[2, 0], [2, 6]]]},
            "b": {"type": "tensor", "dtype": "bfloat16", "requires_grad": True, "size": [5], "chunks": [[[0], [5]]]},
            "s": {"type": "tensor", "dtype": "int64", "size": [], "chunks": [[[], []]]},
            "z": {"type": "tensor", "dtype": "float16", "requires_grad": False, "size": [0, 3],
                  "chunks": [[[0, 0], [0, 3]]]},
            "o": {"type": "bytes"},
        },
        "extents": [
            [["w", [0, 0]], [[0, 0, 0, 48, _CRC]]],
            [["w", [2, 0]], [[0, 64, 24, 24, _CRC], [1, 0, 0, 24, _CRC]]],
            [["b", [0]], [[0, 128, 0, 10]]],
            [["s", []], [[0, 192, 0, 8, _CRC]]],
            [["z", [0, 0]], [[0, 200, 0, 0, _CRC]]],
            [["o", None], [[1, 4096, 0, (1 << 20) + 5, _CRC * 2]]],
        ],
    }


_FILE_SIZES = [8192, 1 << 21]
_BLOCK = 1 << 20


def _paths(value, path=()):
    """Every place in a JSON value: (container path, key or index)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for k, v in items:
        yield path, k
        yield from _paths(v, path + (k,))


_EDGE = (
    [-1, 0, 1, 2, 6, 24, 48, 8192, (1 << 20) + 5, 1 << 40, (1 << 60) + 1, 1 << 63, -(1 << 63) - 1, 1 << 64,
     True, False, 0.0, 1.5, None, "", "0", _CRC, _CRC * 2, _CRC[:7], "0123abcG", "float32", "bool", "tensor",
     "bytes", "w", [], [0], [0, 0], [[0, 0], [2, 6]], {}, {"type": "bytes"}]
)
_edge_values = st.sampled_from(_EDGE)


def _near(value) -> list:
    if type(value) is int:
        return [value - 1, value + 1, -value - 1, value * 2 + 1, float(value), bool(value), str(value), [value]]
    if type(value) is str:
        return [value[:-1], value + "0", value.upper() or "A", "G" + value[1:], value[:-1] + "\u0660", None]
    if type(value) is list:
        return [value[:-1], value + value[-1:], value[::-1], [value], tuple(value) and None]
    return [None, [], {}]


def _mutated(data, doc):
    for _ in range(data.draw(st.integers(1, 3))):
        places = list(_paths(doc))
        path, key = data.draw(st.sampled_from(places))
        parent = doc
        for k in path:
            parent = parent[k]
        how = data.draw(st.sampled_from(["tweak", "tweak", "set", "set", "json", "delete", "duplicate"]))
        if how == "tweak":  # a value near the one there: off by one, another type, one character changed
            parent[key] = data.draw(st.sampled_from(_near(parent[key])))
        elif how == "set":
            parent[key] = data.draw(_edge_values)
        elif how == "json":
            parent[key] = data.draw(json_values)
        elif how == "delete":
            del parent[key]
        elif isinstance(parent, list):
            parent.append(json.loads(json.dumps(parent[key])))
    return doc


def _outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except fmt.CheckpointFormatError as e:
        return "refused", str(e)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # decode_metadata's "malformed metadata"
        return "refused", type(e).__name__


def test_column_decoders_take_every_shape_the_writer_produces():
    """The column decoders accept the valid sections (so the agreement test
    below compares two decodes, not a fallback with itself)."""
    doc = _column_doc()
    columns = fmt._state_dict_md_columns(doc["state_dict_metadata"])
    assert columns is not None
    sd_md, stored = columns
    assert sd_md == fmt._state_dict_md_checked(doc["state_dict_metadata"])
    assert list(sd_md) == list(doc["state_dict_metadata"])
    assert stored == fmt._stored_keys(sd_md)
    for n_fields in ((4, 5), (4,)):
        got = fmt._extents_columns(doc["extents"], _FILE_SIZES, _BLOCK, n_fields)
        if n_fields == (4,):
            assert got is None  # a version-1 body has no checksums: the reference refuses it
            continue
        extents, keys, spans = got
        assert extents == fmt._extents_checked(doc["extents"], _FILE_SIZES, _BLOCK, n_fields)
        assert [e.item_offset for e in extents[fmt.MetadataIndex("w", [2, 0])]] == [0, 24]
        assert stored.issuperset(keys) and fmt._no_overlap_columns(*spans)


def _agree(doc, block=_BLOCK, n_fields=(4, 5)) -> None:
    """The column decoders accept only what the reference accepts, and decode it to equal objects."""
    raw_sd = doc.get("state_dict_metadata")
    if isinstance(raw_sd, dict):
        columns = fmt._state_dict_md_columns(raw_sd)
        reference = _outcome(fmt._state_dict_md_checked, raw_sd)
        if columns is not None:
            assert reference[0] == "ok", f"the column decoder accepted what the reference refuses: {reference[1]}"
            assert columns[0] == reference[1] and list(columns[0]) == list(reference[1])
            assert columns[1] == fmt._stored_keys(reference[1])
    sd_md = fmt._state_dict_md_checked(_column_doc()["state_dict_metadata"])
    raw = doc.get("extents")
    columns = fmt._extents_columns(raw, _FILE_SIZES, block, n_fields)
    reference = _outcome(fmt._extents_checked, raw, _FILE_SIZES, block, n_fields)
    if columns is None:
        return
    assert reference[0] == "ok", f"the column decoder accepted what the reference refuses: {reference[1]}"
    extents, keys, spans = columns
    assert extents == reference[1] and list(extents) == list(reference[1])
    assert keys == [(i.fqn, None if i.offset is None else tuple(i.offset)) for i in extents]
    # the cross-item checks: the column forms decide exactly as the reference ones
    known = _outcome(fmt._check_items_known, extents, sd_md)[0] == "ok"
    assert fmt._stored_keys(sd_md).issuperset(keys) == known
    assert fmt._no_overlap_columns(*spans) == (_outcome(fmt._check_no_overlap, extents)[0] == "ok")


def test_column_decoders_agree_with_the_reference_on_every_single_edit():
    """Each place of the sections set to each value near the one there (off
    by one, another type, a character changed) or to an edge value, deleted,
    or duplicated."""
    edits = 0
    for path, key in list(_paths(_column_doc())):
        value = _column_doc()
        for k in path:
            value = value[k]
        for new in [*_near(value[key]), *_EDGE, "delete", "duplicate"]:
            doc = _column_doc()
            parent = doc
            for k in path:
                parent = parent[k]
            if new == "delete":
                del parent[key]
            elif new == "duplicate":
                if not isinstance(parent, list):
                    continue
                parent.append(json.loads(json.dumps(parent[key])))
            else:
                parent[key] = new
            _agree(doc)
            edits += 1
    assert edits > 3000
    # refused only by a check on the tensor's size itself (no chunk to contradict it)
    for size in ([-1], [1] * 65, [1 << 40, 1 << 40], [True]):
        doc = _column_doc()
        doc["state_dict_metadata"]["b"].update(size=size, chunks=[])
        assert fmt._state_dict_md_columns(doc["state_dict_metadata"]) is None
        assert _outcome(fmt._state_dict_md_checked, doc["state_dict_metadata"])[0] == "refused"


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_column_decoders_agree_with_the_reference_on_mutated_documents(data):
    """Several edits at once, any JSON value, with or without checksums."""
    doc = _mutated(data, _column_doc())
    _agree(doc, data.draw(st.sampled_from([_BLOCK, None, 16])), data.draw(st.sampled_from([(4, 5), (4,)])))
