"""dcp.save / dcp.load round trips through fp_dcp, bit-exact, on one process;
the same state dicts through the stock FileSystemWriter/Reader must give the
same result (the uvloop habit: one suite, two backends)."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp_dcp import FastPersistOptions, FastPersistReader, FastPersistWriter, _native
from fp_dcp import format as fmt
from tests._sd import FAILED, root_error
from fp_dcp.options import override
from tests._sd import DTYPES, assert_sd_equal, bits_equal, mixed_state_dict, random_tensor, zeros_like_sd

BACKENDS = ["fp_dcp", "stock"]


def save(sd, path, backend, **kw):
    if backend == "fp_dcp":
        writer = FastPersistWriter(path, **kw)
    else:
        writer = dcp.FileSystemWriter(path)
    dcp.save(sd, storage_writer=writer)
    return writer


def load(sd, path, backend, **kw):
    reader = FastPersistReader(path, **kw) if backend == "fp_dcp" else dcp.FileSystemReader(path)
    dcp.load(sd, storage_reader=reader)
    return reader


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_dtype_and_shape_class_round_trips(tmp_path, backend):
    sd = mixed_state_dict(1)
    save(sd, tmp_path / "ckpt", backend)
    target = zeros_like_sd(sd)
    load(target, tmp_path / "ckpt", backend)
    assert_sd_equal(sd, target)


def test_fp_dcp_and_stock_give_the_same_tensors(tmp_path):
    sd = mixed_state_dict(2)
    results = []
    for backend in BACKENDS:
        save(sd, tmp_path / backend, backend)
        target = zeros_like_sd(sd)
        load(target, tmp_path / backend, backend)
        results.append(target)
    assert_sd_equal(results[0], results[1])


@pytest.mark.parametrize("engine", _native.available_engines())
def test_each_engine_round_trips(tmp_path, engine):
    sd = mixed_state_dict(3)
    writer = save(sd, tmp_path / "c", "fp_dcp", engine=engine)
    assert writer.last_stats["engine"] == engine
    target = zeros_like_sd(sd)
    reader = load(target, tmp_path / "c", "fp_dcp", engine=engine)
    assert reader.last_stats["engine"] == engine
    assert_sd_equal(sd, target)


def test_fallback_on_a_file_system_without_o_direct(tmp_path, monkeypatch):
    # tmpfs refuses O_DIRECT on older kernels (EINVAL at open); newer ones accept
    # it, so inject the refusal where the probe would see it.
    import tempfile

    import fp_dcp.engine

    monkeypatch.setattr(fp_dcp.engine._native, "direct_io_supported", lambda d: False)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else tmp_path) as d:
        sd = mixed_state_dict(4)
        writer = save(sd, os.path.join(d, "c"), "fp_dcp")
        assert writer.last_stats["direct_io"] is False
        assert writer.last_stats["engine"] == "threads"
        target = zeros_like_sd(sd)
        load(target, os.path.join(d, "c"), "fp_dcp")
        assert_sd_equal(sd, target)
        with pytest.raises(FAILED, match="refuses O_DIRECT but FastPersistOptions.direct_io=True"):
            save(sd, os.path.join(d, "c2"), "fp_dcp", direct_io=True)


@st.composite
def state_dicts(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sd = {}
    for i in range(draw(st.integers(1, 8))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 9), max_size=3)))
        t = random_tensor(shape, dtype, rng)
        kind = draw(st.sampled_from(["plain", "transposed", "sliced"]))
        if kind == "transposed" and t.dim() >= 2:
            t = t.transpose(0, 1)
        elif kind == "sliced" and t.dim() >= 1 and t.shape[-1] > 1:
            t = t[..., ::2]
        sd[f"t{i}"] = t
    if draw(st.booleans()):
        sd["extra"] = {"n": draw(st.integers()), "s": draw(st.text(max_size=8))}
    return sd


@given(state_dicts())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_generated_state_dicts_round_trip_bit_exact(tmp_path, sd):
    path = tmp_path / f"h{os.getpid()}"
    save(sd, path, "fp_dcp")
    target = zeros_like_sd(sd)
    load(target, path, "fp_dcp")
    assert_sd_equal(sd, target)


def test_load_into_non_contiguous_and_other_dtype_targets(tmp_path):
    rng = np.random.default_rng(5)
    w = random_tensor((40, 30), torch.float32, rng)
    save({"w": w}, tmp_path / "c", "fp_dcp")
    t = torch.zeros(30, 40).t()  # a non-contiguous target
    load({"w": t}, tmp_path / "c", "fp_dcp")
    assert bits_equal(t.contiguous(), w)
    # a target of another dtype is cast, as the stock reader does
    w = torch.randn(40, 30)
    save({"w": w}, tmp_path / "d", "fp_dcp")
    for backend in BACKENDS:
        save({"w": w}, tmp_path / backend, backend)
        t = torch.zeros(40, 30, dtype=torch.float64)
        load({"w": t}, tmp_path / backend, backend)
        assert torch.equal(t, w.double())


def test_partial_load_reads_only_the_keys_asked_for(tmp_path):
    rng = np.random.default_rng(6)
    sd = {"a": random_tensor((256, 1024), torch.float32, rng), "b": random_tensor((256, 1024), torch.float32, rng)}
    save(sd, tmp_path / "c", "fp_dcp")
    target = {"b": torch.zeros(256, 1024)}
    reader = load(target, tmp_path / "c", "fp_dcp")
    assert bits_equal(target["b"], sd["b"])
    assert reader.last_stats["bytes"] == 256 * 1024 * 4
    assert reader.last_stats["bytes_read"] == 256 * 1024 * 4  # aligned, so not one byte more


def test_layout_is_aligned_for_large_and_packed_for_small(tmp_path):
    rng = np.random.default_rng(7)
    sd = {f"small{i}": random_tensor((10,), torch.float32, rng) for i in range(100)}
    sd["large"] = random_tensor((1000, 1000), torch.float32, rng)
    save(sd, tmp_path / "c", "fp_dcp")
    meta, layout, _ = __import__("fp_dcp.load.reader", fromlist=["x"]).read_checkpoint_metadata(str(tmp_path / "c"))
    exts = {idx.fqn: e for idx, es in layout.extents.items() for e in es}
    assert exts["large"].file_offset % layout.alignment == 0
    small = sorted(exts[f"small{i}"].file_offset for i in range(100))
    # packed: 100 small tensors of 40 bytes take 100 * 64 bytes, not 100 blocks
    assert small[-1] - small[0] == 99 * 64
    (name, size), = layout.files
    assert size % layout.alignment == 0
    assert os.path.getsize(tmp_path / "c" / name) == size


def test_one_writer_serves_a_series_of_saves_with_checkpoint_ids(tmp_path):
    rng = np.random.default_rng(8)
    writer = FastPersistWriter()
    reader = FastPersistReader()
    try:
        for step in range(3):
            sd = {"w": random_tensor((100, 100), torch.float32, rng), "step": step}
            dcp.save(sd, storage_writer=writer, checkpoint_id=tmp_path / f"step{step}")
            target = {"w": torch.zeros(100, 100), "step": -1}
            dcp.load(target, storage_reader=reader, checkpoint_id=tmp_path / f"step{step}")
            assert_sd_equal(sd, target)
    finally:
        writer.close()
        reader.close()


def test_saving_again_over_a_checkpoint_replaces_it_and_removes_old_files(tmp_path):
    rng = np.random.default_rng(9)
    old = {"w": random_tensor((64, 64), torch.float32, rng)}
    new = {"w": random_tensor((64, 64), torch.float32, rng)}
    save(old, tmp_path / "c", "fp_dcp")
    old_files = {n for n in os.listdir(tmp_path / "c") if n.endswith(fmt.DATA_SUFFIX)}
    save(new, tmp_path / "c", "fp_dcp")
    new_files = {n for n in os.listdir(tmp_path / "c") if n.endswith(fmt.DATA_SUFFIX)}
    assert old_files and new_files and not (old_files & new_files)
    target = {"w": torch.zeros(64, 64)}
    load(target, tmp_path / "c", "fp_dcp")
    assert bits_equal(target["w"], new["w"])
    with pytest.raises(FAILED, match="overwrite=False"):
        save(new, tmp_path / "c", "fp_dcp", overwrite=False)


def test_options_from_environment_and_override(tmp_path):
    with override(engine="threads", queue_depth=3):
        opts = FastPersistOptions.from_env()
        assert opts.engine == "threads" and opts.queue_depth == 3
    assert FastPersistOptions.from_env().engine == "auto"
    with pytest.raises(TypeError, match="valid: engine"):
        FastPersistWriter(tmp_path, no_such_option=1)
    with pytest.raises(ValueError, match="valid: auto, aio"):
        FastPersistOptions(engine="spdk")
    os.environ["FP_DCP_BOGUS"] = "1"
    try:
        with pytest.raises(ValueError, match="FP_DCP_BOGUS names no fp_dcp option"):
            FastPersistOptions.from_env()
    finally:
        del os.environ["FP_DCP_BOGUS"]
    with override(cuda_chunk_bytes="16MiB"):
        assert FastPersistOptions.from_env().cuda_chunk_bytes == 16 << 20


@pytest.mark.parametrize("name, raw, expected", [
    ("staging_spill_dir", "none", None),  # a field that may be None: "none" is None, not a directory "none"
    ("staging_spill_dir", "./none", "./none"),
    ("staging_spill_dir", "/tmp/spill", "/tmp/spill"),
    ("direct_io", "auto", None),
    ("direct_io", "off", False),
    ("queue_depth", "", None),
    ("queue_depth", "16", 16),
    ("block_size_bytes", "8MiB", 8 << 20),
    ("allow_pickle", "yes", True),
    ("engine", "auto", "auto"),  # a str field keeps "auto"
])
def test_environment_values_are_read_by_the_fields_type(monkeypatch, name, raw, expected):
    monkeypatch.setenv(f"FP_DCP_{name.upper()}", raw)
    assert getattr(FastPersistOptions.from_env(), name) == expected


def test_a_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("FP_DCP_SYNC_FILES", "maybe")
    with pytest.raises(ValueError, match="FP_DCP_SYNC_FILES='maybe': expected true/false"):
        FastPersistOptions.from_env()


def _skip_where_the_interpreter_keeps_objects_frozen():
    from fp_dcp.gc_freeze import interpreter_start_count

    if interpreter_start_count() != 0:
        pytest.skip("this interpreter keeps objects in the permanent generation: no freeze (fp_dcp.gc_freeze)")


def test_gc_is_frozen_only_during_a_save(tmp_path):
    import gc
    _skip_where_the_interpreter_keeps_objects_frozen()

    seen = []
    writer = FastPersistWriter(tmp_path / "c")
    original, prepare = writer._write, writer.prepare_local_plan
    plans = []

    def spy(*a, **k):
        seen.append(gc.get_freeze_count())
        if plans:  # what the save made after its set-up (its plans) is frozen too
            seen.append(gc.is_tracked(plans[0]) and not any(o is plans[0] for o in gc.get_objects()))
        return original(*a, **k)

    def spy_plan(plan):
        plans.append(plan)
        return prepare(plan)

    writer._write, writer.prepare_local_plan = spy, spy_plan
    dcp.save({"w": torch.ones(10)}, storage_writer=writer)
    # frozen while writing, and with it the plans made after the set-up:
    # the collections the write triggers do not walk them
    assert seen[0] > 0 and seen[1] is True
    plans.clear()
    assert gc.get_freeze_count() == 0  # thawed after the commit
    seen.clear()
    writer = FastPersistWriter(tmp_path / "d", freeze_gc_during_save=False)
    writer._write = spy
    original = FastPersistWriter._write.__get__(writer)
    dcp.save({"w": torch.ones(10)}, storage_writer=writer)
    assert seen == [0]
    # a save that fails part-way does not leave the collector frozen
    with pytest.raises(FAILED):
        dcp.save({"w": torch.ones(10)}, storage_writer=FastPersistWriter("/proc/fp_dcp_no"))
    assert gc.get_freeze_count() == 0


def test_gc_is_frozen_only_during_a_load(tmp_path, monkeypatch):
    """The reader freezes the collector from set_up_storage_reader to the end
    of read_data, decodes the metadata with it paused, and leaves it as it
    was after a load, with the option off, and after a load that failed."""
    _skip_where_the_interpreter_keeps_objects_frozen()
    import gc

    sd = {"w": torch.ones(10), "step": 3}
    save(sd, tmp_path / "c", "fp_dcp")
    seen = []
    decode = fmt.decode_metadata

    def spy_decode(*a, **k):
        seen.append(("decode", gc.get_freeze_count() > 0, gc.isenabled()))
        return decode(*a, **k)

    monkeypatch.setattr(fmt, "decode_metadata", spy_decode)
    for on in (True, False):
        seen.clear()
        reader = FastPersistReader(tmp_path / "c", freeze_gc_during_load=on)
        read = reader._read

        def spy_read(*a, read=read, **k):
            seen.append(("read", gc.get_freeze_count() > 0, gc.isenabled()))
            return read(*a, **k)

        reader._read = spy_read
        target = {"w": torch.zeros(10), "step": 0}
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert_sd_equal(sd, target)
        assert seen == [("decode", False, not on), ("read", on, True)]
        assert gc.get_freeze_count() == 0 and gc.isenabled()
    # a load that fails in read_data does not leave the collector frozen
    with pytest.raises(FAILED):
        dcp.load({"w": torch.zeros(10, dtype=torch.float64), "step": 0},
                 storage_reader=FastPersistReader(tmp_path / "c", strict_dtype=True), no_dist=True)
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    # one that DCP's planner fails between set_up_storage_reader and
    # read_data is thawed by the reader's close() (or reset(), or its collection)
    reader = FastPersistReader(tmp_path / "c")
    with pytest.raises(FAILED):
        dcp.load({"w": torch.zeros(11)}, storage_reader=reader, no_dist=True)
    reader.close()
    assert gc.get_freeze_count() == 0


def test_engines_are_set_up_before_the_read_kept_and_closed(tmp_path, monkeypatch):
    """prepare_local_plan starts the engine (and, for shared reads, the
    second one) on a thread while DCP plans; the load uses those sessions, a
    second load keeps them, close() closes both.  A set-up that fails on that
    thread is tried again, and raised, by the read itself."""
    import fp_dcp.engine as engine_mod

    sd = mixed_state_dict(3)
    path = tmp_path / "ckpt"
    save(sd, path, "fp_dcp")
    reader = FastPersistReader(path, share_replicated_reads=True)
    reader.reset(path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    reader.prepare_local_plan(LoadPlan([]))
    assert reader._engines._settling is not None
    reader._engines.settled()
    engines = reader._engines
    first, large, ((twin, twin_large),) = engines.primary, engines.large, engines.twins
    assert first is not None and twin is not None and twin.engine is not first.engine
    # the second reading thread has its own engine of large requests too: an
    # engine serves one thread at a time
    assert large is not None and twin_large is not None and twin_large.engine is not large.engine
    assert (twin_large.engine.queue_depth, twin_large.engine.block_size) == (
        large.engine.queue_depth, large.engine.block_size)
    for _ in range(2):
        target = zeros_like_sd(sd)
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert_sd_equal(sd, target)
        assert engines.primary is first and engines.twins == [(twin, twin_large)]
    reader.close()
    assert all(s.engine is None for s in (first, twin, large, twin_large)) and engines.primary is None

    calls = []

    def refused(*args, **kwargs):
        calls.append(threading.current_thread().name)
        raise OSError(errno.ENOSPC, "no engine today", str(path))

    monkeypatch.setattr(engine_mod, "IOSession", refused)
    with pytest.raises(FAILED) as failed:
        dcp.load(zeros_like_sd(sd), storage_reader=FastPersistReader(path), no_dist=True)
    err = root_error(failed.value)
    assert isinstance(err, OSError) and "no engine today" in str(err), err
    assert calls == ["fp_dcp-reader-setup", "MainThread"], calls


def test_engines_set_up_from_set_up_storage_reader_when_no_plan_can_share(tmp_path):
    """Without a process group (nothing can be shared, whatever the plan)
    the engines' set-up starts in set_up_storage_reader, so that it overlaps
    the planner's create_local_plan; prepare_local_plan then starts no
    second one.  With a sharing option it waits for prepare_local_plan,
    which knows the plan."""
    sd = mixed_state_dict(3)
    path = tmp_path / "ckpt"
    save(sd, path, "fp_dcp")
    reader = FastPersistReader(path)
    reader.reset(path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    started = reader._engines._settling
    assert started is not None and started.name == "fp_dcp-reader-setup"
    reader.prepare_local_plan(LoadPlan([]))
    assert reader._engines._settling is started
    reader._engines.settled()
    assert reader._engines.primary is not None and reader._engines.twins == []
    target = zeros_like_sd(sd)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_sd_equal(sd, target)
    reader.close()

    sharing = FastPersistReader(path, share_replicated_reads=True)
    sharing.reset(path)
    sharing.set_up_storage_reader(sharing.read_metadata(), True)
    assert sharing._engines._settling is None
    sharing.prepare_local_plan(LoadPlan([]))
    assert sharing._engines._settling is not None
    sharing.close()


def test_fragmented_items_are_what_interleaved_reads_are_for(tmp_path):
    """The local check that starts the second engine early for the default
    (auto) interleaved reads: a column band of several rows is fragmented;
    whole rows, one row, or a scalar are not."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    path = tmp_path / "ckpt"
    save({"w": torch.zeros(8, 6, 4), "s": torch.tensor(1.0)}, path, "fp_dcp")
    reader = FastPersistReader(path)
    reader.reset(path)
    reader.set_up_storage_reader(reader.read_metadata(), True)

    def item(fqn, offsets, lengths):
        return ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, offsets), torch.Size(offsets),
                        MetadataIndex(fqn, torch.Size([0] * len(offsets))), torch.Size(offsets),
                        torch.Size(lengths))

    assert reader._fragmented(item("w", [0, 0, 0], [4, 3, 4]))  # half of dim 1, rows 0..3
    assert reader._fragmented(item("w", [0, 0, 2], [1, 6, 2]))  # half of the last dim of 6 rows
    assert not reader._fragmented(item("w", [2, 0, 0], [3, 6, 4]))  # whole rows
    assert not reader._fragmented(item("w", [2, 1, 0], [1, 3, 4]))  # inside one row: one run
    assert not reader._fragmented(item("s", [], []))
    reader.close()
