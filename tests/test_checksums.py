"""Checksums end to end: the writer stores a CRC-32C per block of every
extent, the reader checks every block a read covers whole, ``fp-dcp verify``
checks every block and lists every bad extent; flipped bytes, truncated and
deleted data files are caught and named."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp_dcp import FastPersistReader, _native
from fp_dcp import format as fmt
from fp_dcp.tools import verify as verify_mod
from fp_dcp.tools.cli import main as cli_main
from fp_dcp.checksums import ChecksumError, ReadVerifier, crc_array, crc_hex, merge_block_crcs
from fp_dcp.load.reader import read_checkpoint_metadata
from tests._sd import FAILED, assert_sd_equal, flip_byte, load, mixed_state_dict, save, zeros_like_sd

pytestmark = pytest.mark.usefixtures("aio_no_leaks")


def verify_cli(argv: list[str]) -> int:
    """``fp-dcp verify ARGV``: the command line's exit code."""
    return cli_main(["verify", *argv])

MiB = 1 << 20


def extent_of(path, fqn):
    _, layout, _ = read_checkpoint_metadata(str(path))
    for index, exts in layout.extents.items():
        if index.fqn == fqn:
            e = exts[0]
            return os.path.join(path, layout.files[e.file][0]), e, layout
    raise KeyError(fqn)




@pytest.fixture
def big_ckpt(tmp_path):
    rng = np.random.default_rng(3)
    sd = {
        "w": torch.from_numpy(rng.standard_normal((1024, 1100), dtype=np.float32)),  # 4.3 MiB: 5 blocks
        "b": torch.from_numpy(rng.standard_normal(1000, dtype=np.float32)),  # packed, small
        "step": 7,
    }
    path = tmp_path / "c"
    save(sd, path)
    return sd, path


def test_every_extent_carries_block_checksums_of_its_bytes(big_ckpt):
    sd, path = big_ckpt
    _, layout, _ = read_checkpoint_metadata(str(path))
    assert layout.checksum_block_bytes == fmt.CHECKSUM_BLOCK_BYTES
    for index, exts in layout.extents.items():
        for e in exts:
            with open(os.path.join(path, layout.files[e.file][0]), "rb") as f:
                f.seek(e.file_offset)
                data = f.read(e.length)
            assert e.crc32c == crc_hex(_native.crc32c_blocks(data, layout.checksum_block_bytes)), index


def test_load_checks_every_byte_of_whole_extents(big_ckpt):
    sd, path = big_ckpt
    target = zeros_like_sd(sd)
    r = load(target, path)
    assert_sd_equal(sd, target)
    # a whole load reads every extent whole: every byte it needs is checked
    assert r.last_stats["checksum_verified_bytes"] == r.last_stats["bytes"] > 4 * MiB
    # the verifier's work is bounded by what is read: each byte fed to the CRC once
    assert r.last_stats["checksum_bytes"] == r.last_stats["bytes"] <= r.last_stats["bytes_read"]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_is_refused_naming_tensor_file_and_offset(big_ckpt, where):
    sd, path = big_ckpt
    file, e, _ = extent_of(path, "w")
    at = {"first": 0, "middle": e.length // 2, "last": e.length - 1}[where]
    flip_byte(file, e.file_offset + at)
    with pytest.raises(FAILED) as ei:
        load(zeros_like_sd(sd), path)
    text = str(ei.value)
    assert "checksum mismatch" in text and "w:" in text and os.path.basename(file) in text
    block_start = e.file_offset + at // MiB * MiB
    assert f"at offset {block_start} of" in text
    # the reader's own exception, outside DCP's wrapper
    got = _read_box(path, sd["w"], 0, 1024)
    assert isinstance(got, ChecksumError) and got.errno == 5
    assert got.tensor == "w" and got.filename == file and got.file_offset == block_start
    # turned off, the damaged bytes load (the option exists for salvage)
    target = zeros_like_sd(sd)
    load(target, path, verify_checksums=False)
    assert not torch.equal(target["w"], sd["w"])


def test_partial_reads_check_the_blocks_they_cover(tmp_path):
    """A resharded load (rows 200..800 of a 1024-row tensor) checks the whole
    blocks inside its range; a flip in a block it covers in part only is the
    documented blind spot (fp-dcp verify finds it)."""
    rng = np.random.default_rng(5)
    w = torch.from_numpy(rng.standard_normal((1024, 1024), dtype=np.float32))  # 4 MiB = 4 blocks
    save({"w": w}, tmp_path / "c")
    file, e, _ = extent_of(tmp_path / "c", "w")
    # rows 200..800 (4 KiB each) are bytes [819200, 3276800): blocks 1 and 2 whole, 0 and 3 in part
    flip_byte(file, e.file_offset + MiB + 10)  # block 1: covered whole
    got = _read_box(tmp_path / "c", w, 200, 800)
    assert isinstance(got, ChecksumError), got
    assert got.file_offset == e.file_offset + MiB and got.tensor == "w"
    flip_byte(file, e.file_offset + MiB + 10)  # repaired
    flip_byte(file, e.file_offset + 3 * MiB + 500 * 1024)  # block 3, row 893: a block read in part only
    got = _read_box(tmp_path / "c", w, 200, 800)
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, w[200:800])  # the flipped byte lies outside the rows read
    report = verify_mod.verify_checkpoint(tmp_path / "c")
    assert not report.ok and [b.file_offset for b in report.bad] == [e.file_offset]
    assert "1 of 4 checksum block(s) bad" in report.bad[0].reason
    assert f"at offset {e.file_offset + 3 * MiB}" in report.bad[0].reason


def _read_box(path, w, a, b):
    """Rows a..b of the stored tensor "w" as a resharded load reads them (one
    ReadItem of a box of the stored chunk), or the ChecksumError it raised."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    r = FastPersistReader(path)
    try:
        md = r.read_metadata()
        r.set_up_storage_reader(md, True)
        out = torch.zeros(b - a, w.shape[1])

        class P(DefaultLoadPlanner):
            def resolve_tensor(self, read_item):
                return out

            def commit_tensor(self, read_item, tensor):
                pass

        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex("w", torch.Size([0, 0])),
            dest_offsets=torch.Size([0, 0]),
            storage_index=MetadataIndex("w", torch.Size([0, 0])),
            storage_offsets=torch.Size([a, 0]),
            lengths=torch.Size([b - a, w.shape[1]]),
        )
        try:
            r.read_data(LoadPlan([item]), P()).wait()
        except ChecksumError as e:
            return e
        return out
    finally:
        r.close()


# ------------------------------------------------------------------ fp-dcp verify


def test_verify_a_good_checkpoint(big_ckpt, capsys):
    sd, path = big_ckpt
    report = verify_mod.verify_checkpoint(path, workers=2)
    assert report.ok and report.bad == [] and report.errors == []
    assert report.verified_bytes == report.bytes > 4 * MiB
    assert report.unchecked_extents == 0
    assert verify_cli([str(path)]) == 0
    assert "OK" in capsys.readouterr().out


def test_verify_lists_every_bad_extent(tmp_path, capsys):
    rng = np.random.default_rng(8)
    sd = {f"t{i}": torch.from_numpy(rng.standard_normal(300000 + 1000 * i, dtype=np.float32)) for i in range(6)}
    sd["small"] = torch.arange(10)
    path = tmp_path / "c"
    save(sd, path)
    bad = []
    for name, at in (("t1", 5), ("t4", 1000000), ("small", 3)):
        file, e, _ = extent_of(path, name)
        flip_byte(file, e.file_offset + at)
        bad.append((name, file, e.file_offset))
    report = verify_mod.verify_checkpoint(path, workers=3)
    assert not report.ok
    assert sorted((b.tensor, b.path, b.file_offset) for b in report.bad) == sorted(bad)
    assert verify_cli([str(path)]) == 1
    out = capsys.readouterr().out
    for name, file, off in bad:
        assert f"BAD {name}: file {file} offset {off}" in out
    assert verify_cli([str(path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and len(doc["bad"]) == 3


def test_verify_shares_one_big_file_among_workers(big_ckpt, monkeypatch):
    """Work is cut in batches, so the workers share a single large file; an
    extent read in several batches is still reported once, all its bad blocks
    counted."""
    sd, path = big_ckpt
    monkeypatch.setattr(verify_mod, "_BATCH_BYTES", 2 * MiB)
    file, e, _ = extent_of(path, "w")
    flip_byte(file, e.file_offset + 100)
    flip_byte(file, e.file_offset + 4 * MiB + 7)
    report = verify_mod.verify_checkpoint(path, workers=3)
    assert report.workers == 3 and report.verified_bytes == report.bytes
    assert len(report.bad) == 1
    b = report.bad[0]
    assert (b.tensor, b.path, b.file_offset, b.bad_blocks, b.blocks) == ("w", file, e.file_offset, 2, 5)
    assert f"2 of 5 checksum block(s) bad; first: checksum mismatch at offset {e.file_offset}" in b.reason


def test_verify_reports_missing_and_truncated_files(tmp_path, capsys):
    sd = {"a": torch.ones(200000), "b": torch.ones(300000)}
    path = tmp_path / "c"
    # two files: one per data directory
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    d1.mkdir()
    d2.mkdir()
    save(sd, path, data_dirs=(str(d1), str(d2)))
    _, layout, _ = read_checkpoint_metadata(str(path))
    names = [os.path.join(path, n) for n, _ in layout.files]
    assert len(names) == 2
    os.truncate(names[0], 4096)
    os.unlink(names[1])
    report = verify_mod.verify_checkpoint(path)
    assert not report.ok
    assert any("truncated" in e and names[0] in e for e in report.errors)
    assert any(names[1] in e for e in report.errors)
    assert {b.path for b in report.bad} == set(names)
    assert verify_cli([str(path)]) == 1
    out = capsys.readouterr().out
    assert "ERROR" in out and "BAD" in out


def test_verify_without_metadata_or_on_a_stock_checkpoint(tmp_path, capsys):
    assert verify_cli([str(tmp_path / "nope")]) == 1
    assert "no checkpoint directory" in capsys.readouterr().err
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(tmp_path / "s"))
    assert verify_cli([str(tmp_path / "s")]) == 1
    assert "fp-dcp convert" in capsys.readouterr().err


def test_checkpoint_written_without_checksums_loads_and_verifies_unchecked(tmp_path, capsys):
    sd = mixed_state_dict(4)
    save(sd, tmp_path / "c", write_checksums=False)
    _, layout, _ = read_checkpoint_metadata(str(tmp_path / "c"))
    assert layout.checksum_block_bytes is None
    target = zeros_like_sd(sd)
    r = load(target, tmp_path / "c")
    assert_sd_equal(sd, target)
    assert r.last_stats.get("checksum_verified_bytes", 0) == 0
    report = verify_mod.verify_checkpoint(tmp_path / "c")
    assert report.ok and report.verified_bytes == 0 and report.unchecked_extents == report.extents
    assert verify_cli([str(tmp_path / "c")]) == 0
    assert "written without checksums" in capsys.readouterr().out


# ------------------------------------------------------------------ the verifier on arbitrary reads


@st.composite
def extents_and_reads(draw):
    block = draw(st.sampled_from([64, 100, 4096]))
    n = draw(st.integers(1, 6))
    exts, pos = [], 0
    for i in range(n):
        pos += draw(st.integers(0, 300))
        length = draw(st.integers(0, 3 * block + 50))
        exts.append((pos, length))
        pos += length
    size = pos + draw(st.integers(0, 200))
    reads = []
    for _ in range(draw(st.integers(1, 8))):
        a = draw(st.integers(0, max(0, size - 1)))
        b = draw(st.integers(a, size))
        reads.append((a, b))
    flips = draw(st.lists(st.integers(0, max(0, size - 1)), max_size=3))
    return block, exts, size, sorted(reads), flips


@given(extents_and_reads(), st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_verifier_flags_exactly_the_bad_whole_blocks(tmp_path, case, seed):
    """Random extents, random (overlapping, extent-straddling) reads, random
    flipped bytes: every block a read covers whole is compared; a flipped
    byte in such a block is reported at that block; nothing else is."""
    block, exts, size, reads, flips = case
    flips = {f for f in flips if f < size}
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    extents = {}
    for i, (off, length) in enumerate(exts):
        crcs = _native.crc32c_blocks(data[off:off + length].tobytes(), block)
        extents[fmt.MetadataIndex(f"t{i}")] = [fmt.Extent(0, off, 0, length, crc_hex(crcs))]
    layout = fmt.StorageLayout("s", 4096, [("f", size)], extents, checksum_block_bytes=block)
    bad = data.copy()
    for f in flips:
        bad[f] ^= 0x10
    path = str(tmp_path / f"v{seed}")
    bad.tofile(path)
    v = ReadVerifier(layout, [path])
    bufs = [np.empty(b - a, np.uint8) for a, b in reads]
    views = [memoryview(x) for x in bufs]
    files, offs, views, check = v.plan(np.zeros(len(reads), np.int64), np.array([a for a, _ in reads]), views)
    assert sum(x.nbytes for x in views) == sum(b - a for a, b in reads)
    with _native.Engine("threads", alignment=4096, block_size=4096, queue_depth=2) as eng:
        fd = eng.open(path, "r", direct=False)
        try:
            stats = eng.read([fd], [path], np.zeros(len(views), np.int64), offs, views, **check.engine_kwargs)
        finally:
            os.close(fd)
    verified, found = check.compare(stats)
    # counted work: only pieces covering a block whole go through the CRC, once
    assert stats["checksum_bytes"] == sum(x.nbytes for x, k in zip(views, check.inside) if k)
    assert stats["checksum_bytes"] <= sum(b - a for a, b in reads)
    # the expected answer, block by block
    expect_bad, expect_bytes = set(), 0
    for off, length in exts:
        for k in range(max(1, -(-length // block))):
            s, e = off + k * block, off + min((k + 1) * block, length)
            if e <= s:
                continue
            if not any(a <= s and e <= b for a, b in reads):
                continue
            covering = [1 for a, b in reads if a <= s and e <= b]
            expect_bytes += (e - s) * len(covering)
            if any(s <= f < e for f in flips):
                expect_bad.add(s)
    assert {b.file_offset for b in found} == expect_bad
    assert verified == expect_bytes
    for x in views:
        x.release()


def test_crc_hex_round_trip():
    a = np.array([0, 1, 0xDEADBEEF, 0xFFFFFFFF], dtype=np.uint32)
    assert crc_hex(a) == "0000000000000001deadbeefffffffff"
    assert np.array_equal(crc_array(crc_hex(a)), a)


# ------------------------------------------------ pieces checksummed in parts


def _part_crcs(data: bytes, origin: int, length: int, block: int) -> list[int]:
    """What the engine reports for bytes origin..origin+length of a piece with
    checksum_origin=origin: one CRC per grid block touched (reference)."""
    out, pos, end = [], origin, origin + length
    while pos < end:
        stop = min((pos // block + 1) * block, end)
        out.append(_native.crc32c(data[pos:stop]))
        pos = stop
    return out or [0]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 5000),
    block=st.sampled_from([1, 7, 64, 512, 4096]),
    cuts=st.lists(st.integers(0, 5000), max_size=8),
    seed=st.integers(0, 2**16),
)
def test_merge_block_crcs_joins_parts_on_the_grid(n, block, cuts, seed):
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    bounds = [0] + sorted({c for c in cuts if 0 < c < n}) + [n]
    parts = [(a, b - a, _part_crcs(data, a, b - a, block)) for a, b in zip(bounds[:-1], bounds[1:])]
    assert merge_block_crcs(parts, block).tolist() == _native.crc32c_blocks(data, block).tolist()


def test_merge_block_crcs_refuses_parts_that_do_not_fit():
    with pytest.raises(ValueError, match="not consecutive"):
        merge_block_crcs([(0, 10, [1]), (11, 5, [2])], 64)
    with pytest.raises(ValueError, match="too many"):
        merge_block_crcs([(0, 10, [1, 2])], 64)
    with pytest.raises(ValueError, match="too few"):
        merge_block_crcs([(0, 100, [1])], 64)


def test_engine_parts_with_checksum_origin_merge_to_the_whole(tmp_path):
    """The CUDA write path's scheme on the CPU: a piece written chunk by chunk
    (parts cut off the checksum grid), each part checksummed by the engine on
    the piece's grid, merged: equal to the CRCs of the whole piece."""
    block = fmt.CHECKSUM_BLOCK_BYTES
    data = np.random.default_rng(5).integers(0, 256, 3 * block + 12345, dtype=np.uint8)
    cuts = [0, 4096, block + 8192, 2 * block, 3 * block + 4096, data.size]
    parts = []
    with _native.Engine("auto") as eng:
        fd = eng.open(str(tmp_path / "f"), "w")
        try:
            for a, b in zip(cuts[:-1], cuts[1:]):
                s = eng.write([fd], ["f"], np.zeros(1, np.int64), np.asarray([a], np.int64), [data[a:b]],
                              sync=False, checksums=block, checksum_origin=np.asarray([a], np.int64))
                parts.append((a, b - a, s["crc32c"]))
        finally:
            os.close(fd)
    assert merge_block_crcs(parts, block).tolist() == _native.crc32c_blocks(data, block).tolist()
    assert (tmp_path / "f").read_bytes()[: data.size] == data.tobytes()  # (padded to a block)


def test_the_verifier_lays_out_a_decoded_layouts_columns_as_its_dict(big_ckpt):
    """A decoded layout's extents are columns (fmt.ExtentColumns): the
    verifier's tables from them are those it makes from the same extents as
    a dict of Extent lists."""
    _, path = big_ckpt
    _, layout, _ = read_checkpoint_metadata(str(path))
    assert isinstance(layout.extents, fmt.ExtentColumns)
    paths = fmt.data_file_paths(str(path), layout)
    a = ReadVerifier(layout, paths)
    as_dict = fmt.StorageLayout(layout.save_id, layout.alignment, layout.files, dict(layout.extents),
                                layout.checksum_block_bytes)
    b = ReadVerifier(as_dict, paths)
    assert a.enabled and b.enabled and a.items == b.items and a.shift == b.shift
    for name in ("e_file", "e_off", "e_len", "e_base", "e_item", "e_io", "crcs", "bounds"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    unchecked = fmt.StorageLayout(layout.save_id, layout.alignment, layout.files, layout.extents, None)
    assert not ReadVerifier(unchecked, paths).enabled


@given(st.lists(st.integers(-(1 << 62), 1 << 62), max_size=200))
def test_sorted_unique_equals_numpys(values):
    """The read verifier's boundaries: ``np.unique``'s result (values, order
    and dtype) without its first-call import of ``numpy.ma``."""
    from fp_dcp.checksums import _sorted_unique

    a = np.array(values, dtype=np.int64)
    got, want = _sorted_unique(a), np.unique(a)
    assert got.dtype == want.dtype and np.array_equal(got, want)
