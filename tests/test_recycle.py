"""A save that recycles a retired checkpoint (``FastPersistWriter(path,
recycle=old)``): it writes over the old data files' blocks (same inodes),
round trips bit-exact whatever the sizes, removes the rest of the old
checkpoint, and leaves alone what is not a committed fp_dcp checkpoint's own
file: links, hard-linked files, a directory being saved into, a user's files."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fp_dcp import FastPersistReader, FastPersistWriter
from fp_dcp import format as fmt
from fp_dcp.files import read_checkpoint_metadata
from fp_dcp.save.commit import SaveLock
from fp_dcp.tools.rotation import committed_checkpoints, to_recycle
from fp_dcp.tools.verify import verify_checkpoint
from tests._dist import run_ranks


def _sd(seed: int, n: int, size: int = 3000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(size + 37 * i, generator=g) for i in range(n)} | {"step": seed}


def _save(path, sd, **kw) -> FastPersistWriter:
    w = FastPersistWriter(path, **kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(sd, storage_writer=w)
    return w


def _load_equal(path, sd) -> None:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(out, storage_reader=FastPersistReader(path))
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(out[k], v), k


def _data_files(path) -> dict[str, os.stat_result]:
    return {f: os.lstat(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(fmt.DATA_SUFFIX)}


@pytest.mark.parametrize("n_new", [10, 40, 160])  # smaller, equal, larger than the retired file
def test_recycled_save_writes_over_the_old_file_and_round_trips(tmp_path, n_new):
    old, new = tmp_path / "old", tmp_path / "new"
    _save(old, _sd(1, 40))
    (inode,) = [st.st_ino for st in _data_files(old).values()]
    sd = _sd(2, n_new)
    w = _save(new, sd, recycle=old)
    assert w.last_plan["recycled_files"] == 1 and w.recycle is None  # one save's
    assert not old.exists()  # consumed: what was not reused is removed
    (name, st), = _data_files(new).items()
    assert st.st_ino == inode
    _load_equal(new, sd)
    assert verify_checkpoint(new).ok  # every byte of every extent against its checksum
    # the file is cut (or grown) to the size the metadata records
    _, layout, _ = read_checkpoint_metadata(str(new))
    assert dict(layout.files)[name] == st.st_size


def test_rotation_by_recycling_keeps_the_newest_and_each_loads(tmp_path):
    sds = {}
    for step in range(6):
        path = tmp_path / f"step{step}"
        sds[step] = _sd(step, 20 + 15 * step)
        _save(path, sds[step], recycle=to_recycle(tmp_path, keep=2))
    assert [os.path.basename(p) for p in committed_checkpoints(tmp_path)] == ["step4", "step5"]
    assert sorted(os.listdir(tmp_path)) == ["step4", "step5"]  # the recycled ones are gone
    for step in (4, 5):
        _load_equal(tmp_path / f"step{step}", sds[step])


def test_recycle_refuses_the_target_itself_or_a_directory_around_it(tmp_path):
    with pytest.raises(ValueError, match="recycle"):
        FastPersistWriter(tmp_path / "ck", recycle=tmp_path / "ck")
    with pytest.raises(ValueError, match="recycle"):
        FastPersistWriter(tmp_path / "ck", recycle=tmp_path)


def test_a_directory_that_is_not_a_committed_checkpoint_is_left_alone(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    # a user's files, one named as fp_dcp names its data files
    (mine / "notes.txt").write_bytes(b"keep me")
    (mine / "20260101T000000-0123abcd.r0.0.fpd").write_bytes(b"x" * 8192)
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    sd = _sd(3, 10)
    with pytest.warns(RuntimeWarning, match="not a committed fp_dcp checkpoint"):
        w = _save(tmp_path / "new", sd, recycle=mine)
    assert "recycled_files" not in w.last_plan
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before
    _load_equal(tmp_path / "new", sd)


def test_a_link_to_a_checkpoint_is_not_followed(tmp_path):
    real = tmp_path / "real"
    sd_old = _sd(1, 10)
    _save(real, sd_old)
    files = {n: open(real / n, "rb").read() for n in os.listdir(real)}
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    with pytest.warns(RuntimeWarning, match="recycle"):
        _save(tmp_path / "new", _sd(2, 10), recycle=tmp_path / "link")
    assert {n: open(real / n, "rb").read() for n in os.listdir(real)} == files
    _load_equal(real, sd_old)


def test_data_files_that_are_links_or_hard_linked_are_not_written_over(tmp_path):
    old = tmp_path / "old"
    _save(old, _sd(1, 10))
    (name, _), = _data_files(old).items()
    other = tmp_path / "other-copy.fpd"
    os.link(old / name, other)  # a second name of the same inode (a tier's hard-linked copy)
    content = other.read_bytes()
    with pytest.warns(RuntimeWarning, match="none of its data files"):
        _save(tmp_path / "new", _sd(2, 10), recycle=old)
    assert other.read_bytes() == content
    assert (old / fmt.METADATA_NAME).exists()  # nothing taken: still a checkpoint

    old2 = tmp_path / "old2"
    _save(old2, _sd(3, 10))
    (name2, _), = _data_files(old2).items()
    target = tmp_path / "victim.bin"
    target.write_bytes(b"v" * 65536)
    os.replace(old2 / name2, tmp_path / "moved.fpd")
    os.symlink(target, old2 / name2)  # the data file swapped for a link
    with pytest.warns(RuntimeWarning, match="none of its data files"):
        _save(tmp_path / "new2", _sd(4, 10), recycle=old2)
    assert target.read_bytes() == b"v" * 65536


def test_a_checkpoint_being_saved_into_is_not_recycled(tmp_path):
    old = tmp_path / "old"
    sd_old = _sd(1, 10)
    _save(old, sd_old)
    lock = SaveLock()
    assert lock.try_acquire(str(old))
    try:
        with pytest.warns(RuntimeWarning, match="in progress"):
            _save(tmp_path / "new", _sd(2, 10), recycle=old)
    finally:
        lock.release()
    _load_equal(old, sd_old)


def test_a_missing_directory_is_a_warning_not_a_failure(tmp_path):
    sd = _sd(5, 10)
    with pytest.warns(RuntimeWarning, match="recycle"):
        _save(tmp_path / "new", sd, recycle=tmp_path / "gone")
    _load_equal(tmp_path / "new", sd)


def _save_two_ranks(rank, world_size, old, new, recycle):
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader, FastPersistWriter

    sd = {f"r{rank}.t{i}": torch.full((5000 + 999 * i + rank,), float(rank * 100 + i)) for i in range(8)}
    w = FastPersistWriter(new, recycle=old if recycle else None)
    dcp.save(sd, storage_writer=w)
    assert w.recycle is None
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=FastPersistReader(new))
    return all(torch.equal(out[k], v) for k, v in sd.items())


@pytest.mark.slow  # (two processes)
def test_every_rank_writes_over_one_retired_file(tmp_path):
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    assert all(run_ranks(2, _save_two_ranks, "", old, False))
    inodes = {st.st_ino for st in _data_files(old).values()}
    assert len(inodes) == 2
    assert all(run_ranks(2, _save_two_ranks, old, new, True))
    assert {st.st_ino for st in _data_files(new).values()} == inodes
    assert not os.path.exists(old)


def test_a_failed_recycled_save_commits_nothing_and_the_retired_one_is_removed_at_close(tmp_path, monkeypatch):
    import fp_dcp.save.execute as execute

    old, new = tmp_path / "old", tmp_path / "new"
    _save(old, _sd(1, 10))

    def fail(*a, **k):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(execute, "_write_host_batch", fail)
    w = FastPersistWriter(new, recycle=old)
    with pytest.raises(CheckpointException, match="injected"):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(_sd(2, 10), storage_writer=w)
    assert not (new / fmt.METADATA_NAME).exists() and not _data_files(new)  # nothing committed, its files removed
    assert not (old / fmt.METADATA_NAME).exists()  # retired as the save began: never loadable half written over
    w.close()
    assert not old.exists()


def test_a_rank_takes_only_a_retired_checkpoints_data_file_whatever_the_plan_names(tmp_path):
    """The file to write over comes in the coordinator's plan: a rank checks
    it itself, so a lying peer cannot have it write over a user's file or a
    committed checkpoint's data."""
    from fp_dcp.save.recycle import open_recycled

    new = tmp_path / "new"
    new.mkdir()
    user = tmp_path / "notes.txt"
    user.write_bytes(b"mine")
    committed = tmp_path / "committed"
    _save(committed, _sd(1, 10))
    (name, _), = _data_files(committed).items()
    content = (committed / name).read_bytes()
    target = fmt.data_file_name(FastPersistWriter._new_save_id(), 0, 0)  # as a save names its file
    assert open_recycled(str(user), str(new), target, False) == -1
    assert open_recycled(str(committed / name), str(new), target, False) == -1
    assert user.read_bytes() == b"mine" and (committed / name).read_bytes() == content
    assert list(new.iterdir()) == []
    _load_equal(committed, _sd(1, 10))
