"""The save path's modules on their own (fp_dcp/save/): the commit lock, the
GC freeze and the CUDA device copy (on a GPU, and its logic without one).  The whole path is exercised through
``dcp.save`` by test_roundtrip, test_faults and the multi-rank tests."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fp_dcp import FastPersistWriter
from fp_dcp.gc_freeze import GcFreeze
from fp_dcp.save.commit import SaveLock

MiB = 1 << 20


def test_the_save_lock_is_exclusive_and_a_pickled_copy_holds_none(tmp_path):
    """PROCESS-mode async saves pickle the writer: the copy must take the
    lock itself in its process, not believe it holds the parent's."""
    d = str(tmp_path)
    lock = SaveLock()
    lock.acquire(d)
    lock.acquire(d)  # held: nothing to do
    copy = pickle.loads(pickle.dumps(lock))
    assert copy.fd is None
    with pytest.raises(BlockingIOError, match="another fp_dcp save"):
        copy.acquire(d)
    lock.release()
    lock.release()  # once
    copy.acquire(d)
    copy.release()
    writer = FastPersistWriter(tmp_path)
    writer._lock.acquire(d)
    try:
        assert pickle.loads(pickle.dumps(writer))._lock.fd is None
    finally:
        writer.close()
    assert writer._lock.fd is None


def test_the_gc_freeze_undoes_only_its_own_freeze():
    from fp_dcp.gc_freeze import may_freeze

    if not may_freeze():
        pytest.skip("objects are frozen already, or this interpreter keeps some frozen (fp_dcp.gc_freeze)")
    try:
        f = GcFreeze()
        f.freeze()
        assert f.frozen and gc.get_freeze_count() > 0
        f.thaw()
        f.thaw()  # once
        assert not f.frozen and gc.get_freeze_count() == 0
        with pytest.raises(KeyError):  # a failing step thaws
            f.freeze()
            with f.thaw_on_error():
                raise KeyError("x")
        assert gc.get_freeze_count() == 0
        f.refreeze()  # not frozen: nothing to add to
        assert gc.get_freeze_count() == 0
        f.freeze()
        made_since = [object()]  # a save's plans, made after its freeze
        assert any(o is made_since for o in gc.get_objects())
        f.refreeze()
        assert not any(o is made_since for o in gc.get_objects())  # frozen too
        f.thaw()
        assert not f.frozen and gc.get_freeze_count() == 0  # both undone
        f.freeze()
        gc.freeze()  # the application freezes objects of its own meanwhile
        made_since = [object()]
        f.refreeze()  # adds nothing to the application's freeze
        assert any(o is made_since for o in gc.get_objects())
        f.thaw()
        assert not f.frozen and gc.get_freeze_count() > 0  # left as the application wants them
        gc.unfreeze()
        gc.freeze()  # the application froze first: the save does not freeze
        f.freeze()
        assert not f.frozen
        f.thaw()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def _check_write_cuda(tmp_path, flat: list[torch.Tensor], checksums: bool) -> None:
    """write_cuda on its own: extents of every size (empty, under a block,
    cut by several chunks) land aligned at place_extents' offsets with
    their bytes, and their merged CRCs equal those of the bytes computed in
    one go on the host."""
    from fp_dcp import _native
    from fp_dcp import format as fmt
    from fp_dcp.checksums import crc_hex
    from fp_dcp.engine import IOSession
    from fp_dcp.options import FastPersistOptions
    from fp_dcp.save.device_copy import write_cuda
    from fp_dcp.save.layout import place_extents

    sizes = [int(t.numel()) for t in flat]
    session = IOSession(FastPersistOptions(), str(tmp_path))
    try:
        path = str(tmp_path / "x.bin")
        stats = {"bytes": 0, "requests": 0}
        offsets, lengths, end, crcs = write_cuda(
            session, path, flat, stats, chunk_bytes=3 * MiB // 4, checksums=checksums, sync=True
        )
        align = session.alignment
    finally:
        session.close()
    assert lengths == sizes
    assert (offsets, end) == place_extents(sizes, align, 0, align)
    assert all(o % align == 0 for o in offsets)
    assert stats["bytes"] >= sum(sizes) and stats["requests"] > 0
    with open(path, "rb") as f:
        data = f.read()
    assert len(data) >= end
    for t, o, n, crc in zip(flat, offsets, lengths, crcs):
        host = t.cpu().numpy()
        assert data[o : o + n] == host.tobytes()
        if checksums:
            assert crc == crc_hex(_native.crc32c_blocks(np.ascontiguousarray(host), fmt.CHECKSUM_BLOCK_BYTES))
        else:
            assert crc is None
    os.unlink(path)


_SIZES = [333, 0, 5 * MiB // 2 + 77, MiB, 4097]


@pytest.mark.gpu
@pytest.mark.parametrize("checksums", [True, False])
def test_device_copy_writes_aligned_extents_chunk_by_chunk(tmp_path, checksums, aio_no_leaks):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(3)
    flat = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g) for n in _SIZES]
    _check_write_cuda(tmp_path, flat, checksums)


class _NoStream:
    def __init__(self, device: object = None) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _NoEvent:
    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("checksums", [True, False])
def test_device_copy_logic_without_a_device(tmp_path, checksums, monkeypatch, aio_no_leaks):
    """The same checks with CPU tensors and the stream and event calls made
    no-ops (copies on the CPU are synchronous): the chunking, the double
    buffering and the CRC merge run on machines without CUDA."""
    if torch.cuda.is_available():
        pytest.skip("the GPU test runs the real thing")
    monkeypatch.setattr(torch.cuda, "Stream", _NoStream)
    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    g = torch.Generator().manual_seed(3)
    _check_write_cuda(tmp_path, [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in _SIZES],
                      checksums)


def test_device_copy_that_fails_part_way_waits_for_its_stream_before_freeing_the_buffers(tmp_path, monkeypatch,
                                                                                          aio_no_leaks):
    """A copy into a page-locked buffer that raises after others were queued:
    the side stream is synchronized before the buffers are freed (a DMA
    still in flight would write into freed memory), then the error comes out."""
    if torch.cuda.is_available():
        pytest.skip("the stand-ins replace the CUDA calls")
    from fp_dcp import engine
    from fp_dcp.engine import EngineSet
    from fp_dcp.options import FastPersistOptions
    from fp_dcp.save.device_copy import write_cuda

    log: list[str] = []

    class Stream(_NoStream):
        def synchronize(self) -> None:
            log.append("synchronize")

    closed = engine.PinnedBuffer.close

    def close(self) -> None:
        log.append("free")
        closed(self)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(engine.PinnedBuffer, "close", close)

    class Failing:  # the third source: taking its bytes raises, after two copies were queued
        def numel(self) -> int:
            return 4000

        def __getitem__(self, key: object) -> torch.Tensor:
            raise RuntimeError("injected: a copy failed")

    flat = [torch.zeros(5000, dtype=torch.uint8), torch.ones(300, dtype=torch.uint8), Failing()]
    engines = EngineSet()
    try:
        session = engines.session(FastPersistOptions(), str(tmp_path))
        with pytest.raises(RuntimeError, match="injected"):
            write_cuda(session, str(tmp_path / "d.fpd"), flat, {}, chunk_bytes=1 << 20, checksums=True, sync=False)
    finally:
        engines.close()
    assert log == ["synchronize", "free", "free"]


def test_write_results_one_per_item_in_order_with_each_file_size_on_its_first_item():
    """write_rank's results: one per item written (an item written in parts
    on two devices has both extents), in item order, each file's size on the
    result of the first item with bytes in it, the devices' statistics added."""
    from types import SimpleNamespace

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from fp_dcp.save.execute import _results
    from fp_dcp.save.results import Written

    items = [SimpleNamespace(index=MetadataIndex(f"i{k}", None if k == 3 else (k, 0), k)) for k in range(4)]
    dev0 = ([(2, "a.fpd", 0, 0, 8, "x"), (0, "a.fpd", 64, 0, 4, "y")], [("a.fpd", 4096)], {"bytes": 12, "requests": 1},
            "aio", True)
    dev1 = ([(3, "/d/b.fpd", 0, 0, 5, None), (2, "/d/b.fpd", 64, 8, 8, "z")], [("/d/b.fpd", 8192)],
            {"bytes": 13, "requests": 2}, "aio", True)
    stats = {"engine": None, "direct_io": None, "bytes": 0, "requests": 0}
    results = _results(items, [dev0, dev1], stats)
    assert [r.index for r in results] == [items[k].index for k in (0, 2, 3)]
    assert [r.index.index for r in results] == [0, 2, 3]  # the hints too
    assert [r.size_in_bytes for r in results] == [4, 16, 5]
    assert all(isinstance(r.storage_data, Written) for r in results)
    assert results[1].storage_data.extents == (("a.fpd", 0, 0, 8, "x"), ("/d/b.fpd", 64, 8, 8, "z"))
    # a.fpd's first item is i0, b.fpd's is i2 (item 2 precedes item 3)
    assert [r.storage_data.file_sizes for r in results] == [(("a.fpd", 4096),), (("/d/b.fpd", 8192),), ()]
    assert (stats["bytes"], stats["requests"], stats["engine"]) == (25, 3, "aio")
    # sent to the coordinator as columns: the same results come back
    back = pickle.loads(pickle.dumps(results))
    assert type(back) is type(results) and len(back) == 3 and list(back) == list(results)


def test_results_sent_as_columns_make_the_layout_the_reference_makes_from_them():
    """Every rank's RankResults, pickled as DCP's gather does, give the
    coordinator the layout (columns) that the reference makes from their
    WriteResults one by one; an item two ranks wrote parts of takes the
    reference."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from fp_dcp import format as fmt
    from fp_dcp.save.results import RankResults, _extent_lists, layout_from_results

    crc = "0a0b0c0d"
    a, b, c = (MetadataIndex("a", (0,)), MetadataIndex("b", (0, 4), 7), MetadataIndex("obj"))
    rank0 = RankResults.of_rows([a, b, c], [
        (1, "f1", 64, 8, 4, crc), (0, "f0", 0, 0, 8, crc), (1, "f0", 4096, 0, 8, None), (2, "f1", 0, 0, 5, crc),
    ], {"f0": 4096, "f1": 8192})
    rank1 = RankResults.of_rows([MetadataIndex("c", (2,))], [(0, "f2", 0, 0, 3, crc)], {"f2": 4096})
    split = RankResults.of_rows([MetadataIndex("c", (2,))], [(0, "f3", 0, 3, 2, crc)], {"f3": 4096})
    assert [r.index for r in rank0] == [a, b, c] and rank0[1].storage_data.extents == (
        ("f1", 64, 8, 4, crc), ("f0", 4096, 0, 8, None))  # in the order written
    assert [r.storage_data.file_sizes for r in rank0] == [(("f0", 4096),), (("f1", 8192),), ()]
    for ranks, columns in (([rank0, rank1], True), ([rank0, rank1, split], False)):
        sent = [pickle.loads(pickle.dumps(r)) for r in ranks]
        layout = layout_from_results(sent, "sid", 4096)
        files: dict[str, int] = {}
        flat = [wr for r in ranks for wr in r]
        want = _extent_lists([wr.index for wr in flat], [wr.storage_data for wr in flat], files)
        assert isinstance(layout.extents, fmt.ExtentColumns) is columns
        assert dict(layout.extents) == want and list(layout.extents) == list(want)
        assert [name for name, _ in layout.files] == list(files)
        assert layout.files[:3] == [("f0", 4096), ("f1", 8192), ("f2", 4096)]
        assert layout.checksum_block_bytes == fmt.CHECKSUM_BLOCK_BYTES
        assert layout_from_results([list(r) for r in sent], "sid", 4096).extents == layout.extents  # as lists too
    assert [e.item_offset for e in layout.extents[b]] == [0, 8]  # sorted
    # a rank whose columns do not hold together is named, not merged
    for field, bad, why in (("file", np.array([0, 1, 0, 5]), "outside its 2 file names"),
                            ("file", np.array([0, 1, -1, 1]), "outside its 2 file names"),
                            ("counts", np.array([1, 1, 1]), "do not add up to its 4 extents"),
                            ("counts", np.array([2, 2, 0]), "or an item without one"),
                            ("length", np.array([8, 4, 8]), "extent columns of different lengths"),
                            ("hints", [None], "3 items, 1 hints and 3 extent counts"),
                            ("file_offset", [0, 64, 4096, 0], "not one-dimensional int64 arrays")):
        liar = pickle.loads(pickle.dumps(rank0))
        setattr(liar, field, bad)
        with pytest.raises(RuntimeError, match=rf"rank 1: write results that do not hold together \(.*{why}"):
            layout_from_results([rank1, liar], "sid", 4096)


def test_the_layout_is_made_as_columns_equal_to_the_item_by_item_reference():
    """layout_from_results: where each item was written by one rank, the
    extents come as columns (sorted by item offset within an item, files
    numbered in first-seen order) equal to the reference's lists; an item
    written in parts by two ranks takes the reference."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from fp_dcp import format as fmt
    from fp_dcp.save.results import Written, _extent_lists, layout_from_results

    def result(fqn, offset, extents, sizes=()):
        index = MetadataIndex(fqn, None if offset is None else torch.Size(offset))
        return WriteResult(index=index, size_in_bytes=0, storage_data=Written(tuple(extents), tuple(sizes)))

    crc = "0a0b0c0d"
    rank0 = [result("a", (0,), [("f0", 0, 0, 8, crc)], [("f0", 4096)]),
             result("b", (0, 4), [("f1", 64, 8, 4, crc), ("f0", 4096, 0, 8, crc)], [("f1", 8192)]),
             result("obj", None, [("f1", 0, 0, 5, crc)])]
    rank1 = [result("c", (2,), [("f2", 0, 0, 3, crc)], [("f2", 4096)])]
    split = [result("c", (2,), [("f2", 0, 3, 2, crc)])]  # a second part of rank 1's item

    for results, columns in (([rank0, rank1], True), ([rank0, rank1, split], False)):
        layout = layout_from_results(results, "sid", 4096)
        flat = [wr for r in results for wr in r]
        files: dict[str, int] = {}
        want = _extent_lists([wr.index for wr in flat], [wr.storage_data for wr in flat], files)
        assert isinstance(layout.extents, fmt.ExtentColumns) is columns
        assert dict(layout.extents) == want and list(layout.extents) == list(want)
        assert layout.files == [("f0", 4096), ("f1", 8192), ("f2", 4096)] and list(files) == ["f0", "f1", "f2"]
        assert layout.checksum_block_bytes == fmt.CHECKSUM_BLOCK_BYTES
    b = layout.extents[MetadataIndex("b", torch.Size((0, 4)))]
    assert [e.item_offset for e in b] == [0, 8]  # sorted
    stranger = WriteResult(index=MetadataIndex("odd", None), size_in_bytes=0, storage_data=None)
    with pytest.raises(RuntimeError, match="odd: write result without an fp_dcp record"):
        layout_from_results([rank0, [stranger]], "sid", 4096)


@pytest.mark.parametrize("checksums", [True, False])
def test_columns_encode_and_check_as_the_reference_does(tmp_path, checksums, aio_no_leaks):
    """A save's metadata encoded from the extents' columns is the same bytes
    as from the reference's lists; the coverage check accepts it, and names
    the item when an extent leaves a gap or an item is missing."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from fp_dcp import format as fmt
    from fp_dcp.save.results import check_layout_covers

    sd = _small_state_dict()
    sd["nested"] = {"k": torch.arange(6)}
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path / "c", write_checksums=checksums))
    with open(tmp_path / "c" / fmt.METADATA_NAME, "rb") as f:
        blob = f.read()
    md, layout, extra = fmt.decode_metadata(blob, "c")
    assert isinstance(layout.extents, fmt.ExtentColumns)
    as_lists = dataclasses.replace(layout, extents=dict(layout.extents))
    assert fmt.encode_metadata(md, layout, extra) == fmt.encode_metadata(md, as_lists, extra) == blob
    # the check over the columns (a version-3 structure's item numbers and sizes) and the reference's
    # (a version-2 structure numbers no items)
    for structure in (fmt.encode_structure(md), fmt.encode_structure(md, version=2)):
        check_layout_covers(md, layout, structure)
        ext = layout.extents
        gap = fmt.ExtentColumns(ext.item_keys, ext.counts, ext.file, ext.file_offset, ext.item_offset,
                                ext.length - (ext.item_keys.index(("t3", (0,))) == np.arange(len(ext.length))),
                                ext.crc32c)
        with pytest.raises(RuntimeError, match=r"refusing to commit it: t3: the stored extents hold"):
            check_layout_covers(md, dataclasses.replace(layout, extents=gap), structure)
        keep = [k != ("t5", (0,)) for k in ext.item_keys]
        missing = fmt.ExtentColumns([k for k, y in zip(ext.item_keys, keep) if y], ext.counts[keep],
                                    ext.file[keep], ext.file_offset[keep], ext.item_offset[keep], ext.length[keep],
                                    [c for c, y in zip(ext.crc32c, keep) if y])
        with pytest.raises(RuntimeError, match=r"wrote no bytes for \('t5', \(0,\)\)"):
            check_layout_covers(md, dataclasses.replace(layout, extents=missing), structure)
        # t4 listed twice (its size both times) in place of t5: as many items as the metadata's, not each once
        assert (ext.counts == 1).all()
        at4, at5 = ext.item_keys.index(("t4", (0,))), ext.item_keys.index(("t5", (0,)))
        length = ext.length.copy()
        length[at5] = length[at4]
        twice = fmt.ExtentColumns([("t4", (0,)) if k == ("t5", (0,)) else k for k in ext.item_keys], ext.counts,
                                  ext.file, ext.file_offset, ext.item_offset, length, ext.crc32c)
        with pytest.raises(RuntimeError, match=r"wrote no bytes for \('t5', \(0,\)\)"):
            check_layout_covers(md, dataclasses.replace(layout, extents=twice), structure)


def _small_state_dict(n: int = 40) -> dict:
    g = torch.Generator().manual_seed(5)
    sd = {f"t{k}": torch.randn(1 + 37 * k, generator=g) for k in range(n)}
    sd["step"] = 7
    return sd


def test_the_commit_is_prepared_while_the_data_files_are_synced(tmp_path, monkeypatch, aio_no_leaks):
    """A save of one rank: the coordinator builds the layout and the
    metadata's bytes while its data files' fdatasync is in flight (the fake
    fdatasync returns only once they are built), finish commits those bytes
    without building them again, and the checkpoint loads bit for bit."""
    import threading

    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader
    from fp_dcp.save import execute, writer

    built = threading.Event()
    calls = {"layout": 0, "synced_after_build": []}
    real_layout, real_fdatasync = writer.layout_from_results, os.fdatasync

    def layout(*a, **k):
        calls["layout"] += 1
        out = real_layout(*a, **k)
        built.set()
        return out

    def fdatasync(fd):
        calls["synced_after_build"].append(built.wait(30))
        real_fdatasync(fd)

    monkeypatch.setattr(writer, "layout_from_results", layout)
    monkeypatch.setattr(execute.os, "fdatasync", fdatasync)
    sd = _small_state_dict()
    with FastPersistWriter(tmp_path / "c") as w:
        dcp.save(sd, storage_writer=w)
        assert calls == {"layout": 1, "synced_after_build": [True]}
        assert w.last_stats["prepare_commit_seconds"] > 0 and "finish_seconds" in w.last_stats
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    dcp.load(out, storage_reader=FastPersistReader(tmp_path / "c"))
    assert out["step"] == 7
    assert all(torch.equal(out[k], v) for k, v in sd.items() if isinstance(v, torch.Tensor))


def test_a_batched_save_prepares_its_commit_while_its_last_batch_is_written(tmp_path, monkeypatch, aio_no_leaks):
    """A one-device save of many pieces has the engine write its last batch
    without checksums while this thread computes them: the layout and the
    metadata's bytes are built before that engine call returns (the fake
    returns only once they are), the data files are synced after it, and the
    checkpoint's checksums are those a save in one engine call stores."""
    import threading

    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader
    from fp_dcp.engine import IOSession
    from fp_dcp.save import execute, writer

    sd = _small_state_dict(40)
    with FastPersistWriter(tmp_path / "one") as one_writer:  # one engine call, checksums by the engine
        dcp.save(sd, storage_writer=one_writer)
    built = threading.Event()
    calls: list[tuple[object, bool]] = []  # each engine call's checksums argument, whether built when it returned
    synced_after: list[bool] = []
    real_layout, real_write, real_fdatasync = writer.layout_from_results, IOSession.write_fds, os.fdatasync

    def layout(*a, **k):
        out = real_layout(*a, **k)
        built.set()
        return out

    def write_fds(self, *a, **kw):
        out = real_write(self, *a, **kw)
        calls.append((kw.get("checksums"), built.is_set() or (kw.get("checksums") is False and built.wait(30))))
        return out

    def fdatasync(fd):
        synced_after.append(built.is_set())
        real_fdatasync(fd)

    monkeypatch.setattr(execute, "_BATCHED_PIECES", 2)
    monkeypatch.setattr(execute, "_FIRST_BATCH_BYTES", 512)
    monkeypatch.setattr(writer, "layout_from_results", layout)
    monkeypatch.setattr(IOSession, "write_fds", write_fds)
    monkeypatch.setattr(execute.os, "fdatasync", fdatasync)
    with FastPersistWriter(tmp_path / "batched") as w:
        dcp.save(sd, storage_writer=w)
        assert w.last_stats["bytes"] == one_writer.last_stats["bytes"]  # the last batch's counted too
    assert len(calls) >= 3 and [c for c, _ in calls[:-1]] == [execute.fmt.CHECKSUM_BLOCK_BYTES] * (len(calls) - 1)
    assert calls[-1] == (False, True)  # the last batch: checksummed here, the commit built before it returned
    assert not any(b for _, b in calls[:-1]) and synced_after == [True]
    batched, one = _extents_of(tmp_path / "batched"), _extents_of(tmp_path / "one")
    assert {i: [e[1:] for e in x] for i, x in batched.items()} == {i: [e[1:] for e in x] for i, x in one.items()}
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    dcp.load(out, storage_reader=FastPersistReader(tmp_path / "batched", verify_checksums=True))
    assert out["step"] == 7
    assert all(torch.equal(out[k], v) for k, v in sd.items() if isinstance(v, torch.Tensor))


def test_finish_builds_the_commit_itself_when_handed_other_results(tmp_path, aio_no_leaks):
    """What write_data prepared serves only the very metadata and results
    it was made from: handed a copy of the results, finish builds the
    layout and metadata again, and commits the same checkpoint."""
    import torch.distributed.checkpoint as dcp

    from fp_dcp import format as fmt
    from fp_dcp.save.writer import FastPersistWriter as W

    sd = _small_state_dict()

    class CopyingWriter(W):
        def finish(self, metadata, results):
            self.prepared_was = self._prepared
            return super().finish(metadata, [list(r) for r in results])

    metas = []
    for cls, name in ((W, "a"), (CopyingWriter, "b")):
        with cls(tmp_path / name) as w:
            dcp.save(sd, storage_writer=w)
            if cls is CopyingWriter:
                assert w.prepared_was is not None  # made, but not for these results
        with open(tmp_path / name / fmt.METADATA_NAME, "rb") as f:
            md, layout, _ = fmt.decode_metadata(f.read(), name)
        metas.append((md.state_dict_metadata, md.planner_data, [(i, e) for i, e in layout.extents.items()]))
    assert metas[0] == metas[1]


def test_a_failed_fdatasync_fails_the_save_names_the_file_and_keeps_the_checkpoint(tmp_path, monkeypatch,
                                                                                     aio_no_leaks):
    """The data files' fdatasync runs beside the results' making: its
    failure still fails write_data (the error names the data file), the new
    data files are removed and the previous checkpoint stays the one
    committed."""
    import errno

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from fp_dcp import FastPersistReader
    from fp_dcp import format as fmt
    from fp_dcp.save import execute

    path = tmp_path / "c"
    sd = _small_state_dict()
    dcp.save(sd, storage_writer=FastPersistWriter(path))
    before = sorted(os.listdir(path))
    with open(path / fmt.METADATA_NAME, "rb") as f:
        committed = f.read()

    def fdatasync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(execute.os, "fdatasync", fdatasync)
    sd2 = {k: v + 1 if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    with pytest.raises((OSError, CheckpointException)) as e:
        dcp.save(sd2, storage_writer=FastPersistWriter(path))
    message = str(e.value)
    assert f"{os.strerror(errno.EIO)} (fdatasync)" in message and f".r0.0{fmt.DATA_SUFFIX}" in message
    monkeypatch.undo()
    assert sorted(os.listdir(path)) == before
    with open(path / fmt.METADATA_NAME, "rb") as f:
        assert f.read() == committed
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    dcp.load(out, storage_reader=FastPersistReader(path))
    assert all(torch.equal(out[k], v) for k, v in sd.items() if isinstance(v, torch.Tensor))


def _extents_of(path):
    from fp_dcp import format as fmt

    with open(path / fmt.METADATA_NAME, "rb") as f:
        _, layout, _ = fmt.decode_metadata(f.read(), str(path))
    return {index: [(e.file_offset, e.item_offset, e.length, e.crc32c) for e in exts]
            for index, exts in layout.extents.items()}


def test_host_pieces_are_resolved_batch_by_batch_while_the_batch_before_is_written(tmp_path, monkeypatch,
                                                                                   aio_no_leaks):
    """A one-device save resolves its pieces in growing batches and writes
    each on a thread while the next is resolved (the first engine call, its
    requests going out, waits until a later piece is resolved); each batch starts on a multiple of the
    request size (a write covers whole blocks), so the checkpoint loads bit for bit with
    every checksum checked, and its checksums are the ones a save in one
    batch stores."""
    import threading

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    from fp_dcp import FastPersistReader
    from fp_dcp.engine import IOSession
    from fp_dcp.save import execute

    sd = _small_state_dict(40)
    dcp.save(sd, storage_writer=FastPersistWriter(tmp_path / "one"))  # one batch: every piece < 16 MiB in all

    writing, later = threading.Event(), threading.Event()
    calls: list[tuple[int, bool]] = []
    firsts: list[tuple[int, int]] = []  # each call's first file offset, the engine's request size
    resolved: list[str] = []
    real_write = IOSession.write_fds

    class Planner(DefaultSavePlanner):
        def resolve_data(self, item):
            resolved.append(item.index.fqn)
            if writing.is_set():
                later.set()  # a piece resolved after the first batch was handed to the engine
            return super().resolve_data(item)

    def write_fds(self, fds, paths, file_index, file_offset, sources, **kw):
        first = not writing.is_set()
        writing.set()
        waited: list[bool] = []
        if first:  # the engine call's requests going out: it waits for a later piece
            start = kw["on_start"]

            def on_start():
                start()
                waited.append(later.wait(30))

            kw["on_start"] = on_start
        firsts.append((int(min(file_offset)), self.engine.block_size))
        out = real_write(self, fds, paths, file_index, file_offset, sources, **kw)
        calls.append((len(sources), waited == [True] if first else True))
        return out

    monkeypatch.setattr(execute, "_BATCHED_PIECES", 2)
    monkeypatch.setattr(execute, "_FIRST_BATCH_BYTES", 512)
    monkeypatch.setattr(execute, "_BATCH_GROWTH", 2)
    monkeypatch.setattr(IOSession, "write_fds", write_fds)
    with FastPersistWriter(tmp_path / "batched") as w:
        dcp.save(sd, storage_writer=w, planner=Planner())
    assert len(calls) >= 4 and all(overlapped for _, overlapped in calls)
    assert sum(n for n, _ in calls) == len(sd)  # every piece written once
    # each batch starts on a multiple of the request size: its requests are
    # not split on the way to the disk
    assert firsts[0][0] == 0 and all(at > 0 and at % block == 0 for at, block in firsts[1:])
    assert len(resolved) == len(set(resolved)) == len(sd)  # ... and resolved once
    batched, one = _extents_of(tmp_path / "batched"), _extents_of(tmp_path / "one")
    assert {i: [e[1:] for e in x] for i, x in batched.items()} == {i: [e[1:] for e in x] for i, x in one.items()}
    starts = sorted(e[0] for x in batched.values() for e in x)
    assert starts != sorted(e[0] for x in one.values() for e in x)  # the batches' padding
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    dcp.load(out, storage_reader=FastPersistReader(tmp_path / "batched"))
    assert out["step"] == 7
    assert all(torch.equal(out[k], v) for k, v in sd.items() if isinstance(v, torch.Tensor))


def test_a_piece_that_fails_to_resolve_in_a_later_batch_fails_the_save_and_keeps_the_checkpoint(tmp_path,
                                                                                               monkeypatch,
                                                                                               aio_no_leaks):
    """A planner whose resolve_data fails for a tensor after earlier batches
    were written: the save fails naming it, the new data files are removed
    and the previous checkpoint stays the one committed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.api import CheckpointException

    from fp_dcp import format as fmt
    from fp_dcp.save import execute

    path = tmp_path / "c"
    sd = _small_state_dict(40)
    dcp.save(sd, storage_writer=FastPersistWriter(path))
    before = sorted(os.listdir(path))
    with open(path / fmt.METADATA_NAME, "rb") as f:
        committed = f.read()

    class Planner(DefaultSavePlanner):
        def resolve_data(self, item):
            if item.index.fqn == "t39":
                return "not a tensor"
            return super().resolve_data(item)

    monkeypatch.setattr(execute, "_BATCHED_PIECES", 2)
    monkeypatch.setattr(execute, "_FIRST_BATCH_BYTES", 512)
    with pytest.raises((TypeError, CheckpointException), match="t39"):
        dcp.save(sd, storage_writer=FastPersistWriter(path), planner=Planner())
    assert sorted(os.listdir(path)) == before
    with open(path / fmt.METADATA_NAME, "rb") as f:
        assert f.read() == committed


@pytest.mark.parametrize("batched", [False, True])
def test_the_metadata_structure_is_encoded_while_the_last_batch_is_written(tmp_path, monkeypatch, batched,
                                                                           aio_no_leaks):
    """The coordinator encodes the metadata's structure once every piece is
    resolved and handed to the engine (not on a thread of its own holding the
    GIL while the first batch is resolved), while the engine still writes:
    the one engine call of an unbatched save waits until it is encoded."""
    import threading

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    from fp_dcp import FastPersistReader
    from fp_dcp import format as fmt
    from fp_dcp.engine import IOSession
    from fp_dcp.save import execute

    encoded = threading.Event()
    resolved_before: list[int] = []
    waited: list[bool] = []
    resolved: list[str] = []
    real_encode, real_write = fmt.encode_structure, IOSession.write_fds

    class Planner(DefaultSavePlanner):
        def resolve_data(self, item):
            resolved.append(item.index.fqn)
            return super().resolve_data(item)

    def encode(metadata):
        resolved_before.append(len(resolved))
        out = real_encode(metadata)
        encoded.set()
        return out

    def write_fds(self, *a, **kw):
        out = real_write(self, *a, **kw)
        if not batched:
            waited.append(encoded.wait(30))
        return out

    if batched:
        monkeypatch.setattr(execute, "_BATCHED_PIECES", 2)
        monkeypatch.setattr(execute, "_FIRST_BATCH_BYTES", 512)
    monkeypatch.setattr(fmt, "encode_structure", encode)
    monkeypatch.setattr(IOSession, "write_fds", write_fds)
    sd = _small_state_dict()
    with FastPersistWriter(tmp_path / "c") as w:
        dcp.save(sd, storage_writer=w, planner=Planner())
        assert w.last_stats["prepare_commit_seconds"] > 0
    assert resolved_before == [len(sd)]  # once, after every piece was resolved
    assert waited == ([] if batched else [True])
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    dcp.load(out, storage_reader=FastPersistReader(tmp_path / "c"))
    assert all(torch.equal(out[k], v) for k, v in sd.items() if isinstance(v, torch.Tensor))


def test_bounce_buffers_are_settled_on_a_thread_while_dcp_plans(tmp_path, monkeypatch, aio_no_leaks):
    """A save with small items settles its engine's bounce buffers on a
    thread from prepare_local_plan on; a save of large tensors alone leaves
    them to the first call that needs them (aligned memory never does).
    While that thread still settles, the tensors written in place go first,
    in a call that does not wait for it (nor does the write before it);
    the rest waits for the buffers, and every byte round-trips."""
    import threading

    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader, _native
    from fp_dcp.engine import EngineSet, IOSession

    settling: list[list] = []
    gate = threading.Event()
    calls: list[tuple[bool, int, bool]] = []  # (buffers settled, pieces, gate open) per engine call
    real_settle, real_write = EngineSet.settle_early, IOSession.write_fds

    def settle_early(self, sessions):
        settling.append(list(sessions))

        def slow_settle():  # the first touch of fresh memory, held up until the first call returned
            gate.wait(30)
            for s in sessions:
                s.engine.settle_pool()

        self.in_background(slow_settle, "fp_dcp-settle")

    def write_fds(self, fds, paths, file_index, file_offset, sources, **kw):
        calls.append((self.engine.pool_settled, len(sources), gate.is_set()))
        try:
            return real_write(self, fds, paths, file_index, file_offset, sources, **kw)
        finally:
            gate.set()

    monkeypatch.setattr(EngineSet, "settle_early", settle_early)
    monkeypatch.setattr(IOSession, "write_fds", write_fds)
    _native.release_kept_pools()
    sd = _small_state_dict()
    with FastPersistWriter(tmp_path / "small") as w:
        dcp.save(sd, storage_writer=w)
        assert w._engine().engine.pool_settled
    assert len(settling) == 1 and calls == [(False, len(sd), False)]
    settling.clear()
    calls.clear()
    gate.clear()
    # the next writer's engine takes the closed one's settled buffers: no first touch to wait for
    (tmp_path / "again").mkdir()
    with FastPersistWriter(tmp_path / "again") as w:
        assert w._engine().engine.pool_settled
        dcp.save(sd, storage_writer=w)
    assert settling == [] and [c[:2] for c in calls] == [(True, len(sd))]
    settling.clear()
    calls.clear()
    gate.clear()
    _native.release_kept_pools()

    (tmp_path / "large").mkdir()
    with FastPersistWriter(tmp_path / "large") as w:
        block = w._engine().engine.block_size
        assert not w._engine().engine.pool_settled
        memory = [_native.AlignedBuffer(n) for n in (2 * block, block)]  # page-aligned tensors
        large = {"a": torch.frombuffer(memory[0], dtype=torch.uint8), "b": torch.frombuffer(memory[1], dtype=torch.uint8)}
        for i, t in enumerate(large.values()):
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
        dcp.save(dict(large), storage_writer=w)
        assert settling == [] and calls == [(False, 2, False)]
        assert not w._engine().engine.pool_settled  # aligned memory only: never touched
        calls.clear()
        gate.clear()
        w.reset(tmp_path / "mixed")
        (tmp_path / "mixed").mkdir()
        mixed = {"step": 7, **large, "small": torch.arange(10)}
        dcp.save(mixed, storage_writer=w)
        assert len(settling) == 1
        # the two large tensors first, before the settle ran; then the others
        assert [c[1:] for c in calls] == [(2, False), (2, True)] and not calls[0][0]
        assert w._engine().engine.pool_settled
    out = {"step": 0, "a": torch.zeros_like(large["a"]), "b": torch.zeros_like(large["b"]),
           "small": torch.zeros(10, dtype=torch.int64)}
    dcp.load(out, storage_reader=FastPersistReader(tmp_path / "mixed"))
    assert out["step"] == 7 and torch.equal(out["small"], mixed["small"])
    assert torch.equal(out["a"], large["a"]) and torch.equal(out["b"], large["b"])
    del large, mixed, out
    for m in memory:
        m.close()


def test_engine_set_up_in_the_background_runs_once_until_waited_for():
    """EngineSet.in_background (the writer's early settle, the reader's early
    set-up): the first call wins until settled() waits for it; what the work
    raises is left to the engine call that needs it; the work itself may
    wait (a session made there closes older ones) without waiting for itself."""
    import threading

    from fp_dcp.engine import EngineSet

    engines = EngineSet()
    gate, ran = threading.Event(), []

    def first():
        gate.wait(30)
        engines.settled()  # on its own thread: returns at once
        ran.append("first")

    engines.in_background(first, "fp_dcp-test")
    engines.in_background(lambda: ran.append("second"), "fp_dcp-test")  # the first still runs
    gate.set()
    engines.settled()
    assert ran == ["first"]
    engines.in_background(lambda: 1 / 0, "fp_dcp-test")  # best effort: nothing raised here
    engines.settled()
    engines.in_background(lambda: ran.append("third"), "fp_dcp-test")
    engines.settled()
    assert ran == ["first", "third"]
    engines.close()


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 5000), max_size=40), align=st.sampled_from([1, 512, 4096]),
       chunk_blocks=st.integers(1, 8))
def test_chunk_windows_are_the_extents_each_window_cuts(lengths, align, chunk_blocks):
    """The windows of the CUDA writer and of the spill ring (the extents each
    chunk holds) equal a scan of every extent for every window: each
    non-empty extent cut at the window edges, in order, all of its bytes
    once."""
    from fp_dcp.save.layout import align_up, place_extents
    from fp_dcp.staging.layout import chunk_windows

    offsets, end = place_extents(lengths, align, 0, align)
    chunk = chunk_blocks * align
    span = align_up(end, align)
    got = list(chunk_windows(offsets, lengths, chunk, span))
    want = [(start, [(i, max(o, start), min(o + n, start + chunk))
                     for i, (o, n) in enumerate(zip(offsets, lengths)) if min(o + n, start + chunk) > max(o, start)])
            for start in range(0, span, chunk)]
    assert got == want
    covered = [0] * len(lengths)
    for _, parts in got:
        for i, a, b in parts:
            covered[i] += b - a
    assert covered == lengths


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 5000), max_size=30), cuts=st.lists(st.integers(1, 4999), max_size=30),
       block=st.sampled_from([512, 1024, 4096]), seed=st.integers(0, 2**32 - 1))
def test_extent_crcs_equal_the_merge_of_each_extent(lengths, cuts, block, seed):
    """The CUDA writer's checksums per extent (whole extents in one call)
    equal ``crc_hex(merge_block_crcs(...))`` of each extent's parts: whole,
    cut in two off the block grid, or empty; a part with a CRC missing still
    raises as the merge does."""
    from fp_dcp.checksums import crc_hex, merge_block_crcs
    from fp_dcp.save.device_copy import extent_crcs

    rng = np.random.default_rng(seed)

    def crcs(n: int) -> np.ndarray:
        return rng.integers(0, 2**32, -(-n // block), dtype=np.uint32)

    parts: list = []
    for k, n in enumerate(lengths):
        cut = cuts[k] if k < len(cuts) else 0
        if n == 0:
            parts.append([])
        elif 0 < cut < n:  # two parts, the second starting inside a block when cut is off the grid
            first = crcs(cut)
            second = rng.integers(0, 2**32, len(range(cut, n, block)) if cut % block == 0
                                  else -(-(n - (cut // block + 1) * block) // block) + 1, dtype=np.uint32)
            parts.append([(0, cut, first), (cut, n - cut, second)])
        else:
            parts.append([(0, n, crcs(n))])
    assert extent_crcs(parts, lengths, block) == [crc_hex(merge_block_crcs(p, block)) for p in parts]
    short = [(i, p) for i, p in enumerate(parts) if len(p) == 1 and len(p[0][2]) > 1]
    if short:
        i, p = short[0]
        parts[i] = [(0, p[0][1], p[0][2][:-1])]
        with pytest.raises(ValueError, match="too few CRCs"):
            extent_crcs(parts, lengths, block)


_BYTES_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.complex64]


@settings(max_examples=80, deadline=None)
@given(shape=st.lists(st.integers(0, 4), max_size=4), dtype=st.sampled_from(_BYTES_DTYPES),
       how=st.sampled_from(["plain", "transposed", "sliced", "odd_unit_stride"]))
@example(shape=[1], dtype=torch.float32, how="sliced")  # one element of stride 2 (its flat view keeps it)
def test_the_byte_views_of_a_tensor_are_its_row_major_bytes(shape, dtype, how):
    """``engine.tensor_bytes`` (a save's sources) and ``staging.copier.flat_bytes``
    (the staging copy's): a tensor's row-major bytes, 1-D uint8, a view of its
    memory where it is contiguous (flat_bytes: None where it is not)."""
    from fp_dcp.engine import tensor_bytes
    from fp_dcp.staging.copier import flat_bytes

    t = torch.arange(int(np.prod(shape, dtype=np.int64)) or 0).reshape(shape).to(dtype)
    if how == "transposed" and t.dim() >= 2:
        t = t.transpose(0, -1)
    elif how == "sliced" and t.dim() >= 1:
        t = t[::2]
    elif how == "odd_unit_stride" and t.dim() >= 1:  # a size-1 dimension's stride is anything
        t = t.unsqueeze(0).as_strided((1, *t.shape), (999, *t.stride()))
    want = t.clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8).numpy()
    for name, got in (("tensor_bytes", tensor_bytes(t, "t")), ("flat_bytes", flat_bytes(t))):
        if got is None:
            assert name == "flat_bytes" and not t.is_contiguous()
            continue
        assert got.dtype == np.uint8 and got.ndim == 1 and got.tobytes() == want.tobytes(), name
        if t.is_contiguous() and t.numel() > 1:  # (tensor_bytes may copy a single element of odd stride)
            assert got.ctypes.data == t.data_ptr(), f"{name}: a copy of a contiguous tensor"
