"""Faults: every one gives an OSError (or a project exception) that names the
path and the cause, commits nothing, and leaks nothing — descriptors,
threads, page-locked buffers, engines, requests in flight, AIO contexts,
disk.  Processes killed at points all along a save (1 and 2 ranks) leave the
previous checkpoint loadable bit for bit, the partial one refused as never
committed, and the path ready for the next save.  Two writers on one path,
a reader during a save, and 200 saves with rotation."""

from __future__ import annotations

import errno
import faulthandler
import os
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

from fp_dcp import FastPersistReader, FastPersistWriter, _native
from fp_dcp.format import METADATA_NAME
from fp_dcp.load.reader import read_checkpoint_metadata
from fp_dcp.tools.rotation import keep_last
from tests import _crash, _scenarios
from tests._crash import COMMIT, leftovers, resources, run_save, settle, state_dict
from tests._scenarios import load_seed
from tests._sd import failed_load, root_error, save


hooks = _native.testing()  # fault injection (FP_DCP_TEST_HOOKS=1: tests/conftest.py)

# ------------------------------------------------------------------ helpers


@pytest.fixture
def no_leaks():
    """Snapshot after a warm-up save and load (torch's thread pools exist),
    then the same after the test."""
    warm = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fp_dcp_warm_{os.getpid()}")
    try:
        save(state_dict(0), warm)
        assert load_seed(warm) == "seed0"
    finally:
        shutil.rmtree(warm, ignore_errors=True)
    before = resources()
    yield
    hooks.set_fault("")
    leaked = settle(before)
    assert not leaked, f"leaked (before, after): {leaked}"


def tmpfs(path, size: str):
    """A size-limited tmpfs at ``path`` (root only; skips elsewhere)."""
    return _scenarios.tmpfs(str(path), size, pytest.skip)


# ------------------------------------------------------------------ injected faults in the engine


@pytest.mark.parametrize("after", [0, 3, 9])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_engine_fault_during_save_commits_nothing(tmp_path, no_leaks, err, after):
    path = tmp_path / "c"
    save(state_dict(1), path, block_size_bytes=256 << 10)
    _scenarios.engine_fault_save(str(path), err, after, {"block_size_bytes": 256 << 10})
    save(state_dict(3), path)
    assert load_seed(path) == "seed3" and leftovers(str(path)) == []


def test_engine_fault_during_load_names_the_file(tmp_path, no_leaks):
    path = tmp_path / "c"
    save(state_dict(1), path)
    # the second completion fails: this load is 2 large requests (its packed
    # tensors are one contiguous run, read 4 MiB at a time)
    _scenarios.engine_fault_load(str(path), after=1)


def test_the_test_hooks_are_off_without_the_flag(tmp_path):
    """A process started without FP_DCP_TEST_HOOKS=1 (every user's) cannot
    inject a fault: each hook, and _native.testing(), raises RuntimeError
    naming the flag; the engine works as ever."""
    import sys

    env = {k: v for k, v in os.environ.items() if k != "FP_DCP_TEST_HOOKS"}
    code = (
        "import numpy as np\n"
        "from fp_dcp import _aio, _native\n"
        "assert not _aio._test_hooks_enabled()\n"
        "calls = (lambda: _aio._set_fault('io', 5), lambda: _aio._set_fault(''), lambda: _aio._crc32c_impl('sw'),\n"
        "         _aio._crc_nt_bytes, _native.testing)\n"
        "for call in calls:\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as e:\n"
        "        assert 'FP_DCP_TEST_HOOKS=1' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit('a test hook ran without the flag')\n"
        "with _native.Engine('threads') as e:\n"
        f"    fd = e.open({str(tmp_path / 'f')!r}, 'w', direct=False)\n"  # a regular file: the engine opens no other
        "    e.write([fd], ['f'], [0], [0], [np.ones(1 << 20, np.uint8)], sync=False)\n"
        "print('off')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "off", (r.returncode, r.stdout, r.stderr)


def test_permission_denied(tmp_path, no_leaks):
    _scenarios.permission_denied(str(tmp_path / "c"))


def test_path_is_a_file(tmp_path, no_leaks):
    _scenarios.path_is_a_file(str(tmp_path / "f"))


def test_missing_parent_directories(tmp_path, no_leaks):
    """A save creates missing parents (as mkdir -p); a load of a path whose
    parent is missing says there is no checkpoint directory."""
    deep = tmp_path / "a" / "b" / "c"
    save(state_dict(1), deep)
    assert load_seed(deep) == "seed1"
    with pytest.raises((Exception, CheckpointException)) as ei:
        dcp.load(_crash.zeros_like(state_dict(0)), storage_reader=FastPersistReader(tmp_path / "x" / "y"))
    assert "no checkpoint directory here" in str(ei.value) and str(tmp_path / "x" / "y") in str(ei.value)


# ------------------------------------------------------------------ real file systems (root: tmpfs mounts)


def test_full_disk(tmp_path, no_leaks):
    with tmpfs(tmp_path / "m", "6m") as mnt:
        _scenarios.full_disk(mnt, 12)


def test_metadata_does_not_fit(tmp_path, no_leaks):
    with tmpfs(tmp_path / "m", "1m") as mnt:
        _scenarios.metadata_does_not_fit(mnt)


def test_read_only_file_system(tmp_path, no_leaks):
    with tmpfs(tmp_path / "m", "16m") as mnt:
        _scenarios.read_only_file_system(mnt)


# ------------------------------------------------------------------ processes killed mid-save


@pytest.fixture(scope="module")
def timeline(tmp_path_factory):
    d = tmp_path_factory.mktemp("count")
    return _crash.count_points(str(d / "c"), 1, options={"block_size_bytes": 256 << 10})


def _killed_points(timeline):
    pts = _crash.points(timeline, engine_points=3)  # all of them: benchmarks/torture.py
    return pts


def test_timeline_covers_the_commit_protocol(timeline):
    calls = timeline["calls"]
    # the directory (made, locked, committed in), the lock (by openat2 where
    # the kernel has it, not counted), the temporary metadata; its fsync, the
    # directory's before the rename and after it
    assert calls["replace"] == 1 and calls["open"] in (4, 5) and calls["fsync"] == 3 and calls["write"] >= 1
    assert calls["unlink"] >= 1  # the superseded data file
    assert timeline["requests"][0] >= 8


@pytest.mark.slow
def test_kill_one_rank_at_every_step(tmp_path, timeline):
    """Killed before the commit: the old checkpoint, bit for bit; after it:
    the new one. A fresh path killed before its first commit is refused as
    never committed. Saving again always works and leaves no stray file."""
    opts = {"block_size_bytes": 256 << 10}
    pts = _killed_points(timeline) + [("delay", random.Random(241).uniform(0.05, 0.6))]
    for i, point in enumerate(pts):
        _scenarios.kill_one_rank(str(tmp_path / f"p{i}"), point, fresh=False, options=opts)
        if point[:2] != ("call", "unlink"):  # a first save supersedes nothing: no such point
            _scenarios.kill_one_rank(str(tmp_path / f"f{i}"), point, fresh=True, options=opts)


@pytest.mark.parametrize("point, kill_rank", [
    (("engine", 0), 1),
    (("engine", 3), 0),
    (("call",) + COMMIT, 0),
    (("call", "fsync", 1), 0),
    (("after", 0), 1),
])
@pytest.mark.slow  # the fast subset keeps test_kill_two_ranks_at_a_random_moment
def test_kill_two_ranks(tmp_path, point, kill_rank):
    opts = {"block_size_bytes": 256 << 10}
    path = str(tmp_path / "c")
    r = run_save(path, 1, None, world=2, options=opts)
    assert r["codes"] == [0, 0], r
    _scenarios.kill_two_ranks(path, point, kill_rank, opts)


def test_kill_two_ranks_at_a_random_moment(tmp_path):
    path = str(tmp_path / "c")
    opts = {"block_size_bytes": 256 << 10}
    assert run_save(path, 1, None, world=2, options=opts)["codes"] == [0, 0]
    _scenarios.kill_two_ranks(path, ("delay", random.Random(294).uniform(0.3, 1.5)), 0, opts)


# ------------------------------------------------------------------ concurrency


def test_two_writers_on_one_path(tmp_path):
    """Two processes save into one directory at once (each pauses 0.4 s with
    the directory locked, before its commit): one wins, the other is refused
    with a clear error (or both win, one after the other); the result is
    one of the two state dicts, bit for bit, never a mixture."""
    _scenarios.two_writers(str(tmp_path / "c"), (0.4, 0.4))


@pytest.mark.slow
def test_reader_during_a_save_sees_old_or_new_or_a_clear_error(tmp_path):
    _scenarios.reader_during_saves(str(tmp_path / "c"))


@pytest.mark.slow
def test_200_saves_with_rotation_leak_nothing(tmp_path, no_leaks):
    root = tmp_path / "run"
    root.mkdir()
    rng = np.random.default_rng(0)
    sd = {"w": torch.from_numpy(rng.standard_normal(70000, dtype=np.float32)), "step": 0}

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGESIZE")

    writer = FastPersistWriter()
    try:
        for step in range(200):
            if step == 20:
                base_rss = rss()
            sd["step"] = step
            sd["w"][0] = step
            dcp.save(sd, storage_writer=writer, checkpoint_id=root / f"step{step:04d}")
            if step % 50 == 49:  # a fresh writer now and then, as a loop that builds one per save
                writer.close()
                writer = FastPersistWriter()
            removed = keep_last(root, 3)
            assert len(removed) == (1 if step >= 3 else 0)
    finally:
        writer.close()
    names = sorted(os.listdir(root))
    assert names == ["step0197", "step0198", "step0199"]  # nothing else on disk
    for name in names:
        assert leftovers(str(root / name)) == []
    target = {"w": torch.zeros(70000), "step": -1}
    dcp.load(target, storage_reader=FastPersistReader(root / "step0199"))
    assert target["step"] == 199 and target["w"][0] == 199
    assert rss() - base_rss < 64 << 20, (rss() - base_rss)


# ------------------------------------------------------------------ bad input


def test_target_with_missing_extra_or_misshapen_keys(tmp_path):
    """DCP's planner names the key for a missing one and for a wrong shape;
    keys the checkpoint has and the target lacks are simply not loaded (a
    partial load, as with the stock reader)."""
    path = tmp_path / "c"
    save({"a": torch.ones(4, 3), "b": torch.arange(5.0), "n": 3}, path)
    e = failed_load({"a": torch.zeros(4, 3), "b": torch.zeros(5), "zz": torch.zeros(2)}, path)
    assert "Missing key in checkpoint state_dict: zz" in str(e)
    for shape in [(3, 4), (8, 3), (12,), (4, 3, 1)]:
        e = failed_load({"a": torch.zeros(shape), "b": torch.zeros(5)}, path)
        assert "Size mismatch" in str(e) and "for a" in str(e), e
    e = failed_load({"a": 1, "b": torch.zeros(5)}, path)
    assert "for a" in str(e)
    partial = {"b": torch.zeros(5)}
    dcp.load(partial, storage_reader=FastPersistReader(path))
    assert torch.equal(partial["b"], torch.arange(5.0))


def test_truncated_or_deleted_data_file_on_load(tmp_path):
    path = tmp_path / "c"
    save(state_dict(1), path)
    _, layout, _ = read_checkpoint_metadata(str(path))
    name = os.path.join(path, layout.files[0][0])
    size = os.path.getsize(name)
    os.truncate(name, size // 2)
    e = failed_load(_crash.zeros_like(state_dict(0)), path)
    assert "data file is truncated" in str(e) and name in str(e)
    os.unlink(name)
    e = failed_load(_crash.zeros_like(state_dict(0)), path)
    # DCP turns a failed metadata read into an AssertionError carrying the reader's message
    assert "data file of the checkpoint is missing" in str(e) and name in str(e)


def test_truncated_between_metadata_read_and_data_read(tmp_path):
    """A file cut short after the reader checked its size: the engine's end of
    file error names the file (no short tensor is returned)."""
    path = tmp_path / "c"
    w = torch.arange(300000, dtype=torch.float32).reshape(300, 1000)
    save({"w": w}, path)
    _, layout, _ = read_checkpoint_metadata(str(path))
    name = os.path.join(path, layout.files[0][0])
    got = _read_item(str(path), [0, 0], [300, 1000], torch.zeros(300, 1000), [0, 0],
                     before=lambda: os.truncate(name, 8192))
    assert isinstance(got, str) and got.startswith("OSError") and "file truncated?" in got and name in got, got


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_read_items_are_exact_or_refused(fuzz_ckpt, data):
    """The reader's planner on arbitrary read items — boxes in and out of the
    stored chunk, wrong ranks, wrong targets (shape, dtype, strides), unknown
    chunks: the exact bytes, or a clean exception; never a crash, a hang, or
    a silently wrong tensor."""
    path, stored = fuzz_ckpt
    shape = list(stored.shape)
    rank = data.draw(st.sampled_from([len(shape)] * 4 + [len(shape) - 1, len(shape) + 1]))
    off = [data.draw(st.integers(-1, (shape[i] if i < len(shape) else 2) + 1)) for i in range(rank)]
    lens = [data.draw(st.integers(0, (shape[i] if i < len(shape) else 2) + 1)) for i in range(rank)]
    dtype = data.draw(st.sampled_from([stored.dtype, stored.dtype, torch.float64, torch.int32]))
    dshape = list(lens) if data.draw(st.integers(0, 5)) else [max(0, n + 1) for n in lens]
    transposed = len(dshape) == 2 and data.draw(st.booleans())
    dest = torch.full(dshape[::-1] if transposed else dshape, -7, dtype=dtype)
    if transposed:
        dest = dest.t()
    chunk = [0] * len(shape) if data.draw(st.integers(0, 9)) else [1] * len(shape)
    valid = (rank == len(shape) and all(0 <= o and o + n <= s for o, n, s in zip(off, lens, shape))
             and dshape == lens and not any(chunk))
    faulthandler.dump_traceback_later(120, exit=True)  # a hang kills the run with a traceback
    try:
        got = _read_item(path, off, lens, dest, chunk)
    finally:
        faulthandler.cancel_dump_traceback_later()
    if valid:
        assert isinstance(got, torch.Tensor), got
        want = stored[tuple(slice(o, o + n) for o, n in zip(off, lens))].to(dtype)
        assert torch.equal(got, want)
    elif isinstance(got, torch.Tensor):  # only a box of no elements may pass unchecked: nothing to get wrong
        assert got.numel() == 0 and 0 in lens, (off, lens, dshape, chunk)
    else:
        assert got.split(":")[0] in (
            "ValueError", "CheckpointFormatError", "TypeError", "RuntimeError", "IndexError"), got


@pytest.fixture(scope="module")
def fuzz_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "c"
    stored = torch.from_numpy(np.random.default_rng(1).standard_normal((37, 300)).astype(np.float32))
    save({"w": stored}, path)
    return str(path), stored


def _read_item(path, off, lens, dest, chunk, before=None):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    r = FastPersistReader(path)

    class P(DefaultLoadPlanner):
        def resolve_tensor(self, read_item):
            return dest

        def commit_tensor(self, read_item, tensor):
            pass

    try:
        md = r.read_metadata()
        r.set_up_storage_reader(md, True)
        if before is not None:
            before()
        idx = MetadataIndex("w", torch.Size(chunk))
        item = ReadItem(type=LoadItemType.TENSOR, dest_index=idx, dest_offsets=torch.Size([0] * len(off)),
                        storage_index=idx, storage_offsets=torch.Size(off), lengths=torch.Size(lens))
        r.read_data(LoadPlan([item]), P()).wait()
        return dest
    except Exception as e:  # noqa: BLE001 - the test judges it
        return f"{type(e).__name__}: {e}"
    finally:
        r.close()


@pytest.fixture(scope="module")
def layout_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("layout") / "c"
    sd = {"a": torch.arange(70000, dtype=torch.float32), "b": torch.arange(33, dtype=torch.int16),
          "c": torch.arange(300000, dtype=torch.float64)}
    save(sd, path)
    return path, sd


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzzed_layouts_load_exact_or_refuse(layout_ckpt, data):
    """A real checkpoint's metadata with one field of its layout (files,
    extents: file, offsets, lengths, checksums) replaced, re-signed with a
    valid header CRC (a buggy writer, not a damaged disk): the load gives
    the saved tensors bit for bit, or a clean error. Never silently wrong:
    the extent checksums catch bytes taken from the wrong place (and
    overlapping extents are refused: found by this test)."""

    path, sd = layout_ckpt
    meta = os.path.join(path, ".fp_dcp.meta")
    raw = open(meta, "rb").read()
    try:
        _load_fuzzed_layout(path, sd, meta, raw, data)
    finally:
        with open(meta, "wb") as f:
            f.write(raw)


def _load_fuzzed_layout(path, sd, meta, raw, data):
    import base64
    import json

    import numpy as np

    from fp_dcp import format as fmt
    from tests._sd import write_metadata_doc

    version = data.draw(st.sampled_from([2, 3]))  # per-item extents, or columns
    metadata, layout, extra = fmt.decode_metadata(raw, meta)
    doc = json.loads(fmt.encode_metadata(metadata, layout, extra, version=version)[24:])
    where = data.draw(st.sampled_from(["files", "extent"]))
    step = st.sampled_from([-4096, -64, -1, 1, 8, 64, 4096, 1 << 20])
    if where == "files":
        i = data.draw(st.integers(0, len(doc["files"]) - 1))
        j = data.draw(st.integers(0, 1))
        doc["files"][i][j] = data.draw(st.one_of(st.integers(-5, 1 << 22), st.text(max_size=8)))
    elif version == 2:
        k = data.draw(st.integers(0, len(doc["extents"]) - 1))
        e = doc["extents"][k][1][0]
        j = data.draw(st.integers(0, 4))
        if j == 4:
            e[4] = data.draw(st.one_of(st.text("0123456789abcdef", min_size=8, max_size=8), st.just(e[4][::-1])))
        else:
            e[j] = e[j] + data.draw(step)
    else:
        ext = doc["extents"]
        name = data.draw(st.sampled_from(["file", "file_offset", "item_offset", "length", "crc32c"]))
        if name == "crc32c":
            k = data.draw(st.integers(0, len(ext["crc32c"]) // 8 - 1))
            block = data.draw(st.text("0123456789abcdef", min_size=8, max_size=8))
            ext["crc32c"] = ext["crc32c"][:8 * k] + block + ext["crc32c"][8 * k + 8:]
        else:
            col = np.frombuffer(base64.b64decode(ext[name]), dtype="<i8").copy()
            col[data.draw(st.integers(0, len(col) - 1))] += data.draw(step)
            ext[name] = base64.b64encode(col.tobytes()).decode()
    write_metadata_doc(path, doc, version)
    target = {"a": torch.zeros(70000), "b": torch.zeros(33, dtype=torch.int16), "c": torch.zeros(300000, dtype=torch.float64)}
    faulthandler.dump_traceback_later(120, exit=True)
    r = FastPersistReader(path)
    try:
        dcp.load(target, storage_reader=r)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        e = root_error(exc)
        if isinstance(e, AssertionError):  # DCP's wrapper of a failed metadata read
            assert "metadata read failed" in str(e), repr(e)
        else:
            assert isinstance(e, (ValueError, OSError, TypeError, RuntimeError, KeyError)), repr(e)
        return
    finally:
        r.close()
        faulthandler.cancel_dump_traceback_later()
    for k in sd:
        assert torch.equal(target[k], sd[k]), f"{k} loaded silently wrong"


def test_keep_last_skips_saves_in_progress_and_uncommitted_directories(tmp_path):
    import fcntl

    root = tmp_path / "run"
    data = tmp_path / "nvme"
    data.mkdir()
    for i in range(4):
        save({"w": torch.full((1000,), float(i))}, root / f"s{i}", data_dirs=(str(data),))
        # distinct commit times, a second apart (not a sleep: the clock's resolution is the file system's)
        os.utime(root / f"s{i}" / METADATA_NAME, ns=(i * 10**9, i * 10**9))
    (root / "crashed").mkdir()
    (root / "crashed" / "x.fpd").write_bytes(b"partial")
    fd = os.open(root / "s0" / ".fp_dcp.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a save in progress there
    try:
        removed = keep_last(root, 2)
    finally:
        os.close(fd)
    assert [os.path.basename(p) for p in removed] == ["s1"]
    assert sorted(os.listdir(root)) == ["crashed", "s0", "s2", "s3"]
    assert len(os.listdir(data)) == 3  # s1's sub-directory of the data directory went with it
    assert [os.path.basename(p) for p in keep_last(root, 2)] == ["s0"]
    assert sorted(os.listdir(root)) == ["crashed", "s2", "s3"] and len(os.listdir(data)) == 2
    with pytest.raises(ValueError):
        keep_last(root, 0)
