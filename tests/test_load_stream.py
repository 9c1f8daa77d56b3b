"""A load's items planned in chunks while the chunk before is read (the
per-item cost): the reader's ``Run.stream``.  The reads run on a thread of
their own; each batch's copies and DCP callbacks run on the loading thread,
in order.  Checked here: bit-exact results over many chunks (casts through
the arena, objects, packed small tensors), that planning really overlaps a
read in flight (ordering, not timing), and that an error raised while
planning waits for the read in flight."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistReader, _native
from fp_dcp.load import execute, reader as reader_mod
from tests._sd import FAILED, assert_sd_equal, random_tensor, save, zeros_like_sd

pytestmark = pytest.mark.usefixtures("aio_no_leaks")


def _many_small(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16]
    sd: dict = {}
    for i in range(300):
        n = int(rng.integers(1, 20000))
        shape = (n,) if i % 3 else (max(1, n // 7), 7)
        sd[f"t{i}"] = random_tensor(shape, dtypes[i % len(dtypes)], rng)
    sd["step"] = 7
    sd["cfg"] = {"lr": 0.25, "name": "x"}
    return sd


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few KiB, so a small checkpoint is planned in dozens of them."""
    monkeypatch.setattr(reader_mod, "_PLAN_CHUNK_FIRST_BYTES", 4096)
    monkeypatch.setattr(reader_mod, "_PLAN_CHUNK_MAX_BYTES", 64 << 10)


def test_a_load_planned_in_chunks_is_bit_exact(tmp_path, small_chunks):
    sd = _many_small()
    save(sd, tmp_path / "c")
    target = zeros_like_sd(sd)
    # some targets of another dtype: read into the arena and cast (jobs with temporaries)
    cast = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in list(sd.items())[:40:4]
            if isinstance(v, torch.Tensor) and v.dtype == torch.float32}
    target.update(cast)
    originals = {k: v for k, v in target.items() if isinstance(v, torch.Tensor)}
    with FastPersistReader(tmp_path / "c") as r:
        dcp.load(target, storage_reader=r, no_dist=True)
        s = r.last_stats
    want = dict(sd)
    want.update({k: sd[k].to(torch.float64) for k in cast})
    assert_sd_equal(want, target)
    assert all(target[k] is t for k, t in originals.items())  # loaded in place
    total = sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))
    assert s["engine_calls"] >= 10  # many chunks, each read on its own
    assert s["temp_units"] >= len(cast)
    assert s["bytes"] >= total and s["checksum_bytes"] == s["checksum_verified_bytes"] > 0
    assert _native.stats()["inflight"] == 0


def test_planning_overlaps_the_read_in_flight(tmp_path, small_chunks, monkeypatch):
    """The first read waits until the second chunk is being planned: with
    planning and reading one after the other it would wait in vain."""
    sd = _many_small(1)
    save(sd, tmp_path / "c")
    second_chunk = threading.Event()
    seen: list[bool] = []
    planned = FastPersistReader._planned

    def planned_marking(self, items, planner, run):
        chunks = planned(self, items, planner, run)
        yield next(chunks)
        second_chunk.set()  # the executor asked for the next chunk
        yield from chunks

    read_batch = execute.Run._read_batch

    def read_batch_waiting(self, calls):
        if not seen:
            seen.append(second_chunk.wait(timeout=30))
        return read_batch(self, calls)

    monkeypatch.setattr(FastPersistReader, "_planned", planned_marking)
    monkeypatch.setattr(execute.Run, "_read_batch", read_batch_waiting)
    target = zeros_like_sd(sd)
    with FastPersistReader(tmp_path / "c") as r:
        dcp.load(target, storage_reader=r, no_dist=True)
    assert seen == [True]
    assert_sd_equal(sd, target)


def test_an_error_while_planning_waits_for_the_read_in_flight(tmp_path, small_chunks, monkeypatch):
    """A target of the wrong shape late in the plan fails the load; the read
    already in flight ends before the error leaves the reader (nothing is
    written into the state dict afterwards), and the reader loads again."""
    sd = _many_small(2)
    save(sd, tmp_path / "c")
    failing = threading.Event()
    reads = {"started": 0, "ended": 0}
    read_batch = execute.Run._read_batch

    def read_batch_slow(self, calls):
        reads["started"] += 1
        failing.wait(timeout=10)
        threading.Event().wait(0.2)  # still reading when planning fails
        read_batch(self, calls)
        reads["ended"] += 1

    planned = FastPersistReader._planned
    plan_item = reader_mod.ItemPlanner.plan_item

    def planned_then_failing(self, items, planner, run):
        chunks = planned(self, items, planner, run)
        yield next(chunks)
        failing.set()  # the next item planned fails
        yield from chunks

    def plan_item_failing(self, req, planner, limits):
        if failing.is_set():
            raise ValueError("t_bad: the planner's target has the wrong shape")
        return plan_item(self, req, planner, limits)

    monkeypatch.setattr(execute.Run, "_read_batch", read_batch_slow)
    monkeypatch.setattr(FastPersistReader, "_planned", planned_then_failing)
    monkeypatch.setattr(reader_mod.ItemPlanner, "plan_item", plan_item_failing)
    target = zeros_like_sd(sd)
    with FastPersistReader(tmp_path / "c") as r:
        with pytest.raises(FAILED, match="wrong shape"):
            dcp.load(target, storage_reader=r, no_dist=True)
        assert reads["started"] >= 1 and reads["ended"] == reads["started"]
        assert _native.stats()["inflight"] == 0
        monkeypatch.undo()
        again = zeros_like_sd(sd)
        dcp.load(again, storage_reader=r, no_dist=True)  # the engines are free again
    assert_sd_equal(sd, again)


def test_objects_are_planned_first(tmp_path, small_chunks, monkeypatch):
    """Bytes items come first in the plan (a state dict puts them last): they
    are read in the first batch and unpickled once it is read, while the
    tensors' batches are still to be read, not after the last read."""
    sd = _many_small(3)
    sd.update({f"z_obj{i}": i for i in range(5)})  # after every tensor in the state dict's order
    save(sd, tmp_path / "c")
    finishing = {"batch": -1}
    at_object: list[int] = []
    finish = execute.Run._finish
    load_object = reader_mod.ItemPlanner._load_object

    def finish_counting(self, batch):
        finishing["batch"] += 1
        return finish(self, batch)

    def load_object_noting(self, req, planner, data):
        at_object.append(finishing["batch"])
        return load_object(self, req, planner, data)

    monkeypatch.setattr(execute.Run, "_finish", finish_counting)
    monkeypatch.setattr(reader_mod.ItemPlanner, "_load_object", load_object_noting)
    target = zeros_like_sd(sd)
    with FastPersistReader(tmp_path / "c") as r:
        dcp.load(target, storage_reader=r, no_dist=True)
        calls = r.last_stats["engine_calls"]
    assert_sd_equal(sd, target)
    assert at_object == [0] * 8  # step, cfg.lr, cfg.name and the five, all in the first batch
    assert finishing["batch"] >= 5 and calls >= 5


def test_whole_chunks_through_the_arena_as_for_an_accelerator(tmp_path, small_chunks, monkeypatch):
    """A target on an accelerator takes each whole stored chunk into the
    arena, then one ``copy_`` (``whole_chunk_to_device``).  Here CPU targets
    are sent that way (the only device a CPU machine has): bit-exact, over
    many chunks and batches, every tensor through the arena, none read in
    place."""
    from fp_dcp.load import jobs

    sd = _many_small(3)
    save(sd, tmp_path / "c")
    monkeypatch.setattr(jobs, "whole_chunk_read", lambda *a: False)
    taken = []

    def to_device(sizes, dtype, offsets, lengths, dest, cap):
        ok = (list(lengths) == list(sizes) and not any(offsets) and dest.dtype == dtype and dest.is_contiguous()
              and int(np.prod(lengths)) * dtype.itemsize <= cap)
        taken.append(ok)
        return ok

    monkeypatch.setattr(jobs, "whole_chunk_to_device", to_device)
    target = zeros_like_sd(sd)
    with FastPersistReader(tmp_path / "c") as r:
        dcp.load(target, storage_reader=r, no_dist=True)
        s = r.last_stats
    assert_sd_equal(sd, target)
    n = sum(isinstance(v, torch.Tensor) for v in sd.values())
    assert len(taken) == n and all(taken)
    assert s["temp_units"] == n and s["direct_bytes"] == 0
