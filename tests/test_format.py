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
from tests._sd import assert_sd_equal, mixed_state_dict, zeros_like_sd


@pytest.fixture()
def ckpt(tmp_path):
    sd = mixed_state_dict(11)
    path = tmp_path / "c"
    dcp.save(sd, storage_writer=FastPersistWriter(path))
    return sd, path


def meta_path(path):
    return os.path.join(path, fmt.METADATA_NAME)


def test_header_golden_bytes(ckpt):
    _, path = ckpt
    data = open(meta_path(path), "rb").read()
    assert data[:8] == b"FPDCP\x00\r\n"
    version, crc, length = struct.unpack_from("<IIQ", data, 8)
    assert version == fmt.FORMAT_VERSION == 2
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


def _rewrite(path, body: bytes, version=fmt.FORMAT_VERSION):
    with open(meta_path(path), "wb") as f:
        f.write(struct.pack("<8sIIQ", b"FPDCP\x00\r\n", version, zlib.crc32(body), len(body)) + body)


def _load(path):
    target = {"step": 0}
    dcp.load(target, storage_reader=FastPersistReader(path))


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
