"""Faults: every one gives an OSError (or a project exception) that names the
path and the cause, commits nothing, and leaks nothing — descriptors,
threads, page-locked buffers, engines, requests in flight, AIO contexts,
disk.  Processes killed at points all along a save (1 and 2 ranks) leave the
previous checkpoint loadable bit for bit, the partial one refused as never
committed, and the path ready for the next save.  Two writers on one path,
a reader during a save, and 200 saves with rotation."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import random
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fp_dcp import FastPersistReader, FastPersistWriter, _aio
from fp_dcp.reader import read_checkpoint_metadata
from fp_dcp.rotation import keep_last
from tests import _crash
from tests._crash import COMMIT, committed, leftovers, outcome, run_save, state_dict

# ------------------------------------------------------------------ helpers


def root_error(exc: BaseException) -> BaseException:
    """The exception a rank raised, out of DCP's CheckpointException."""
    if isinstance(exc, CheckpointException):
        (first, _), *_ = exc.failures.values()
        return first
    return exc


def resources() -> dict:
    """What a fault must not leak: open descriptors, Python and native
    threads, AIO rings mapped in this process, and the engine's counters."""
    gc.collect()
    with open("/proc/self/maps") as f:
        aio = sum(1 for line in f if "[aio]" in line)
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "aio_rings": aio,
        **_aio.stats(),
    }


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
    _aio._set_fault("")
    after = resources()
    for _ in range(20):  # threads of a finished pool may take a moment to exit
        if after == before:
            break
        time.sleep(0.05)
        after = resources()
    assert after == before, f"leaked: before {before}, after {after}"


def save(sd, path, **kw):
    w = FastPersistWriter(path, **kw)
    try:
        dcp.save(sd, storage_writer=w)
    finally:
        w.close()


def failed_save(sd, path, **kw) -> BaseException:
    w = FastPersistWriter(path, **kw)
    try:
        with pytest.raises((Exception, CheckpointException)) as ei:
            dcp.save(sd, storage_writer=w)
    finally:
        w.close()
    return root_error(ei.value)


def load_seed(path) -> str:
    return outcome(str(path), {f"seed{s}": s for s in range(10)})


@contextlib.contextmanager
def tmpfs(path, size: str, ro: bool = False):
    """A size-limited tmpfs at ``path`` (root only; skips elsewhere)."""
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True, capture_output=True)


# ------------------------------------------------------------------ injected faults in the engine


@pytest.mark.parametrize("after", [0, 3, 9])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_engine_fault_during_save_commits_nothing(tmp_path, no_leaks, err, after):
    path = tmp_path / "c"
    save(state_dict(1), path, block_size_bytes=256 << 10)
    _aio._set_fault("io", err, after=after)
    e = failed_save(state_dict(2), path, block_size_bytes=256 << 10)
    _aio._set_fault("")
    assert isinstance(e, OSError) and e.errno == err, e
    assert e.filename and str(path) in e.filename and e.filename.endswith(".fpd")
    assert os.strerror(err) in str(e)
    assert load_seed(path) == "seed1"  # the previous checkpoint, bit for bit
    assert leftovers(str(path)) == []  # the failed save removed its own files
    save(state_dict(3), path)
    assert load_seed(path) == "seed3" and leftovers(str(path)) == []


def test_engine_fault_during_load_names_the_file(tmp_path, no_leaks):
    path = tmp_path / "c"
    save(state_dict(1), path)
    _aio._set_fault("io", errno.EIO, after=2)
    r = FastPersistReader(path)
    try:
        with pytest.raises((Exception, CheckpointException)) as ei:
            dcp.load(_crash.zeros_like(state_dict(0)), storage_reader=r)
    finally:
        r.close()
    _aio._set_fault("")
    e = root_error(ei.value)
    assert isinstance(e, OSError) and e.errno == errno.EIO and str(path) in e.filename
    assert load_seed(path) == "seed1"


def test_permission_denied(tmp_path, no_leaks):
    """Root ignores file modes: EACCES is injected at the O_DIRECT open (as
    the probe and the engine see it); without root, a read-only directory."""
    path = tmp_path / "c"
    save(state_dict(1), path)
    if os.geteuid() == 0:
        _aio._set_fault("open_direct", errno.EACCES)
    else:
        os.chmod(path, 0o500)
    try:
        e = failed_save(state_dict(2), path)
    finally:
        _aio._set_fault("")
        os.chmod(path, 0o755)
    assert isinstance(e, PermissionError), e
    assert str(path) in str(e.filename) and "Permission denied" in str(e)
    assert load_seed(path) == "seed1"
    save(state_dict(3), path)
    assert load_seed(path) == "seed3" and leftovers(str(path)) == []


def test_path_is_a_file(tmp_path, no_leaks):
    f = tmp_path / "f"
    f.write_bytes(b"precious")
    e = failed_save(state_dict(1), f)
    assert isinstance(e, (NotADirectoryError, FileExistsError)) and e.filename == str(f)
    assert "not a directory" in str(e) or "cannot create the checkpoint directory: File exists" in str(e)
    assert f.read_bytes() == b"precious"
    e = failed_save(state_dict(1), f / "sub")
    assert isinstance(e, OSError) and e.errno == errno.ENOTDIR and str(f) in e.filename
    assert "cannot create the checkpoint directory" in str(e)
    with pytest.raises((Exception, CheckpointException)) as ei:
        dcp.load(_crash.zeros_like(state_dict(0)), storage_reader=FastPersistReader(f))
    assert str(f) in str(ei.value)


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
    """A 6 MiB tmpfs: a small checkpoint fits, a 12 MiB one does not. The
    error is ENOSPC naming the file, the small one still loads, the failed
    save gave its space back, and saving a small one again works."""
    with tmpfs(tmp_path / "m", "6m") as mnt:
        path = os.path.join(mnt, "c")
        small = {"w": torch.arange(1 << 18, dtype=torch.float32)}  # 1 MiB
        save(small, path)
        big = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB
        e = failed_save(big, path)
        assert isinstance(e, OSError) and e.errno == errno.ENOSPC, e
        assert e.filename and e.filename.startswith(path)
        assert "No space left on device" in str(e)
        assert leftovers(path) == []
        assert shutil.disk_usage(mnt).used < 3 << 20  # the partial data files are gone
        target = {"w": torch.zeros(1 << 18)}
        dcp.load(target, storage_reader=FastPersistReader(path))
        assert torch.equal(target["w"], small["w"])
        small2 = {"w": -small["w"]}
        save(small2, path)
        dcp.load(target, storage_reader=FastPersistReader(path))
        assert torch.equal(target["w"], small2["w"])


def test_metadata_does_not_fit(tmp_path, no_leaks):
    """The data fits but the metadata write hits ENOSPC: nothing is
    committed and the new save's files are removed."""
    with tmpfs(tmp_path / "m", "1m") as mnt:
        path = os.path.join(mnt, "c")
        sd = {f"t{i}": torch.zeros(1) for i in range(6000)}  # 384 KiB of data, 1 MiB of metadata
        e = failed_save(sd, path)
        assert isinstance(e, OSError) and e.errno == errno.ENOSPC, e
        assert ".fp_dcp.meta" in e.filename and "cannot write the checkpoint metadata" in str(e)
        assert [x for x in os.listdir(path) if x != ".fp_dcp.lock"] == []


def test_read_only_file_system(tmp_path, no_leaks):
    with tmpfs(tmp_path / "m", "16m") as mnt:
        path = os.path.join(mnt, "c")
        save(state_dict(1), path)
        remount(mnt, "ro")
        try:
            e = failed_save(state_dict(2), path)
            assert isinstance(e, OSError) and e.errno == errno.EROFS and e.filename.startswith(path)
            assert load_seed(path) == "seed1"  # loads from a read-only mount
        finally:
            remount(mnt, "rw")
        save(state_dict(3), path)
        assert load_seed(path) == "seed3"


# ------------------------------------------------------------------ processes killed mid-save


@pytest.fixture(scope="module")
def timeline(tmp_path_factory):
    d = tmp_path_factory.mktemp("count")
    return _crash.count_points(str(d / "c"), 1, options={"block_size_bytes": 256 << 10})


def _killed_points(timeline):
    pts = _crash.points(timeline, engine_points=4)
    return pts


def test_timeline_covers_the_commit_protocol(timeline):
    calls = timeline["calls"]
    assert calls["replace"] == 1 and calls["open"] == 3 and calls["fsync"] == 2 and calls["write"] >= 1
    assert timeline["requests"][0] >= 8


def test_kill_one_rank_at_every_step(tmp_path, timeline):
    """Killed before the commit: the old checkpoint, bit for bit; after it:
    the new one. A fresh path killed before its first commit is refused as
    never committed. Saving again always works and leaves no stray file."""
    opts = {"block_size_bytes": 256 << 10}
    pts = _killed_points(timeline) + [("delay", random.uniform(0.05, 0.6)) for _ in range(2)]
    for i, point in enumerate(pts):
        path = str(tmp_path / f"p{i}")
        save(state_dict(1), path)
        r = run_save(path, 2, point, options=opts)
        assert r["killed"] or point[0] == "delay", (point, r)  # a delay may outlast the save
        got = load_seed(path)
        after = committed(point) if r["killed"] else True
        if after is None:
            assert got in ("seed1", "seed2"), (point, got)
        else:
            assert got == ("seed2" if after else "seed1"), (point, got)
        fresh = str(tmp_path / f"f{i}")
        r = run_save(fresh, 2, point, options=opts)
        after = committed(point) if r["killed"] else True
        got = load_seed(fresh)
        assert got in (("seed2",) if after else ("absent",) if after is False else ("absent", "seed2")), (point, got)
        if got == "absent" and os.path.isdir(fresh) and any(n.endswith(".fpd") for n in os.listdir(fresh)):
            with pytest.raises(FileNotFoundError, match="interrupted before its commit"):
                read_checkpoint_metadata(fresh)
        for p in (path, fresh):
            save(state_dict(3), p)
            assert load_seed(p) == "seed3" and leftovers(p) == [], (point, os.listdir(p))


@pytest.mark.parametrize("point, kill_rank", [
    (("engine", 0), 1),
    (("engine", 3), 0),
    (("call",) + COMMIT, 0),
    (("call", "fsync", 1), 0),
    (("after", 0), 1),
])
def test_kill_two_ranks(tmp_path, point, kill_rank):
    opts = {"block_size_bytes": 256 << 10}
    path = str(tmp_path / "c")
    r = run_save(path, 1, None, world=2, options=opts)
    assert r["codes"] == [0, 0], r
    r = run_save(path, 2, point, world=2, kill_rank=kill_rank, options=opts)
    assert r["killed"], r
    after = committed(point)
    assert load_seed(path) == ("seed2" if after else "seed1"), point
    r = run_save(path, 3, None, world=2, options=opts)
    assert r["codes"] == [0, 0], r
    assert load_seed(path) == "seed3" and leftovers(path) == []


def test_kill_two_ranks_at_a_random_moment(tmp_path):
    path = str(tmp_path / "c")
    opts = {"block_size_bytes": 256 << 10}
    assert run_save(path, 1, None, world=2, options=opts)["codes"] == [0, 0]
    r = run_save(path, 2, ("delay", random.uniform(0.3, 1.5)), world=2, options=opts)
    assert load_seed(path) in ("seed1", "seed2"), r
    assert run_save(path, 3, None, world=2, options=opts)["codes"] == [0, 0]
    assert load_seed(path) == "seed3" and leftovers(path) == []


# ------------------------------------------------------------------ concurrency


def test_two_writers_on_one_path(tmp_path):
    """Two processes save into one directory at once (each pauses 0.4 s with
    the directory locked, before its commit): one wins, the other is refused
    with a clear error (or both win, one after the other); the result is
    one of the two state dicts, bit for bit, never a mixture."""
    path = str(tmp_path / "c")
    save(state_dict(1), path)
    results = [None, None]

    def go(i):
        results[i] = run_save(path, 2 + i, ("pause", "open", 1, 0.4))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = []
    for i, r in enumerate(results):
        v = r["results"].get(0)
        assert r["codes"] == [0] and v is not None, r
        if isinstance(v, dict):
            won.append(f"seed{2 + i}")
        else:
            assert "another fp_dcp save into this checkpoint directory is in progress" in v[1], v
    assert won and load_seed(path) in won
    assert leftovers(path) == []


def test_reader_during_a_save_sees_old_or_new_or_a_clear_error(tmp_path):
    path = str(tmp_path / "c")
    save(state_dict(1), path)
    seen: list[str] = []
    stop = threading.Event()

    def saves():
        try:
            for seed in (2, 3, 4):
                r = run_save(path, seed, None, options={"block_size_bytes": 128 << 10})
                assert r["codes"] == [0], r
        finally:
            stop.set()

    t = threading.Thread(target=saves)
    t.start()
    try:
        while not stop.is_set():
            try:
                seen.append(load_seed(path))
            except AssertionError as e:
                msg = str(e)
                # the files of the checkpoint it started to read were replaced by a commit
                assert "data file of the checkpoint is missing" in msg or "No such file" in msg, msg
                seen.append("error")
    finally:
        t.join()
    assert set(seen) <= {"seed1", "seed2", "seed3", "seed4", "error"}
    assert load_seed(path) == "seed4"


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
