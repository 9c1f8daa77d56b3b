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

from fp_dcp import FastPersistWriter
from fp_dcp.save.commit import SaveLock
from fp_dcp.gc_freeze import GcFreeze

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
    if gc.get_freeze_count():
        pytest.skip("something in this process froze objects already")
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
        f.freeze()
        gc.freeze()  # the application freezes objects of its own meanwhile
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
