"""A checkpoint from a stranger can neither run code nor touch a file outside itself.

Every attack of the safe-loading issue, as someone holding docs/FORMAT.md and
fp_dcp itself would mount it: pickled payloads through bytes items (load,
convert, stock checkpoints), metadata that names files outside the
checkpoint (load, inspect, verify, rotation), symbolic links planted in a
checkpoint, huge offsets handed to the native layer, and a fuzzer that
mutates a valid checkpoint's metadata and runs every tool against it.  In
every case: the payload never runs (a marker file is never created), the
error is a documented one, and canary files outside the checkpoint keep
their bytes and their modification time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import shutil
import signal
import traceback

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter

from fp_dcp import FastPersistReader, FastPersistWriter, _native
from fp_dcp import format as fmt
from fp_dcp.tools import rotation
from fp_dcp.checksums import ChecksumError
from fp_dcp.tools.convert import describe, dcp_to_fp_dcp, to_torch_save
from fp_dcp.load.objects import UnsafeObjectError
from fp_dcp.tools.verify import verify_checkpoint as verify
from tests._sd import (FAILED, assert_sd_equal, failed_load, load, metadata_doc_v2, root_error, save,
                       write_metadata_doc)
from tests._canary import assert_canary as _assert_canary
from tests._canary import canary as _canary

MARKER = "PWNED"


class _Evil:
    """Pickles as a call of os.system: unpickling it runs a command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@dataclasses.dataclass
class TrainerState:  # a custom type: not on torch's allow-list until added
    epoch: int
    note: str


def _marker(tmp_path) -> str:
    return str(tmp_path / MARKER)




def _doc(path) -> dict:
    return metadata_doc_v2(path)  # the per-item sections these tests edit


def _write_doc(path, doc) -> None:
    write_metadata_doc(path, doc)


# ------------------------------------------------------------ objects


def test_object_over_a_tensor_is_refused_before_any_byte_is_read(tmp_path):
    marker = _marker(tmp_path)
    save({"w": _Evil(marker), "v": torch.ones(4)}, tmp_path / "c")
    target = {"w": torch.zeros(4), "v": torch.zeros(4)}
    err = failed_load(target, tmp_path / "c")
    assert isinstance(err, fmt.CheckpointFormatError)
    assert "'w' is stored as an object" in str(err) and "holds a tensor" in str(err)
    assert not os.path.exists(marker)
    assert torch.equal(target["w"], torch.zeros(4)) and torch.equal(target["v"], torch.zeros(4))


def test_pickled_code_in_an_object_never_runs(tmp_path):
    marker = _marker(tmp_path)
    save({"step": _Evil(marker), "v": torch.ones(4)}, tmp_path / "c")
    err = failed_load({"step": 0, "v": torch.zeros(4)}, tmp_path / "c")
    assert isinstance(err, UnsafeObjectError) and isinstance(err, fmt.CheckpointFormatError)
    msg = str(err)
    assert "'step'" in msg and "posix.system" in msg
    assert "add_safe_globals" in msg and "allow_pickle=True" in msg and "FP_DCP_ALLOW_PICKLE" in msg
    assert not os.path.exists(marker)


def test_ordinary_training_state_loads_with_no_option(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    sd = {
        "model": model.state_dict(),
        "step": 3,
        "lr": 0.05,
        "name": "run-α",
        "sched": sched.state_dict(),
        "loader": {"epoch": 1, "index": [3, 1, 2], "seed": (7, "x"), "done": False, "none": None},
        "shape": torch.Size([2, 3]),
        "tensor_in_object": {"rng": torch.arange(5)},
    }
    save(sd, tmp_path / "c")
    target = {
        "model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()},
        "step": 0, "lr": 0.0, "name": "", "sched": {k: None for k in sched.state_dict()},
        "loader": {"epoch": 0, "index": None, "seed": None, "done": None, "none": 1},
        "shape": None, "tensor_in_object": {"rng": torch.zeros(5, dtype=torch.int64)},
    }
    load(target, tmp_path / "c")
    assert_sd_equal(sd, target)


def test_a_custom_type_needs_add_safe_globals_or_allow_pickle(tmp_path, monkeypatch):
    sd = {"state": TrainerState(3, "warm"), "v": torch.ones(2)}
    save(sd, tmp_path / "c")
    err = failed_load({"state": None, "v": torch.zeros(2)}, tmp_path / "c")
    assert isinstance(err, UnsafeObjectError) and "TrainerState" in str(err)
    with torch.serialization.safe_globals([TrainerState]):
        target = {"state": None, "v": torch.zeros(2)}
        load(target, tmp_path / "c")
    assert target["state"] == TrainerState(3, "warm")
    target = {"state": None, "v": torch.zeros(2)}
    load(target, tmp_path / "c", allow_pickle=True)
    assert target["state"] == TrainerState(3, "warm")
    monkeypatch.setenv("FP_DCP_ALLOW_PICKLE", "1")
    target = {"state": None, "v": torch.zeros(2)}
    load(target, tmp_path / "c")
    assert target["state"] == TrainerState(3, "warm")


def test_convert_runs_no_code(tmp_path):
    marker = _marker(tmp_path)
    save({"step": _Evil(marker), "v": torch.ones(4)}, tmp_path / "c")
    with pytest.raises(FAILED) as info:
        to_torch_save(str(tmp_path / "c"), str(tmp_path / "out.pt"), progress=False)
    assert isinstance(root_error(info.value), UnsafeObjectError)
    assert not os.path.exists(tmp_path / "out.pt")
    # a stock DCP checkpoint: its bytes items, and its pickled metadata itself
    dcp.save({"step": _Evil(marker), "v": torch.ones(4)}, storage_writer=FileSystemWriter(str(tmp_path / "s")))
    with pytest.raises(FAILED) as info:
        dcp_to_fp_dcp(str(tmp_path / "s"), str(tmp_path / "s2"), progress=False)
    assert isinstance(root_error(info.value), UnsafeObjectError)
    with open(tmp_path / "s" / ".metadata", "wb") as f:
        import pickle

        pickle.dump(_Evil(marker), f)
    with pytest.raises(FAILED) as info:
        dcp_to_fp_dcp(str(tmp_path / "s"), str(tmp_path / "s3"), progress=False)
    assert "refusing this stock DCP metadata" in str(info.value) and "posix.system" in str(info.value)
    assert not os.path.exists(marker)


def test_convert_of_a_stock_checkpoint_stays_inside_it(tmp_path):
    canary = _canary(tmp_path / "canary")
    dcp.save({"v": torch.ones(4), "step": 2}, storage_writer=FileSystemWriter(str(tmp_path / "s")))
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    import pickle

    path = tmp_path / "s" / ".metadata"
    md = pickle.load(open(path, "rb"))
    for index, info in md.storage_data.items():
        md.storage_data[index] = _StorageInfo("../canary", info.offset, info.length)
    pickle.dump(md, open(path, "wb"))
    with pytest.raises(FAILED) as info:
        dcp_to_fp_dcp(str(tmp_path / "s"), str(tmp_path / "s2"), progress=False)
    assert "'../canary' is not a file of the checkpoint" in str(info.value)
    _assert_canary(canary)


# ------------------------------------------------------------ confined files


@pytest.mark.parametrize("key", [["a", [10**30]], ["a", [-5]], ["a", [3]], ["zz", None], ["a", None]])
def test_extents_of_an_item_the_metadata_does_not_list_are_refused(tmp_path, key):
    """An extent list keyed by no tensor chunk or bytes item (a crafted
    offset, an unknown name) is refused by name, not silently ignored."""
    sd = {"a": torch.arange(10.0), "b": torch.arange(4.0)}
    save(sd, tmp_path / "c")
    doc = _doc(tmp_path / "c")
    doc["extents"].append([key, [[0, 1024, 0, 40]]])  # in the file's padding: no overlap
    _write_doc(tmp_path / "c", doc)
    with pytest.raises(BaseException, match=f"extents for '{key[0]}'.*does not list"):
        load({"a": torch.zeros(10), "b": torch.zeros(4)}, tmp_path / "c")


def _with_data_dirs(tmp_path, name="c"):
    dd = tmp_path / "dd"
    sd = {"w": torch.arange(4096, dtype=torch.float32), "step": 1}
    save(sd, tmp_path / "root" / name, data_dirs=(str(dd),))
    return sd, tmp_path / "root" / name, dd


def test_metadata_naming_a_file_outside_is_refused_everywhere(tmp_path):
    canary = _canary(tmp_path / "canary")
    sd, path, _ = _with_data_dirs(tmp_path)
    doc = _doc(path)
    for bad in (canary[0], "/" + doc["save_id"] + ".r0.d0.0.fpd", os.path.dirname(canary[0]) + "/x-0123456789ab/"
                + doc["save_id"] + ".r0.d0.0.fpd", "../" + doc["save_id"] + ".r0.0.fpd", "canary"):
        doc["files"][0][0] = bad
        _write_doc(path, doc)
        with pytest.raises(fmt.CheckpointFormatError) as info:
            FastPersistReader(path).read_metadata()
        assert repr(bad)[:40] in str(info.value)
        # through dcp.load (DCP words a failed metadata read as its own error)
        assert repr(bad)[:40] in str(failed_load({"w": torch.zeros(4096), "step": 0}, path))
        with pytest.raises(fmt.CheckpointFormatError):
            describe(str(path))
        with pytest.raises(fmt.CheckpointFormatError):
            verify(str(path))
        _assert_canary(canary)
    assert rotation.keep_last(tmp_path / "root", 1) == []  # one checkpoint: nothing to remove
    _assert_canary(canary)


def test_rotation_deletes_only_files_it_can_prove_are_the_checkpoints(tmp_path):
    """Crafted metadata of an old checkpoint names the data files of a newer
    one (in their data directory): rotation removes the old checkpoint and
    leaves the newer one loadable."""
    sd, old, dd = _with_data_dirs(tmp_path, "a_old")
    _, new, _ = _with_data_dirs(tmp_path, "b_new")
    new_doc, doc = _doc(new), _doc(old)
    doc["save_id"] = new_doc["save_id"]
    doc["files"] = new_doc["files"]
    doc["extents"] = new_doc["extents"]
    _write_doc(old, doc)
    os.utime(os.path.join(old, fmt.METADATA_NAME), ns=(1, 1))  # the oldest commit
    before = sorted(os.listdir(dd / fmt.data_subdir_name(str(new))))
    assert rotation.keep_last(tmp_path / "root", 1) == [str(old)]
    assert not os.path.exists(old)
    assert sorted(os.listdir(dd / fmt.data_subdir_name(str(new)))) == before
    target = {"w": torch.zeros(4096), "step": 0}
    load(target, new)
    assert_sd_equal(sd, target)


def test_rotation_removes_a_checkpoints_own_data_directory_files(tmp_path):
    _, old, dd = _with_data_dirs(tmp_path, "a_old")
    _with_data_dirs(tmp_path, "b_new")
    os.utime(os.path.join(old, fmt.METADATA_NAME), ns=(1, 1))
    sub = dd / fmt.data_subdir_name(str(old))
    assert os.listdir(sub)
    assert rotation.keep_last(tmp_path / "root", 1) == [str(old)]
    assert not os.path.exists(sub)


def test_a_checkpoint_with_data_dirs_loads_only_where_it_was_saved(tmp_path):
    sd, path, _ = _with_data_dirs(tmp_path)
    os.rename(path, tmp_path / "moved")
    with pytest.raises(fmt.CheckpointFormatError, match="loads only from the path it was saved at"):
        FastPersistReader(tmp_path / "moved").read_metadata()
    os.symlink(tmp_path / "moved", path)  # the saved path again, through a link: allowed
    target = {"w": torch.zeros(4096), "step": 0}
    load(target, path)
    assert_sd_equal(sd, target)


@pytest.mark.parametrize("planted", ["data", "metadata", "subdir"])
def test_symbolic_links_planted_in_a_checkpoint_are_not_followed(tmp_path, planted):
    canary = _canary(tmp_path / "canary")
    sd, path, dd = _with_data_dirs(tmp_path)
    doc = _doc(path)
    if planted == "metadata":
        os.rename(path / fmt.METADATA_NAME, tmp_path / "elsewhere.meta")
        os.symlink(tmp_path / "elsewhere.meta", path / fmt.METADATA_NAME)
    elif planted == "data":
        name = next(n for n, _ in doc["files"] if "/" in n)
        os.unlink(name)
        os.symlink(canary[0], name)
    else:
        sub = dd / fmt.data_subdir_name(str(path))
        os.rename(sub, tmp_path / "real_sub")
        os.symlink(tmp_path / "real_sub", sub)
    with pytest.raises(fmt.CheckpointFormatError, match="symbolic link"):
        FastPersistReader(path).read_metadata()
    assert "symbolic link" in str(failed_load({"w": torch.zeros(4096), "step": 0}, path))
    if planted == "metadata":
        with pytest.raises(fmt.CheckpointFormatError, match="symbolic link"):
            verify(str(path))
    else:
        report = verify(str(path))
        assert report.bad and any("symbolic link" in e for e in report.errors)
    _assert_canary(canary)


def test_a_save_refuses_a_data_directory_sub_directory_planted_as_a_link(tmp_path):
    """Its writes and its clean-up of superseded files would go wherever the link points."""
    victim = tmp_path / "victim"
    victim.mkdir()
    keep = victim / f"{_SAVE_ID}.r0.d0.0.fpd"  # looks like a superseded data file
    keep.write_bytes(b"someone else's data")
    dd = tmp_path / "dd"
    dd.mkdir()
    path = tmp_path / "c"
    os.symlink(victim, dd / fmt.data_subdir_name(str(path)))
    from tests._sd import failed_save

    err = failed_save({"v": torch.ones(3)}, path, data_dirs=(str(dd),))
    assert isinstance(err, OSError) and "symbolic link" in str(err) and fmt.data_subdir_name(str(path)) in str(err)
    assert os.listdir(victim) == [keep.name] and keep.read_bytes() == b"someone else's data"


def test_rotation_lock_planted_as_a_link_creates_nothing_outside(tmp_path):
    save({"v": torch.ones(2)}, tmp_path / "root" / "a")
    save({"v": torch.ones(2)}, tmp_path / "root" / "b")
    os.utime(tmp_path / "root" / "a" / fmt.METADATA_NAME, ns=(1, 1))
    lock = tmp_path / "root" / "a" / ".fp_dcp.lock"
    if lock.exists():
        lock.unlink()
    os.symlink(tmp_path / "created_outside", lock)
    assert rotation.keep_last(tmp_path / "root", 1) == []  # skipped, not followed
    assert not os.path.lexists(tmp_path / "created_outside")


# ------------------------------------------------------------ native layer


@pytest.mark.parametrize("offset", [(1 << 63) - 4096, 1 << 62, (1 << 62) - 100])
def test_native_layer_rejects_offsets_that_would_overflow(tmp_path, offset):
    engine = _native.Engine("threads")
    path = str(tmp_path / "f")
    fd = engine.open(path, "w")
    try:
        buf = bytearray(4096)
        with pytest.raises(ValueError, match="largest file offset"):
            engine.write([fd], [path], np.array([0]), np.array([offset], dtype=np.int64), [buf])
        with pytest.raises(ValueError, match="largest file offset"):
            engine.read([fd], [path], np.array([0]), np.array([offset], dtype=np.int64), [buf])
    finally:
        os.close(fd)
        engine.close()
    assert os.path.getsize(path) == 0
    with pytest.raises(ValueError, match="outside"):
        _native.copy_gather(bytearray(16), np.array([(1 << 63) - 2], dtype=np.int64), [b"abcd"])
    with pytest.raises(ValueError, match="do not fit"):
        _native.pull(os.getpid(), bytearray(16), 0, np.array([0, 1], dtype=np.int64), 1 << 62)
    with pytest.raises(OSError):
        _native.pull(os.getpid(), bytearray(16), (1 << 64) - 4, np.array([0], dtype=np.int64), 8)


def test_engine_does_not_follow_a_link(tmp_path):
    canary = _canary(tmp_path / "canary")
    os.symlink(canary[0], tmp_path / "link")
    engine = _native.Engine("threads")
    try:
        for mode in ("r", "w"):
            with pytest.raises(OSError) as info:
                engine.open(str(tmp_path / "link"), mode)
            assert info.value.errno == 40  # ELOOP
    finally:
        engine.close()
    _assert_canary(canary)


# ------------------------------------------------------------ fuzzing


_SAVE_ID = "20261121T032200-1a2b3c4d"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_pristine(tmp_path_factory.mktemp("fuzz"))


def make_pristine(base):
    """A valid checkpoint with a data directory (and a second checkpoint in the
    same data directory), kept unchanged under ``seed`` as the fuzzer's seed."""
    sd = {
        "w": torch.arange(70000, dtype=torch.float32).reshape(700, 100),
        "small": torch.arange(10, dtype=torch.int16),
        "step": 5,
        "cfg": {"lr": [0.1, 0.2]},
    }
    save(sd, base / "root" / "c", data_dirs=(str(base / "dd"), str(base / "root" / "c")))
    save({"other": torch.ones(3)}, base / "root" / "z", data_dirs=(str(base / "dd"),))
    shutil.copytree(base / "root" / "c", base / "seed")
    return base, sd


def _leaves(value, path=()):
    """The paths of the scalars of a JSON document (the values a forger edits)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, path + (i,))
    else:
        yield path


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def _set(doc, path, value):
    if not path:
        return value
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


_ADVERSARIAL = st.sampled_from([
    0, -1, 1, 7, 4095, 4096, 1 << 31, 1 << 40, (1 << 62) - 1, 1 << 62, (1 << 63) - 1, 1 << 63, 1 << 64, -(1 << 63),
    "", ".", "..", "/", "../x", "a/b", "/tmp", "x\x00y", "float32", "bfloat16", "bytes", "tensor", "crc32c",
    "00000000", "zz", _SAVE_ID, f"{_SAVE_ID}.r0.0.fpd", f"../{_SAVE_ID}.r0.0.fpd", f"/etc/{_SAVE_ID}.r0.d0.0.fpd",
    None, True, [], {}, [0], [[0], [1]], {"__tuple__": [1]}, {"__size__": [-1]}, {"__dict__": [[[], 1]]},
])


@pytest.mark.timeout(300)
@given(data=st.data())
@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_fuzzed_metadata_never_escapes_the_checkpoint(pristine, data):
    base, sd = pristine
    root, path, dd = base / "root", base / "root" / "c", base / "dd"
    canary = _canary(base / "canary")
    z_files = {p: open(p, "rb").read() for p in _files_under(dd / fmt.data_subdir_name(str(root / "z")))}
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(base / "seed", path)
    doc = _doc(path)
    canary_like = [canary[0], str(root / "z" / "x"), *z_files]
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        target = data.draw(st.sampled_from(list(_leaves(doc))), label="where")
        old = _get(doc, target)
        if isinstance(old, int) and not isinstance(old, bool):  # sizes, offsets, lengths, files, boxes
            value = data.draw(st.integers(-4, 4).map(lambda d: old + d) | st.integers(-(1 << 65), 1 << 65)
                              | _ADVERSARIAL, label="int")
        elif isinstance(old, str):  # names, paths, dtypes, checksums, save ids
            value = data.draw(st.sampled_from(canary_like) | _ADVERSARIAL | st.text(max_size=12)
                              | st.just(old[:-1]) | st.just(old + "0"), label="str")
        else:
            value = data.draw(_ADVERSARIAL | st.integers(), label="value")
        doc = _set(doc, target, json.loads(json.dumps(value)))  # a copy: the strategy's constants stay as they are
    _write_doc(path, doc)

    def attempt(fn):
        try:
            with _bounded(60):
                fn()
        except _Hang:
            raise
        except BaseException as e:  # noqa: BLE001
            _check_documented(e)

    def load_it():
        FastPersistReader(path).read_metadata()  # DCP would word a failure here as its own AssertionError
        load({k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}, path)

    attempt(load_it)
    attempt(lambda: describe(str(path)))
    attempt(lambda: verify(str(path)))
    os.utime(os.path.join(path, fmt.METADATA_NAME), ns=(1, 1)) if os.path.lexists(path / fmt.METADATA_NAME) else None
    attempt(lambda: rotation.keep_last(root, 1))
    _assert_canary(canary)
    assert (root / "z" / fmt.METADATA_NAME).exists()
    for p, content in z_files.items():  # another checkpoint's files in the shared data directory
        assert open(p, "rb").read() == content
    assert not os.path.exists(base / MARKER)


class _Hang(BaseException):
    """An operation on a fuzzed checkpoint ran past its bound."""


@contextlib.contextmanager
def _bounded(seconds: int):
    def expire(*_):
        raise _Hang(f"an operation on the fuzzed checkpoint ran longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _files_under(d):
    return sorted(str(d / n) for n in os.listdir(d))


def _check_documented(e: BaseException) -> None:
    """Only the documented errors escape: CheckpointFormatError (a
    ValueError), ChecksumError and other OSErrors, and DCP's own planning
    errors about a checkpoint that does not match the state dict."""
    err = root_error(e)
    if isinstance(err, (fmt.CheckpointFormatError, ChecksumError, OSError)):
        return
    frames = traceback.extract_tb(err.__traceback__)
    if isinstance(err, (ValueError, RuntimeError)) and frames and "torch/distributed/checkpoint" in frames[-1].filename:
        return  # DCP refused the plan ("Size mismatch", "Missing key"), before fp_dcp read anything
    raise AssertionError(f"undocumented error {type(err).__name__}: {err}") from err


def test_gc_freeze_of_the_application_is_never_undone(tmp_path):
    """An application that freezes objects while a save runs keeps them frozen."""
    from fp_dcp.gc_freeze import interpreter_start_count

    if interpreter_start_count() != 0:
        pytest.skip("this interpreter keeps objects in the permanent generation: no freeze (fp_dcp.gc_freeze)")
    gc.unfreeze()
    frozen = []

    class Freezing(torch.distributed.checkpoint.DefaultSavePlanner):
        def create_global_plan(self, plans):
            frozen.append(object())
            gc.freeze()  # the application's own freeze, in the middle of the save
            return super().create_global_plan(plans)

    try:
        w = FastPersistWriter(tmp_path / "c")
        dcp.save({"v": torch.ones(3)}, storage_writer=w, planner=Freezing())
        w.close()
        assert gc.get_freeze_count() > 0, "the save unfroze the application's objects"
        gc.unfreeze()
        save({"v": torch.ones(3)}, tmp_path / "d")  # nothing else frozen: the save thaws what it froze
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


# ------------------------------------------------------------ several ranks


def _save_evil_sharded(rank, world_size, path, marker):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    sd = {"m": distribute_tensor(full, mesh, [Shard(0)]), "w": _Evil(marker), "step": _Evil(marker)}
    w = FastPersistWriter(path)
    dcp.save(sd, storage_writer=w)
    w.close()


def _load_victim(rank, world_size, path, step_target):
    """Shard(1) target: the load shares interleaved reads between the ranks
    (collectives inside read_data), so a refusal must reach every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    sd = {"m": distribute_tensor(torch.zeros(64, 48), mesh, [Shard(1)])}
    sd.update({"step": 0} if step_target else {"w": torch.zeros(4)})
    try:
        dcp.load(sd, storage_reader=FastPersistReader(path))
    except FAILED as e:
        err = root_error(e)
        return type(err).__name__, str(err)
    return "loaded", ""


@pytest.mark.parametrize("step_target", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["object-over-tensor", "unsafe-object"])
def test_every_rank_refuses_and_none_hangs(tmp_path, step_target):
    from tests._dist import run_ranks

    marker = _marker(tmp_path)
    run_ranks(2, _save_evil_sharded, str(tmp_path / "c"), marker)
    results = run_ranks(2, _load_victim, str(tmp_path / "c"), step_target, timeout=120)
    for kind, msg in results:
        if step_target:
            assert kind == "UnsafeObjectError" and "'step'" in msg, (kind, msg)
        else:  # a rank refuses its own item, or learns its peer's refusal in the shared round
            assert kind in ("CheckpointFormatError", "RuntimeError") and "'w' is stored as an object" in msg, (kind, msg)
    assert not os.path.exists(marker)


def test_commit_syncs_the_directory_before_and_after_the_rename(tmp_path, monkeypatch):
    import stat

    from fp_dcp import files

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append(("fsync_dir", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def replace(a, b, **kw):
        events.append(("replace", os.path.basename(b)))
        return real_replace(a, b, **kw)

    monkeypatch.setattr(files.os, "fsync", fsync)
    monkeypatch.setattr(files.os, "replace", replace)
    save({"v": torch.ones(3)}, tmp_path / "c")
    i = events.index(("replace", fmt.METADATA_NAME))
    assert ("fsync_dir", "c") in events[:i] and events[i + 1] == ("fsync_dir", "c"), events


def test_default_storage_switch_loads_stock_checkpoints_without_running_their_code(tmp_path):
    """With fp_dcp's switch on, dcp.load(checkpoint_id=...) of a stock checkpoint
    goes through the safe stock reader: ordinary state loads bit-exact, a
    pickled payload (in an object, or a .metadata planted beside an fp_dcp
    checkpoint) runs nothing."""
    import pickle

    import fp_dcp

    marker = _marker(tmp_path)
    dcp.save({"v": torch.arange(6.0), "step": 3}, storage_writer=FileSystemWriter(str(tmp_path / "ok")))
    dcp.save({"v": torch.ones(2), "step": _Evil(marker)}, storage_writer=FileSystemWriter(str(tmp_path / "evil")))
    save({"v": torch.ones(2), "step": 1}, tmp_path / "fp")
    with open(tmp_path / "fp" / ".metadata", "wb") as f:  # planted, newer than .fp_dcp.meta
        pickle.dump(_Evil(marker), f)
    with fp_dcp.default_storage():
        target = {"v": torch.zeros(6), "step": 0}
        dcp.load(target, checkpoint_id=str(tmp_path / "ok"))
        assert torch.equal(target["v"], torch.arange(6.0)) and target["step"] == 3
        with pytest.raises(FAILED) as info:
            dcp.load({"v": torch.zeros(2), "step": 0}, checkpoint_id=str(tmp_path / "evil"))
        assert isinstance(root_error(info.value), UnsafeObjectError)
        with pytest.raises(FAILED) as info:
            dcp.load({"v": torch.zeros(2), "step": 0}, checkpoint_id=str(tmp_path / "fp"))
        assert "refusing this stock DCP metadata" in str(info.value)
    assert not os.path.exists(marker)
