"""``fp-dcp tune`` and its record (fp_dcp/tools/tune.py, fp_dcp/tuning.py):
the record round-trips and is keyed per device; sessions on that device use
it unless the options set the engine's shape; a record that does not fit is
ignored with one warning; the command measures, prints, records (or not).
Nothing here is timed."""

from __future__ import annotations

import json
import os
import socket
import warnings

import numpy as np
import pytest
import torch

from fp_dcp import FastPersistOptions, tuning
from fp_dcp.engine import IOSession, read_shape, write_shape
from fp_dcp.tools import cli, tune
from fp_dcp.tuning import Shape
from tests._sd import assert_sd_equal, load, zeros_like_sd

pytestmark = pytest.mark.usefixtures("aio_no_leaks")

MiB = 1 << 20
WRITE, READ = Shape(1 * MiB, 3), Shape(2 * MiB, 5)


@pytest.fixture
def record_file(tmp_path, monkeypatch):
    """A record file of its own (none yet), warnings not yet given."""
    path = tmp_path / "cache" / "tuning.json"
    monkeypatch.setenv("FP_DCP_TUNING_FILE", str(path))
    monkeypatch.setattr(tuning, "_warned", set())
    return path


def _data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    return str(d)


def test_record_path_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("FP_DCP_TUNING_FILE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.record_path() == str(tmp_path / "fp_dcp" / "tuning.json")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tuning.record_path() == os.path.expanduser("~/.cache/fp_dcp/tuning.json")
    monkeypatch.setenv("FP_DCP_TUNING_FILE", "none")
    assert tuning.record_path() is None and tuning.lookup(str(tmp_path)) is None
    FastPersistOptions.from_env()  # not taken for an option


def test_record_round_trips_keyed_by_device(record_file, tmp_path):
    d = _data_dir(tmp_path)
    assert tuning.lookup(d) is None  # no file yet: nothing, no warning
    path = tuning.store(d, WRITE, READ, {"grid": "x"})
    assert path == str(record_file)
    assert tuning.lookup(d) == tuning.Tuned(WRITE, READ)
    doc = json.loads(record_file.read_text())
    (key, rec), = doc["records"].items()
    st = os.stat(d)
    assert key == f"{socket.gethostname()} {os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    assert rec["device"] == tuning.device_identity(d)
    assert rec["machine"]["hostname"] == socket.gethostname() and rec["machine"]["cpu"]
    assert rec["date"] and rec["measured"] == {"grid": "x"}
    # another device has no record; a second device's record keeps the first
    assert os.stat("/proc").st_dev != st.st_dev
    assert tuning.lookup("/proc") is None
    tuning.store("/proc", READ, WRITE, {})
    assert tuning.lookup("/proc") == tuning.Tuned(READ, WRITE)
    assert tuning.lookup(d) == tuning.Tuned(WRITE, READ)
    assert len(json.loads(record_file.read_text())["records"]) == 2


def test_session_on_the_device_uses_the_record(record_file, tmp_path):
    d = _data_dir(tmp_path)
    tuning.store(d, WRITE, READ, {})
    s = IOSession(FastPersistOptions(), d)
    try:
        assert (s.engine.block_size, s.engine.queue_depth) == WRITE
        assert s.long_run_shape() == READ  # the reader's engine of large requests takes this shape
    finally:
        s.close()


def test_explicit_options_override_the_record(record_file, tmp_path):
    d = _data_dir(tmp_path)
    tuning.store(d, WRITE, READ, {})
    for opts in (FastPersistOptions(queue_depth=4), FastPersistOptions(block_size_bytes=512 << 10)):
        s = IOSession(opts, d)
        try:
            assert s.tuned is None
            assert (s.engine.block_size, s.engine.queue_depth) != WRITE
        finally:
            s.close()


def test_no_record_keeps_the_built_in_rule(record_file, tmp_path):
    d = _data_dir(tmp_path)
    s = IOSession(FastPersistOptions(), d)
    try:
        assert s.tuned is None
        assert s.long_run_shape() == read_shape(d, s.alignment)
        assert (s.engine.block_size, s.engine.queue_depth) == write_shape(d, s.alignment)
    finally:
        s.close()


def _big_sd():
    rng = np.random.default_rng(3)
    return {"big": torch.from_numpy(rng.standard_normal((2048, 1024), dtype=np.float32))}  # 8 MiB


def test_save_and_load_take_the_recorded_shapes(record_file, tmp_path):
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter

    d = _data_dir(tmp_path)
    tuning.store(d, Shape(512 << 10, 4), Shape(1 * MiB, 4), {})
    sd = _big_sd()
    w = FastPersistWriter(os.path.join(d, "c"))
    try:
        dcp.save(sd, storage_writer=w)
        assert w.last_stats["requests"] >= 16  # 8 MiB in 512 KiB requests (the built-in: 4 MiB ones)
    finally:
        w.close()
    target = zeros_like_sd(sd)
    s = load(target, os.path.join(d, "c")).last_stats
    assert_sd_equal(sd, target)
    assert s["large_request_bytes"] >= 8 * MiB
    assert s["requests"] >= 8  # 1 MiB requests (the built-in rule: 4 MiB ones)


@pytest.mark.parametrize(
    "content, says",
    [
        ("{not json", "does not read"),
        (json.dumps({"format": "something else", "records": {}}), "not an fp_dcp tuning record file"),
        (json.dumps({"format": tuning.FORMAT, "version": 99, "records": {}}), "version 99"),
        ("BAD SHAPE", "out of bounds"),
        ("MISSING", "'read' missing"),
        ("OTHER DISK", "another disk"),
    ],
)
def test_corrupt_or_foreign_records_are_ignored_with_one_warning(record_file, tmp_path, content, says):
    d = _data_dir(tmp_path)
    if content.isupper():  # a record for this device that does not fit
        tuning.store(d, WRITE, READ, {})
        doc = json.loads(record_file.read_text())
        rec = next(iter(doc["records"].values()))
        if content == "BAD SHAPE":
            rec["write"]["block_size_bytes"] = 3
        elif content == "MISSING":
            del rec["read"]
        else:
            rec["device"]["serial"] = "not-this-disk"
        content = json.dumps(doc)
    record_file.parent.mkdir(parents=True, exist_ok=True)
    record_file.write_text(content)
    with pytest.warns(tuning.TuningWarning, match=says):
        assert tuning.lookup(d) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert tuning.lookup(d) is None
        s = IOSession(FastPersistOptions(), d)  # a session still starts, on the built-in shape
        assert s.tuned is None
        s.close()


def test_a_save_and_load_survive_a_corrupt_record(record_file, tmp_path):
    from tests._sd import save

    d = _data_dir(tmp_path)
    record_file.parent.mkdir(parents=True)
    record_file.write_bytes(b"\x00\xff garbage")
    sd = _big_sd()
    with pytest.warns(tuning.TuningWarning):
        save(sd, os.path.join(d, "c"))
    target = zeros_like_sd(sd)
    load(target, os.path.join(d, "c"))
    assert_sd_equal(sd, target)
    # store replaces an unreadable file
    tuning.store(d, WRITE, READ, {})
    assert tuning.lookup(d) == tuning.Tuned(WRITE, READ)


def test_choose_keeps_the_built_in_shape_unless_beaten_every_round():
    b, x, y = Shape(4 * MiB, 8), Shape(1 * MiB, 8), Shape(16 * MiB, 4)
    assert tune.choose({b: [1.0, 1.0], x: [1.05, 1.08]}, b) == b           # within the margin
    assert tune.choose({b: [1.0, 1.0], x: [1.5, 0.9]}, b) == b             # a one-off win
    assert tune.choose({b: [1.0, 1.0], x: [1.2, 1.2], y: [1.4, 1.3]}, b) == y  # the fastest of the winners
    assert tune.choose({x: [1.0], y: [2.0]}, b) == y                       # built-in not measured


def test_cells_bound_bytes_in_flight_and_keep_the_built_in_shapes():
    got = tune.cells([1 * MiB, 16 * MiB], [4, 32], 64 * MiB, [Shape(4 * MiB, 8)])
    assert got == [Shape(1 * MiB, 4), Shape(1 * MiB, 32), Shape(4 * MiB, 8), Shape(16 * MiB, 4)]


def test_engine_pass_moves_the_file(tmp_path):
    path = str(tmp_path / "f")
    w = tune.engine_pass("write", path, 8 * MiB + 4096, 1 * MiB, 4)
    assert os.path.getsize(path) == 8 * MiB + 4096 and w["seconds"] > 0 and w["direct"]
    r = tune.engine_pass("read", path, 8 * MiB + 4096, 1 * MiB, 4)
    assert r["bytes"] == 8 * MiB + 4096 and r["kind"] == w["kind"]


def _cli(capsys, *argv):
    rc = cli.main(["tune", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_dry_run_prints_a_table_and_records_nothing(record_file, tmp_path, capsys):
    d = _data_dir(tmp_path)
    rc, out, err = _cli(capsys, d, "--quick", "--dry-run", "--file-size", "8MiB")
    assert rc == 0, err
    assert "write GB/s" in out and "read GB/s" in out and "[" in out and "*" in out
    assert "1 MiB" in out and "4 MiB" in out and "nothing recorded" in out
    assert "measuring" in err  # progress on stderr
    assert not record_file.exists()
    assert os.listdir(d) == []  # the scratch file is gone


def test_cli_records_for_the_device(record_file, tmp_path, capsys):
    d = _data_dir(tmp_path)
    rc, out, err = _cli(capsys, d, "--quick", "--file-size", "8MiB", "--json", "-q")
    assert rc == 0 and err == ""
    result = json.loads(out)
    assert result["recorded"] == str(record_file)
    builtin = tune.builtin_shapes(d)
    # the quick grid (1 and 4 MiB x 8) and the built-in shapes
    assert {(c["block_size_bytes"], c["queue_depth"]) for c in result["grid"]["write"]} == {
        (1 * MiB, 8), (4 * MiB, 8), tuple(builtin["write"])}
    chosen = result["chosen"]
    want = tuning.Tuned(Shape(chosen["write"]["block_size_bytes"], chosen["write"]["queue_depth"]),
                        Shape(chosen["read"]["block_size_bytes"], chosen["read"]["queue_depth"]))
    assert tuning.lookup(d) == want
    rec = next(iter(json.loads(record_file.read_text())["records"].values()))
    assert rec["measured"]["grid"] == result["grid"]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--sizes", "3x"], "--sizes"),
        (["--sizes", "1000"], "multiple of 4 KiB"),
        (["--depths", "0"], "--depths"),
        (["--depths", "a,b"], "--depths"),
        (["--file-size", "lots"], "--file-size"),
        (["--repeat", "0"], "--repeat"),
        (["MISSING"], "not a directory"),
        (["NONE"], "--dry-run"),
    ],
)
def test_cli_bad_arguments_give_one_line_naming_the_fix(record_file, tmp_path, capsys, monkeypatch, argv, says):
    d = _data_dir(tmp_path)
    if argv == ["MISSING"]:
        argv, d = [], str(tmp_path / "nope")
    elif argv == ["NONE"]:
        argv = []
        monkeypatch.setenv("FP_DCP_TUNING_FILE", "none")
    rc, out, err = _cli(capsys, d, "--quick", *argv)
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp-dcp tune: ") and says in lines[0], err
    assert not record_file.exists()
