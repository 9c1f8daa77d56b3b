"""dcp.async_save with FastPersistWriter as the AsyncStager (fp_dcp.staging).

Safety (what reaches the checkpoint), lifetime (100 saves, leaks, close),
failures (injected, reported, previous checkpoint intact), the memory limit,
PROCESS and THREAD modes on 1 and 2 ranks.  No timing assertions: ordering is
forced with events and gated planners.
"""

from __future__ import annotations

import errno
import gc
import os
import pickle
import threading

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from fp_dcp import FastPersistReader, FastPersistWriter, _native
from fp_dcp.format import METADATA_NAME
from tests._dist import run_ranks
from tests._sd import FAILED, assert_sd_equal, load, mixed_state_dict, zeros_like_sd


hooks = _native.testing()  # fault injection (FP_DCP_TEST_HOOKS=1: tests/conftest.py)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MiB = 1 << 20


def _sd(seed: int = 0) -> dict:
    """Small items of every kind plus large tensors (written zero-copy)."""
    sd = mixed_state_dict(seed)
    g = torch.Generator().manual_seed(seed)
    sd["large"] = {"a": torch.randn(1 << 20, generator=g), "b": torch.randn(700, 1100, generator=g).to(torch.bfloat16)}
    return sd


def _load(path, like):
    out = zeros_like_sd(like)
    load(out, path)
    return out


def _wait(resp):
    """Wait for a save: its upload future (eager) or both futures (lazy)."""
    if isinstance(resp, AsyncSaveResponse):
        resp.staging_completion.result()
        return resp.upload_completion.result()
    return resp.result()


def _clone(sd):
    if isinstance(sd, torch.Tensor):
        return sd.clone()
    if isinstance(sd, dict):
        return {k: _clone(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_clone(v) for v in sd]
    return sd


class _GatedPlanner(DefaultSavePlanner):
    """Holds a save in flight (in its background thread) until the gate opens."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def create_local_plan(self):
        assert self.gate.wait(60), "the test never opened the gate"
        return super().create_local_plan()


def _committed(path) -> bool:
    return os.path.exists(os.path.join(path, METADATA_NAME))


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# ------------------------------------------------------------------ protocol


def test_writer_is_an_async_stager():
    w = FastPersistWriter("/nonexistent")
    assert isinstance(w, AsyncStager)
    assert w.should_synchronize_after_execute is False
    w.synchronize_staging()  # nothing staged: a no-op
    w.close()


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_round_trip_zero_copy_and_return_type(tmp_path, mode, aio_no_leaks):
    sd = _sd()
    with FastPersistWriter(tmp_path / "ck", staging=mode, sync_files=False) as w:
        resp = dcp.async_save(sd, storage_writer=w)
        assert isinstance(resp, AsyncSaveResponse) == (mode == "lazy")
        _wait(resp)
        assert w.last_stats["zero_copy_bytes"] >= sd["large"]["a"].numel() * 4  # written from the arena
        st = w.staging_stats
        payload = st["bytes"]
        assert st["arena_allocated"] and not st["spilled_bytes"]
        # state dict + alignment padding: a page of header, a page per large tensor, 64 B per small one
        assert payload <= st["arena_bytes"] <= payload + 4096 * (2 + 3) + 64 * st["tensors"]
        assert_sd_equal(sd, _load(tmp_path / "ck", sd))
        # same structure again: the arena is reused
        sd["large"]["a"].add_(1)
        _wait(dcp.async_save(sd, storage_writer=w, checkpoint_id=tmp_path / "ck2"))
        assert w.staging_stats["arena_allocated"] is False
        assert_sd_equal(sd, _load(tmp_path / "ck2", sd))


def _extent_crcs(path) -> dict:
    """{(tensor, chunk offset): [crc32c of each extent]} of a checkpoint."""
    from fp_dcp.load.reader import read_checkpoint_metadata

    _, layout, _ = read_checkpoint_metadata(str(path))
    return {(i.fqn, tuple(i.offset or ())): [e.crc32c for e in exts] for i, exts in layout.extents.items()}


@pytest.mark.parametrize("mode,piece,batched", [("eager", None, False), ("lazy", None, False),
                                                ("eager", 3 * MiB, False), ("lazy", None, True)])
def test_staging_copy_checksums_are_the_files_checksums(tmp_path, mode, piece, batched, monkeypatch, aio_no_leaks):
    """The staging copy checksums what it copies (one pass over memory); the
    writer stores those CRCs instead of reading the arena again.  They must be
    exactly the CRCs the engine computes for the same bytes (``batched``:
    the pieces written in several batches, see fp_dcp.save.execute)."""
    from fp_dcp.save import execute
    from fp_dcp.staging import crc_registry
    from fp_dcp.tools.verify import verify_checkpoint

    calls = []
    if batched:
        from fp_dcp.engine import IOSession

        real = IOSession.write_fds
        monkeypatch.setattr(execute, "_BATCHED_PIECES", 2)
        monkeypatch.setattr(execute, "_FIRST_BATCH_BYTES", 4096)
        monkeypatch.setattr(execute, "_BATCH_GROWTH", 2)
        monkeypatch.setattr(IOSession, "write_fds", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))

    sd = _sd(3)
    sd["large"]["c"] = torch.randn(5 * MiB // 4 + 77)  # blocks and a partial last block
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with FastPersistWriter(tmp_path / "ck", staging=mode, sync_files=False) as w:
            if piece:
                w._stager().copier.piece_bytes = piece  # the copy split in pieces over two threads
            _wait(dcp.async_save(sd, storage_writer=w))
            large = sum(t.numel() * t.element_size() for t in sd["large"].values())
            assert w.last_stats["staged_checksum_bytes"] >= large
            assert not crc_registry._STAGED  # used by this save only
            assert len(calls) >= (3 if batched else 0)
            if piece:
                assert w._stager().copier.copy_pool is not None
    finally:
        torch.set_num_threads(threads)
    with FastPersistWriter(tmp_path / "sync", sync_files=False) as w:
        dcp.save(sd, storage_writer=w)  # the engine checksums these
        assert w.last_stats["staged_checksum_bytes"] == 0
    assert _extent_crcs(tmp_path / "ck") == _extent_crcs(tmp_path / "sync")
    assert verify_checkpoint(tmp_path / "ck").ok
    assert_sd_equal(sd, _load(tmp_path / "ck", sd))


@pytest.mark.parametrize(
    "options,fused",
    [({"staging": "lazy"}, True), ({"staging": "eager"}, True), ({"staging": "eager", "staging_checksums": False}, False),
     ({"staging": "lazy", "staging_checksums": False}, False), ({"staging": "lazy", "write_checksums": False}, False)],
)
def test_which_stagings_checksum_in_the_copy(tmp_path, options, fused, aio_no_leaks):
    sd = _sd()
    with FastPersistWriter(tmp_path / "ck", sync_files=False, **options) as w:
        _wait(dcp.async_save(sd, storage_writer=w))
        assert (w.last_stats["staged_checksum_bytes"] > 0) == fused
    crcs = [c for cs in _extent_crcs(tmp_path / "ck").values() for c in cs]
    assert all(c is None for c in crcs) if options.get("write_checksums") is False else all(crcs)
    assert_sd_equal(sd, _load(tmp_path / "ck", sd))


def test_staged_dict_keeps_structure_and_values(tmp_path, aio_no_leaks):
    sd = _sd()
    with FastPersistWriter(tmp_path / "ck") as w:
        staged = w.stage(sd)
        assert_sd_equal(sd, staged)
        assert staged["config"] is not sd["config"]  # non-tensors deep-copied
        sd["config"]["act"] = "relu"
        assert staged["config"]["act"] == "gelu"
        big = staged["large"]["a"]
        assert big.data_ptr() % 4096 == 0 and big.data_ptr() != sd["large"]["a"].data_ptr()
        del staged, big


def test_eager_copy_split_over_threads(tmp_path, aio_no_leaks):
    g = torch.Generator().manual_seed(1)
    sd = {"one": torch.randn(3 << 18, generator=g), "many": [torch.randn(1000 + i, generator=g) for i in range(50)]}
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with FastPersistWriter(tmp_path / "ck", sync_files=False) as w:
            w._stager().copier.piece_bytes = 64 * 1024  # many pieces over three threads
            staged = w.stage(sd)
            assert w._stager().copier.copy_pool is not None  # the copy was split
            assert_sd_equal(sd, staged)
            del staged
    finally:
        torch.set_num_threads(threads)


def test_arena_grows_with_the_structure(tmp_path, aio_no_leaks):
    sd = {"a": torch.ones(1 << 18)}
    with FastPersistWriter(tmp_path / "ck", sync_files=False) as w:
        _wait(dcp.async_save(sd, storage_writer=w, checkpoint_id=tmp_path / "1"))
        first = w.staging_stats["arena_bytes"]
        sd["b"] = torch.full((1 << 19,), 2.0)
        _wait(dcp.async_save(sd, storage_writer=w, checkpoint_id=tmp_path / "2"))
        assert w.staging_stats["arena_allocated"] and w.staging_stats["arena_bytes"] > first
        del sd["b"]  # smaller: the larger arena serves it
        _wait(dcp.async_save(sd, storage_writer=w, checkpoint_id=tmp_path / "3"))
        assert not w.staging_stats["arena_allocated"]
        assert_sd_equal(sd, _load(tmp_path / "3", sd))


# -------------------------------------------------------------------- safety


def test_eager_change_after_return_never_reaches_checkpoint(tmp_path, aio_no_leaks):
    sd = _sd()
    expected = _clone(sd)
    gate = threading.Event()
    with FastPersistWriter(tmp_path / "ck") as w:
        fut = dcp.async_save(sd, storage_writer=w, planner=_GatedPlanner(gate))
        sd["large"]["a"].fill_(-1.0)  # the save has not even planned yet
        sd["d0_float32"].zero_()
        sd["nested"]["list"][0].add_(5)
        gate.set()
        fut.result()
    assert_sd_equal(expected, _load(tmp_path / "ck", expected))


def _hold_copy(w) -> tuple[threading.Event, threading.Event]:
    """Hold ``w``'s next lazy copy back: (set once it is held, set to let it go)."""
    copying = threading.Event()
    release = threading.Event()

    def hold() -> None:
        copying.set()
        assert release.wait(60)

    w._stager().before_copy = hold
    return copying, release


def test_lazy_stage_returns_before_the_copy(tmp_path, aio_no_leaks):
    """A change before staging_completion reaches the checkpoint, one after
    it does not; the future is unresolved while the copy is held back."""
    sd = _sd()
    with FastPersistWriter(tmp_path / "ck", staging="lazy") as w:
        copying, release = _hold_copy(w)
        resp = dcp.async_save(sd, storage_writer=w)
        assert isinstance(resp, AsyncSaveResponse)
        assert copying.wait(60)  # the background copy has started and is held
        assert not resp.staging_completion.done()
        sd["large"]["a"].fill_(7.0)  # before completion: part of the checkpoint
        sd["step"] = 99  # non-tensors were copied by stage(): not part of it
        before = _clone(sd)
        before["step"] = 1234
        release.set()
        resp.staging_completion.result()
        sd["large"]["a"].fill_(-3.0)  # after completion: never in the checkpoint
        sd["large"]["b"].zero_()
        resp.upload_completion.result()
    assert_sd_equal(before, _load(tmp_path / "ck", before))


def test_lazy_stage_takes_each_tensor_as_it_is_when_the_call_returns(tmp_path, aio_no_leaks):
    """What the lazy copy reads is fixed by the call: an entry replaced, or a
    parameter whose ``.data`` is swapped for another shape (as FSDP1 does in
    its forward), while the copy is held back, is saved as it was."""
    p = torch.nn.Parameter(torch.arange(12, dtype=torch.float32).reshape(3, 4))
    sd = {"p": p, "t": torch.arange(5, dtype=torch.int64), "nested": {"u": torch.ones(2, 2, dtype=torch.bfloat16)}}
    before = _clone(sd)
    with FastPersistWriter(tmp_path / "ck", staging="lazy") as w:
        copying, release = _hold_copy(w)
        resp = dcp.async_save(sd, storage_writer=w)
        assert copying.wait(60)
        p.data = torch.full((7,), -1.0)  # p's old storage is left as it was
        sd["t"] = torch.zeros(9, dtype=torch.int64)
        sd["nested"]["u"] = torch.zeros(2, 2, dtype=torch.bfloat16)
        release.set()
        resp.upload_completion.result()
    assert_sd_equal(before, _load(tmp_path / "ck", before))


def test_one_save_in_flight_the_next_waits(tmp_path, aio_no_leaks):
    sd = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    gate = threading.Event()
    seen = []
    with FastPersistWriter(tmp_path / "ck", staging="lazy", sync_files=False) as w:
        first = dcp.async_save(sd, storage_writer=w, checkpoint_id=tmp_path / "1", planner=_GatedPlanner(gate))
        first.staging_completion.result()
        sd["w"].add_(1)
        w._stager().before_copy = lambda: seen.append(_committed(tmp_path / "1"))
        second = dcp.async_save(sd, storage_writer=w, checkpoint_id=tmp_path / "2")
        assert not second.staging_completion.done()  # cannot stage: the first save holds the arena
        gate.set()
        second.staging_completion.result()
        _wait(second)
        first.upload_completion.result()
    assert seen == [True]  # the second copy started only after the first save had committed
    assert torch.equal(_load(tmp_path / "1", sd)["w"], torch.arange(1 << 18, dtype=torch.float32))
    assert torch.equal(_load(tmp_path / "2", sd)["w"], sd["w"])


def test_eager_second_save_waits_for_the_first(tmp_path, aio_no_leaks):
    sd = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    gate = threading.Event()
    seen = []
    with FastPersistWriter(tmp_path / "ck", sync_files=False) as w:
        first = dcp.async_save(sd, storage_writer=w, checkpoint_id=tmp_path / "1", planner=_GatedPlanner(gate))
        w._stager().before_copy = lambda: seen.append(_committed(tmp_path / "1"))
        out = []
        t = threading.Thread(target=lambda: out.append(dcp.async_save(sd, storage_writer=w, checkpoint_id=tmp_path / "2")))
        t.start()
        gate.set()
        t.join(60)
        out[0].result()
        first.result()
    assert seen == [True]  # stage() of the second save blocked until the first had committed


# ------------------------------------------------------------------ lifetime


@pytest.mark.slow
def test_100_saves_bit_exact_flat_rss_no_leaks(tmp_path, aio_no_leaks):
    sd = {"m": {f"l{i}": torch.randn(256, 1024) for i in range(8)}, "s": torch.zeros(3), "step": 0}
    rss = []
    with FastPersistWriter(tmp_path / "ck", sync_files=False) as w:
        for i in range(100):
            w.options = w.options.replace(staging="lazy" if i % 2 else "eager")
            sd["m"][f"l{i % 8}"].add_(1.0)
            sd["s"][i % 3] = i
            sd["step"] = i
            path = tmp_path / f"c{i % 3}"
            _wait(dcp.async_save(sd, storage_writer=w, checkpoint_id=path))
            if i % 9 == 0 or i == 99:
                assert_sd_equal(sd, _load(path, sd))
            if i in (10, 99):
                gc.collect()
                rss.append(_rss())
        assert _native.stats()["buffers"] >= 1  # the arena (and engine buffers) live until close
    assert rss[1] - rss[0] <= 64 * MiB, f"RSS grew by {(rss[1] - rss[0]) / MiB:.1f} MiB over 90 saves"


def test_close_waits_for_the_save_in_flight(tmp_path, aio_no_leaks):
    sd = {"w": torch.ones(1 << 18)}
    gate = threading.Event()
    w = FastPersistWriter(tmp_path / "ck")
    fut = dcp.async_save(sd, storage_writer=w, planner=_GatedPlanner(gate))
    closed = threading.Event()
    t = threading.Thread(target=lambda: (w.close(), closed.set()))
    t.start()
    assert not closed.is_set()  # cannot be set: the save is held by the gate
    gate.set()
    fut.result()
    t.join(60)
    assert closed.is_set()
    assert_sd_equal(sd, _load(tmp_path / "ck", sd))


# ------------------------------------------------------------------ failures


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_injected_write_failure_reported_previous_intact(tmp_path, mode, aio_no_leaks):
    sd = _sd()
    good = _clone(sd)
    path = tmp_path / "ck"
    with FastPersistWriter(path, staging=mode) as w:
        _wait(dcp.async_save(sd, storage_writer=w))
        sd["large"]["a"].add_(1)
        hooks.set_fault("io", errno.EIO, 2)
        try:
            resp = dcp.async_save(sd, storage_writer=w)
            with pytest.raises(FAILED) as ei:
                _wait(resp)
            assert "Input/output error" in str(ei.value) or "EIO" in str(ei.value)
        finally:
            hooks.set_fault("")
        assert_sd_equal(good, _load(path, good))  # the old commit stands
        # the next save reports the failure once ...
        if mode == "eager":
            with pytest.raises(RuntimeError, match="previous async save .* failed"):
                dcp.async_save(sd, storage_writer=w)
        else:
            resp = dcp.async_save(sd, storage_writer=w)
            with pytest.raises(RuntimeError, match="previous async save .* failed"):
                resp.staging_completion.result()
            with pytest.raises(FAILED):
                resp.upload_completion.result()
        assert_sd_equal(good, _load(path, good))
        # ... and the one after it saves
        _wait(dcp.async_save(sd, storage_writer=w))
    assert_sd_equal(sd, _load(path, sd))


def test_lazy_staging_failure_surfaces_on_both_futures(tmp_path, aio_no_leaks):
    sd = {"w": torch.ones(1 << 16)}
    with FastPersistWriter(tmp_path / "ck", staging="lazy") as w:

        def boom() -> None:
            raise MemoryError("injected staging failure")

        w._stager().before_copy = boom
        resp = dcp.async_save(sd, storage_writer=w)
        with pytest.raises(MemoryError, match="injected"):
            resp.staging_completion.result()
        with pytest.raises(FAILED):
            resp.upload_completion.result()
        w._stager().before_copy = None
        with pytest.raises(RuntimeError, match="injected staging failure"):
            dcp.async_save(sd, storage_writer=w).staging_completion.result()
        _wait(dcp.async_save(sd, storage_writer=w))
    assert_sd_equal(sd, _load(tmp_path / "ck", sd))


# ------------------------------------------------------------- memory limit


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_memory_limit_streams_through_the_ring(tmp_path, mode, aio_no_leaks):
    g = torch.Generator().manual_seed(3)
    sd = {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(8)}  # 8 MiB
    sd["small"] = torch.arange(10)
    sd["step"] = 5
    limit = 3 * MiB
    with FastPersistWriter(tmp_path / "ck", staging=mode, staging_memory_limit_bytes=limit, cuda_chunk_bytes=MiB) as w:
        for k in range(2):
            sd["t7"].add_(1)
            resp = dcp.async_save(sd, storage_writer=w, checkpoint_id=tmp_path / f"c{k}")
            if mode == "lazy":
                resp.staging_completion.result()
            expected = _clone(sd)
            for v in sd.values():  # staging is complete: the bytes past the limit are on the spill file
                if isinstance(v, torch.Tensor):
                    v.fill_(0)
            _wait(resp)
            st = w.staging_stats
            assert st["arena_bytes"] <= limit and st["spilled_bytes"] >= 4 * MiB
            assert_sd_equal(expected, _load(tmp_path / f"c{k}", expected))
            sd = _clone(expected)
    assert not [n for n in os.listdir(tmp_path / "c1") if "spill" in n]  # unlinked from the start


# -------------------------------------------------------------------- pickling


def test_writer_and_staged_dict_pickle_cheaply(tmp_path, aio_no_leaks):
    sd = _sd()
    with FastPersistWriter(tmp_path / "ck", staging_shared_memory=True) as w:
        _wait(dcp.async_save(sd, storage_writer=w))
        assert w.staging_stats["arena_shared"]
        clone = pickle.loads(pickle.dumps(w))  # without its engine, lock and arena
        assert clone.path == w.path and clone.options == w.options
        assert "_fp_staging" not in clone.__dict__
        staged = w.stage(sd)
        blob = pickle.dumps(staged)
        assert len(blob) < 64 * 1024  # one handle and the layout, not the 8 MiB of tensors
        back = pickle.loads(blob)  # maps the arena again (here: this process's own)
        assert type(back) is dict
        assert_sd_equal(sd, back)
        del staged, back, blob


# --------------------------------------------------------- PROCESS / THREAD


def _ranks_body(rank, world, root, kind):
    """Eager and lazy async saves of a DTensor state dict on a checkpoint
    group of their own (THREAD) or through the checkpoint process (PROCESS)."""
    import multiprocessing as mp

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fp_dcp.tools.verify import verify_checkpoint

    # run_ranks' workers are daemonic; DCP's PROCESS mode starts a child.
    mp.current_process()._config["daemon"] = False
    ckpt_type = AsyncCheckpointerType[kind]
    pg = dist.new_group(backend="gloo") if kind == "THREAD" else None
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    full = torch.randn(64, 1024, generator=g)
    sd = {
        "model": {
            "sharded": distribute_tensor(full.clone(), mesh, [Shard(0)]),
            "replicated": distribute_tensor(torch.arange(4096.0), mesh, [Replicate()]),
        },
        f"local{rank}": torch.full((1 << 16,), float(rank)),
        "step": 0,
    }
    stats = []
    for mode in ("eager", "lazy"):
        w = FastPersistWriter(staging=mode)
        for i in range(2):
            sd["model"]["sharded"].to_local().add_(1)
            sd["step"] = i
            path = os.path.join(root, f"{mode}{i}")
            resp = dcp.async_save(sd, storage_writer=w, checkpoint_id=path, async_checkpointer_type=ckpt_type, process_group=pg)
            if mode == "lazy":
                resp.staging_completion.result()
            expected = _clone({k: v for k, v in sd.items() if k != "model"})
            expected_full = sd["model"]["sharded"].full_tensor().clone()
            live = sd["model"]["sharded"].to_local()
            kept = live.clone()
            live.fill_(-1.0)  # after staging: not in the checkpoint
            _wait(resp)
            live.copy_(kept)
            stats.append(w.staging_stats)
            out = {
                "model": {
                    "sharded": distribute_tensor(torch.zeros(64, 1024), mesh, [Shard(0)]),
                    "replicated": distribute_tensor(torch.zeros(4096), mesh, [Replicate()]),
                },
                f"local{rank}": torch.zeros(1 << 16),
                "step": -1,
            }
            dcp.load(out, checkpoint_id=path, storage_reader=FastPersistReader(path))
            if rank == 0:  # checksums from the staging copy, in this process or the checkpoint process
                assert verify_checkpoint(path).ok
            assert torch.equal(out["model"]["sharded"].full_tensor(), expected_full)
            assert torch.equal(out["model"]["replicated"].to_local(), torch.arange(4096.0))
            assert out["step"] == expected["step"]
            assert torch.equal(out[f"local{rank}"], torch.full((1 << 16,), float(rank)))
        w.close()
    if kind == "PROCESS":
        # Spill in the checkpoint process, and a failure there reported back.
        w = FastPersistWriter(staging_memory_limit_bytes=MiB, cuda_chunk_bytes=MiB)
        path = os.path.join(root, "limited")
        sd[f"big{rank}"] = torch.randn(3 * MiB // 4, generator=g)
        _wait(dcp.async_save(sd, storage_writer=w, checkpoint_id=path, async_checkpointer_type=ckpt_type))
        assert w.staging_stats["spilled_bytes"] > 0
        out = {f"local{rank}": torch.zeros(1 << 16), f"big{rank}": torch.zeros(3 * MiB // 4)}
        dcp.load(out, checkpoint_id=path, storage_reader=FastPersistReader(path))
        assert torch.equal(out[f"local{rank}"], torch.full((1 << 16,), float(rank)))
        assert torch.equal(out[f"big{rank}"], sd[f"big{rank}"])
        w.close()
        del sd[f"big{rank}"]
        w = FastPersistWriter()
        _wait(dcp.async_save(sd, storage_writer=w, checkpoint_id=path, async_checkpointer_type=ckpt_type))
        blocker = os.path.join(root, f"not-a-dir{rank}")
        open(blocker, "w").close()
        with pytest.raises(FAILED):
            _wait(dcp.async_save(sd, storage_writer=w, checkpoint_id=blocker, async_checkpointer_type=ckpt_type))
        with pytest.raises(RuntimeError, match="checkpoint process failed"):
            dcp.async_save(sd, storage_writer=w, checkpoint_id=path, async_checkpointer_type=ckpt_type)
        _wait(dcp.async_save(sd, storage_writer=w, checkpoint_id=path, async_checkpointer_type=ckpt_type))
        w.close()
    return [(s["arena_shared"], s["arena_allocated"]) for s in stats]


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["THREAD", pytest.param("PROCESS", marks=pytest.mark.slow)])
def test_async_modes_on_ranks(tmp_path, kind, world):
    results = run_ranks(world, _ranks_body, str(tmp_path), kind, timeout=120)
    for per_rank in results:
        shared = [s for s, _ in per_rank]
        if kind == "PROCESS":
            # auto: each writer stages its first save privately, then in shared memory
            assert shared == [False, True, False, True]
        else:
            assert not any(shared)


# ------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_cuda_staging_side_stream_and_ring(tmp_path, mode, aio_no_leaks):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    sd = {
        "w": torch.randn(1 << 20, device="cuda", generator=g),
        "t": torch.randn(512, 768, device="cuda", generator=g).t(),  # non-contiguous
        "cpu": torch.arange(1000),
        "step": 1,
    }
    with FastPersistWriter(tmp_path / "ck", staging=mode) as w:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):  # a producer on another stream: staging must wait for it
            sd["w"].mul_(2)
            resp = dcp.async_save(sd, storage_writer=w)
            if mode == "lazy":
                resp.staging_completion.result()
            expected = _clone({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()})
            sd["w"].zero_()
        _wait(resp)
        assert w._stager().arena.cuda_registered
        out = {k: (torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v) for k, v in expected.items()}
        dcp.load(out, storage_reader=FastPersistReader(tmp_path / "ck"))
        assert_sd_equal(expected, out)
    limited = {"a": torch.randn(1 << 20, device="cuda"), "b": torch.randn(1 << 20, device="cuda")}
    with FastPersistWriter(tmp_path / "lim", staging=mode, staging_memory_limit_bytes=3 * MiB, cuda_chunk_bytes=MiB) as w:
        _wait(dcp.async_save(limited, storage_writer=w))
        assert w.staging_stats["spilled_bytes"] > 0
    out = {k: torch.zeros(1 << 20) for k in limited}
    dcp.load(out, storage_reader=FastPersistReader(tmp_path / "lim"))
    assert all(torch.equal(out[k], limited[k].cpu()) for k in limited)


@pytest.mark.gpu
def test_cuda_sync_save_chunks_checksummed_like_cpu(tmp_path, aio_no_leaks):
    """dcp.save of CUDA tensors (no staging): the writer copies chunk by chunk
    through page-locked buffers on a side stream; chunks of 1.5 MiB cut the
    1 MiB checksum grid, the parts' CRCs are merged: the stored CRCs equal
    those of the same tensors saved from the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from fp_dcp.tools.verify import verify_checkpoint

    g = torch.Generator(device="cuda").manual_seed(2)
    sd = {"w": torch.randn(5 * MiB // 4 + 333, device="cuda", generator=g),
          "b": torch.randn(300, 700, device="cuda", generator=g).to(torch.bfloat16), "cpu": torch.arange(1000)}
    with FastPersistWriter(tmp_path / "gpu", cuda_chunk_bytes=3 * MiB // 2) as w:
        dcp.save(sd, storage_writer=w)
    with FastPersistWriter(tmp_path / "cpu") as w:
        dcp.save({k: v.cpu() for k, v in sd.items()}, storage_writer=w)
    assert _extent_crcs(tmp_path / "gpu") == _extent_crcs(tmp_path / "cpu")
    assert all(c is not None for crcs in _extent_crcs(tmp_path / "gpu").values() for c in crcs)
    assert verify_checkpoint(tmp_path / "gpu").ok
    out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    dcp.load(out, storage_reader=FastPersistReader(tmp_path / "gpu"))
    assert all(torch.equal(out[k], sd[k].cpu()) for k in sd)


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(0, 5000), min_size=1, max_size=30), piece=st.sampled_from([1024, 2048, 4096]),
       block=st.sampled_from([0, 512, 1024, 3000]), threads=st.integers(2, 4))
def test_a_copy_split_over_threads_copies_and_checksums_as_one(lens, piece, block, threads):
    """The staging copy cut in pieces over threads: the arena's bytes and
    each source's CRCs exactly those of one copy on one thread."""
    from fp_dcp.staging.copier import Copier

    rng = np.random.default_rng(len(lens))
    sources = [rng.integers(0, 256, n, dtype=np.uint8) for n in lens]
    offsets = np.cumsum([0] + [n + 7 for n in lens[:-1]]).tolist()
    size = offsets[-1] + lens[-1] + 1
    one, split = bytearray(size), bytearray(size)
    c = Copier()
    want = c._gather(one, offsets, sources, 1, block)
    c.piece_bytes = piece  # (with ``block`` off the piece grid, neither checksums)
    got = c._gather(split, offsets, sources, threads, block)
    if c.copy_pool is not None:
        c.copy_pool.shutdown(wait=True)
    assert split == one
    if want is None or piece % (block or 1):
        return
    assert got is not None and len(got) == len(want)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)
