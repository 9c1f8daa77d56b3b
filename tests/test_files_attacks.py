"""Attacks on every path fp_dcp touches outside the tiers, as a careless user
or someone who can write beside a checkpoint would mount them: a FIFO where
a file is expected (load, the stock reader, inspect, verify, the tuning
record, tune's probe file), a link where fp_dcp writes (convert's temporary
and directory outputs, a save's clean-up in a data directory), foreign files
in a checkpoint directory (rotation), sparse oversized metadata.  Every case
ends in bounded time (a FIFO is released after a few seconds if something
waits on it, and the test fails), and canaries outside keep their bytes and
their modification time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

from fp_dcp import format as fmt
from fp_dcp import tuning
from fp_dcp.tools import rotation
from tests._sd import assert_sd_equal, failed_load, load, save
from tests._canary import assert_canary as _assert_canary
from tests._canary import canary as _canary

_SECONDS = 20  # far beyond what any of these takes; a hang is released and fails




def _bounded(fn, fifos):
    """``fn()``'s result or exception, within ``_SECONDS``; if it still waits
    then, each FIFO is opened from this side (releasing the waiter) and the
    test fails."""
    box: list = []

    def run():
        try:
            box.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(("error", e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(_SECONDS)
    if t.is_alive():
        for f in fifos:
            fd = os.open(f, os.O_RDWR | os.O_NONBLOCK)  # a peer for the waiting open: it returns
            os.close(fd)
        t.join(_SECONDS)
        pytest.fail(f"blocked on a FIFO ({', '.join(map(str, fifos))}) for {_SECONDS} s")
    return box[0]


def _sd():
    return {"w": torch.arange(4096, dtype=torch.float32), "step": 7}


# ------------------------------------------------------------ FIFOs


def _fifo_metadata(tmp_path):
    path = tmp_path / "c"
    save(_sd(), path)
    meta = path / fmt.METADATA_NAME
    os.unlink(meta)
    os.mkfifo(meta)
    return path, meta


def test_load_of_a_fifo_metadata_is_a_named_error_at_once(tmp_path):
    path, meta = _fifo_metadata(tmp_path)
    kind, e = _bounded(lambda: failed_load(_sd(), path), [meta])
    assert kind == "ok", e  # DCP's wrapper keeps the message
    assert "not a regular file" in str(e) and str(meta) in str(e)


@pytest.mark.parametrize("tool", ["inspect", "verify"])
def test_inspect_and_verify_of_a_fifo_metadata_are_named_errors_at_once(tmp_path, tool):
    from fp_dcp.tools.convert import describe
    from fp_dcp.tools.verify import verify_checkpoint

    path, meta = _fifo_metadata(tmp_path)
    fn = {"inspect": lambda: describe(str(path)), "verify": lambda: verify_checkpoint(str(path))}[tool]
    kind, e = _bounded(fn, [meta])
    assert kind == "error" and isinstance(e, fmt.CheckpointFormatError), e
    assert "not a regular file" in str(e) and str(meta) in str(e)


def test_a_fifo_stock_metadata_is_a_named_error_at_once(tmp_path):
    from torch.distributed.checkpoint import FileSystemWriter
    import torch.distributed.checkpoint as dcp

    from fp_dcp.load.stock import SafeStockReader

    path = tmp_path / "stock"
    dcp.save(_sd(), storage_writer=FileSystemWriter(str(path)))
    meta = path / fmt.STOCK_METADATA_NAME
    os.unlink(meta)
    os.mkfifo(meta)
    kind, e = _bounded(lambda: SafeStockReader(str(path)).read_metadata(), [meta])
    assert kind == "error" and isinstance(e, OSError) and "not a regular file" in str(e), e
    assert str(meta) in str(e)


@pytest.mark.parametrize("planted", [fmt.STOCK_METADATA_NAME, fmt.METADATA_NAME])
def test_the_default_storage_switch_never_waits_on_a_fifo_metadata(tmp_path, planted):
    """With fp_dcp's switch on, dcp.load of a checkpoint whose metadata (stock
    or fp_dcp's) is a FIFO: a named error at once."""
    from torch.distributed.checkpoint import FileSystemWriter
    import torch.distributed.checkpoint as dcp

    import fp_dcp

    path = tmp_path / "c"
    if planted == fmt.STOCK_METADATA_NAME:
        dcp.save(_sd(), storage_writer=FileSystemWriter(str(path)))
    else:
        save(_sd(), path)
    meta = path / planted
    os.unlink(meta)
    os.mkfifo(meta)

    def switched_load():
        with fp_dcp.default_storage():
            dcp.load({"w": torch.zeros(4096), "step": 0}, checkpoint_id=str(path))

    kind, e = _bounded(switched_load, [meta])
    assert kind == "error" and "not a regular file" in str(e) and str(meta) in str(e), e


def test_a_fifo_tuning_record_is_ignored_and_every_save_finishes(tmp_path, monkeypatch):
    fifo = tmp_path / "tuning.json"
    os.mkfifo(fifo)
    monkeypatch.setenv(tuning.ENV, str(fifo))
    monkeypatch.setattr(tuning, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kind, e = _bounded(lambda: save(_sd(), tmp_path / "c"), [fifo])
    assert kind == "ok", e
    assert any("FIFO" in str(w.message) and str(fifo) in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    target = {"w": torch.zeros(4096), "step": 0}
    load(target, tmp_path / "c")
    assert_sd_equal(_sd(), target)


def test_a_tuning_record_planted_as_a_link_is_not_followed(tmp_path, monkeypatch):
    real = tmp_path / "elsewhere.json"
    monkeypatch.setenv(tuning.ENV, str(real))
    monkeypatch.setattr(tuning, "_warned", set())
    d = tmp_path / "data"
    d.mkdir()
    tuning.store(str(d), tuning.Shape(1 << 20, 4), tuning.Shape(1 << 20, 4), {})
    assert tuning.lookup(str(d)) is not None
    link = tmp_path / "tuning.json"
    os.symlink(real, link)
    monkeypatch.setenv(tuning.ENV, str(link))
    with pytest.warns(tuning.TuningWarning, match="symbolic link"):
        assert tuning.lookup(str(d)) is None


def test_tune_never_opens_a_fifo_planted_at_its_probe_name(tmp_path):
    from fp_dcp.tools import tune

    d = tmp_path / "disk"
    d.mkdir()
    fifo = d / f".fp_dcp-tune-{os.getpid()}.tmp"  # the name a tune of this process would use
    os.mkfifo(fifo)
    kind, out = _bounded(lambda: tune.measure(str(d), [tuning.Shape(1 << 20, 2)], 4 << 20, repeat=1), [fifo])
    assert kind == "ok", out
    assert out["write"] and out["read"]
    assert os.listdir(d) == [fifo.name]  # the scratch file removed, the FIFO left as it was


# ------------------------------------------------------------ sparse metadata


_RSS_CHILD = r"""
import os, resource, sys
from fp_dcp.files import read_metadata_bytes
from fp_dcp.tools.convert import describe
from fp_dcp.tools.verify import verify_checkpoint
from fp_dcp import FastPersistReader
path = sys.argv[1]
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
base = peak()
for name, fn in (("load", lambda: FastPersistReader(path).read_metadata()), ("inspect", lambda: describe(path)),
                 ("verify", lambda: verify_checkpoint(path))):
    try:
        fn()
        print(name, "succeeded")
    except Exception as e:
        print(name, type(e).__name__, str(e).replace("\n", " ")[:300], peak() - base)
"""


def test_sparse_oversized_metadata_is_refused_before_it_is_read(tmp_path):
    """A 1 GiB sparse metadata file (its header says a few bytes): load,
    inspect and verify refuse it from its header, each within 64 MiB."""
    path = tmp_path / "c"
    save(_sd(), path)
    meta = path / fmt.METADATA_NAME
    with open(meta, "r+b") as f:
        f.truncate(1 << 30)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(path)], capture_output=True, text=True,
                       timeout=120, env=env)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 3, (r.stdout, r.stderr[-2000:])
    for line in lines:
        name, kind, *rest = line.split(" ")
        assert kind == "CheckpointFormatError" and "trailing bytes" in line and str(meta) in line, line
        assert int(rest[-1]) < 64 << 20, f"{name} took {int(rest[-1]) >> 20} MiB"


# ------------------------------------------------------------ convert


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_convert_never_writes_through_a_link_planted_at_its_temporary(tmp_path, to):
    from fp_dcp.tools.convert import to_safetensors, to_torch_save

    canary = _canary(tmp_path / "canary")
    save(_sd(), tmp_path / "c")
    out = tmp_path / f"out.{to}"
    for name in (f"{out}.fp_dcp-tmp-{os.getpid()}", f".{out.name}.{os.getpid()}.tmp"):
        os.symlink(canary[0], tmp_path / os.path.basename(name))  # the names a converter might pick
    convert = {"torch": to_torch_save, "safetensors": to_safetensors}[to]
    convert(str(tmp_path / "c"), str(out), progress=False)
    if to == "torch":
        got = torch.load(out, weights_only=True)
        assert torch.equal(got["w"], _sd()["w"]) and got["step"] == 7
    _assert_canary(canary)  # the writer needs no safetensors package; reading the output back does
    if to == "safetensors":
        load_file = pytest.importorskip("safetensors.torch").load_file
        assert torch.equal(load_file(str(out))["w"], _sd()["w"])


def test_convert_refuses_a_directory_output_that_is_a_link(tmp_path):
    from torch.distributed.checkpoint import FileSystemWriter
    import torch.distributed.checkpoint as dcp

    from fp_dcp.tools.convert import ConvertError, dcp_to_fp_dcp

    dcp.save(_sd(), storage_writer=FileSystemWriter(str(tmp_path / "stock")))
    victim = tmp_path / "victim"
    victim.mkdir()
    os.symlink(victim, tmp_path / "out")
    with pytest.raises(ConvertError, match="symbolic link"):
        dcp_to_fp_dcp(str(tmp_path / "stock"), str(tmp_path / "out"), progress=False)
    assert os.listdir(victim) == []


# ------------------------------------------------------------ save, rotation


def test_a_saves_clean_up_never_follows_a_data_sub_directory_swapped_for_a_link(tmp_path, monkeypatch):
    """Between the save's checks and its commit, the checkpoint's sub-directory
    of a data directory becomes a link to someone else's files that look like
    superseded data files: the clean-up after the commit leaves them alone."""
    from fp_dcp import FastPersistWriter

    dd = tmp_path / "dd"
    path = tmp_path / "c"
    save(_sd(), path, data_dirs=(str(dd),))
    sub = dd / fmt.data_subdir_name(str(path))
    victim = tmp_path / "victim"
    victim.mkdir()
    theirs = victim / "0123456789abcdef.r0.d0.0.fpd"
    canary = _canary(theirs)
    real_finish = FastPersistWriter.finish

    def finish(self, metadata, results):
        os.rename(sub, tmp_path / "moved")
        os.symlink(victim, sub)
        return real_finish(self, metadata, results)

    monkeypatch.setattr(FastPersistWriter, "finish", finish)
    save(_sd(), path, data_dirs=(str(dd),))
    _assert_canary(canary)
    assert os.listdir(victim) == [theirs.name]


def test_rotation_removes_only_fp_dcps_own_files_from_a_checkpoint(tmp_path):
    root = tmp_path / "run"
    for name in ("a", "b", "c"):
        save(_sd(), root / name)
    os.utime(root / "a" / fmt.METADATA_NAME, ns=(1, 1))
    os.utime(root / "b" / fmt.METADATA_NAME, ns=(2, 2))
    notes = root / "a" / "notes.txt"
    canary = _canary(notes)
    (root / "b" / "logs").mkdir()
    log = _canary(root / "b" / "logs" / "train.log")
    removed = rotation.keep_last(root, 1)
    assert sorted(os.path.basename(p) for p in removed) == ["a", "b"]
    _assert_canary(canary)
    _assert_canary(log)
    assert os.listdir(root / "a") == ["notes.txt"] and os.listdir(root / "b") == ["logs"]
    assert rotation.committed_checkpoints(root) == [str(root / "c")]
    target = {"w": torch.zeros(4096), "step": 0}
    load(target, root / "c")
    assert_sd_equal(_sd(), target)


def test_rotation_never_follows_a_checkpoint_swapped_for_a_link(tmp_path, monkeypatch):
    """A committed checkpoint replaced by a link (to another run's checkpoint)
    between rotation's listing and its removal: nothing behind the link goes."""
    root = tmp_path / "run"
    for name in ("a", "b"):
        save(_sd(), root / name)
    save(_sd(), tmp_path / "other")
    before = sorted(os.listdir(tmp_path / "other"))
    os.utime(root / "a" / fmt.METADATA_NAME, ns=(1, 1))
    lister = "_committed" if hasattr(rotation, "_committed") else "committed_checkpoints"
    real = getattr(rotation, lister)

    def listed_then_swapped(r):
        names = real(r)
        os.rename(root / "a", tmp_path / "a-moved")
        os.symlink(tmp_path / "other", root / "a")
        return names

    monkeypatch.setattr(rotation, lister, listed_then_swapped)
    assert rotation.keep_last(root, 1) == []
    assert sorted(os.listdir(tmp_path / "other")) == before


def test_root_refuses_what_a_checkpoint_directory_may_not_be(tmp_path):
    """The layer's own refusals, named: a link as the checkpoint directory
    where fp_dcp must make a real one."""
    from fp_dcp.files import Root, UnsafePathError

    os.symlink(tmp_path, tmp_path / "ln")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        Root(tmp_path / "ln", follow=False)
    assert json.dumps(os.listdir(tmp_path)) == '["ln"]'


def test_a_failed_sync_after_the_commit_keeps_the_new_checkpoint(tmp_path, monkeypatch):
    """The commit point is the rename: a directory sync failing after it
    reports the error but removes none of the committed checkpoint's files."""
    from fp_dcp.files import Root

    real_sync = Root.sync

    def failing_sync(self, rel="."):
        if os.path.exists(os.path.join(self.path, fmt.METADATA_NAME)):
            raise OSError(5, "Input/output error")
        return real_sync(self, rel)

    monkeypatch.setattr(Root, "sync", failing_sync)
    from tests._sd import failed_save

    e = failed_save(_sd(), tmp_path / "c")
    assert isinstance(e, OSError) and "Input/output error" in str(e), e
    monkeypatch.undo()
    target = {"w": torch.zeros(4096), "step": 0}
    load(target, tmp_path / "c")
    assert_sd_equal(_sd(), target)
