"""benchmarks/bench_save_load.py's own arithmetic and its two reference rows:
``dcp_floor`` (DCP's time through a storage that moves no bytes, and the
ceiling it puts on any storage's ratio to raw) and ``fp_dcp[again]`` (two
identical verified loads, the spread under the verify-off comparison)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests import _bench

bench = _bench.bench  # the fixture: benchmarks/bench_save_load.py as a module

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dcp_floor_runs_dcp_without_io_and_reports_its_time(bench, tmp_path):
    """The floor's children run dcp.save / dcp.load through storages that
    move no bytes: nothing is written, nothing verified, a time comes back."""
    base = {"kind": "dcp_floor", "path": str(tmp_path / "ck"), "mix": "small",
            "size_bytes": 2 << 20, "seed": 3}
    for op in ("save", "load"):
        r = bench._child({**base, "op": op})
        assert r["ok"] and r["verified"] is None and r["errors"] == []
        assert r["seconds"] > 0 and r["bytes"] > 0
    assert not (tmp_path / "ck").exists()  # the null writer wrote nothing


def test_ceiling_is_raw_time_over_raw_plus_floor(bench):
    rows: list[dict] = []
    bench._ceiling(rows, "fp_dcp", "load", raw_gbps=4.0, floor_gbps=12.0)  # 1 s of raw + 1/3 s of DCP
    assert rows[0]["ratio"] == pytest.approx(0.75) and rows[0]["baseline"] == "dcp_floor"
    bench._ceiling(rows, "fp_dcp", "load", raw_gbps=4.0, floor_gbps=None)  # no floor in this run: no row
    assert len(rows) == 1


def _runs(gbps):
    return [{"ok": True, "gbps": g, "rss_overhead_bytes": 1, "rss_base_bytes": 1, "cold": True} for g in gbps]


def test_again_row_is_the_worst_spread_of_identical_loads(bench):
    contenders = [{"name": "fp_dcp", "kind": "fp_dcp", "role": "fp_dcp"},
                  {"name": "fp_dcp[again]", "kind": "fp_dcp", "role": "fp_dcp_again", "loads_of": "fp_dcp"},
                  {"name": "raw[hugebuf]", "kind": "raw", "role": "raw"},
                  {"name": "dcp_floor", "kind": "dcp_floor", "role": "dcp_floor"}]
    res = {"runs": {
        "fp_dcp": {"save": _runs([1.0, 1.0]), "load": _runs([4.0, 3.0])},
        "fp_dcp[again]": {"save": [], "load": _runs([4.4, 2.4])},  # round 1: 0.91x, round 2: 1.25x
        "raw[hugebuf]": {"save": _runs([1.2, 1.2]), "load": _runs([5.0, 5.0])},
        "dcp_floor": {"save": _runs([8.0, 8.0]), "load": _runs([10.0, 10.0])},
    }}
    summ = bench._summaries(res, contenders)
    assert summ["fp_dcp"]["load"]["vs_again"]["min"] == pytest.approx(4.0 / 4.4)
    rows = {(r["op"], r["baseline"]): r for r in bench._ratios("large", summ, contenders)
            if r["contender"] == "fp_dcp"}
    assert rows[("load", "fp_dcp[again]")]["ratio"] == pytest.approx(2.4 / 3.0)  # the worse of 0.91 and 1/1.25
    assert rows[("load", "dcp_floor")]["ratio"] == pytest.approx(1 / (1 + 5.0 / 10.0))
    assert rows[("save", "dcp_floor")]["ratio"] == pytest.approx(1 / (1 + 1.2 / 8.0))


def test_paired_rows_compare_each_round_with_the_raw_transfers_around_it(bench, tmp_path):
    """A save and a load each against the mean of the raw transfers just
    before and after it, median over the rounds, min and max beside it; the
    raw write beside a checkpoint leaves no file behind."""
    contenders = [{"name": "fp_dcp", "kind": "fp_dcp", "role": "fp_dcp"},
                  {"name": "raw[hugebuf]", "kind": "raw", "role": "raw"}]
    save = _runs([1.8, 2.0, 1.0])
    for r, around in zip(save, ([2.0, 2.0], [2.0, 2.4], [1.0, 1.5])):  # 0.90x, 0.91x, 0.80x
        r["raw_around_gbps"] = around
    load = _runs([3.0, 3.0, 3.0])  # no raw reads around these: no load row
    res = {"runs": {"fp_dcp": {"save": save, "load": load},
                    "raw[hugebuf]": {"save": _runs([2.5] * 3), "load": _runs([4.0] * 3)}}}
    summ = bench._summaries(res, contenders)
    rows = [r for r in bench._ratios("large", summ, contenders) if r["vs"].startswith("paired raw")]
    assert [r["op"] for r in rows] == ["save"]
    assert rows[0]["ratio"] == pytest.approx(0.90)
    assert rows[0]["value"] == "0.90x (0.80-0.91)"

    ck = tmp_path / "ck"
    assert bench._raw_write_beside(ck, 8 << 20) > 0
    assert list(tmp_path.iterdir()) == []


def test_plot_leaves_the_floor_out(tmp_path):
    import json
    spec = importlib.util.spec_from_file_location("fp_dcp_bench_plot2", os.path.join(REPO, "benchmarks", "plot.py"))
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    s = {"n": 1, "median": 9.0}
    report = {"benchmark": "save_load", "hardware": {}, "argv": [],
              "contenders": [{"name": "fp_dcp", "role": "fp_dcp"}, {"name": "dcp_floor", "role": "dcp_floor"}],
              "mixes": [{"mix": "large", "summary": {"fp_dcp": {"save": {**s, "role": "fp_dcp"}, "load": s},
                                                      "dcp_floor": {"save": {**s, "role": "dcp_floor"}, "load": s}}}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    names = [c["name"] for c in plot.load_profiles([str(path)])[0]["contenders"]]
    assert names == ["fp_dcp"]


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not on PATH")
def test_raw_jobs_write_and_read_their_own_slices_of_one_file(bench, tmp_path):
    """``--raw-jobs 4x8``: four fio jobs, each on its own quarter of the file,
    together move the byte count asked for (not four times the first quarter)."""
    import _common as C

    f = tmp_path / "raw.bin"
    w = C.raw_device_io("write", f, 4 << 20, method="fio", block_size=256 << 10, iodepth=8, numjobs=4)
    assert w["bytes"] == 4 << 20 and "numjobs=4" in w["note"]
    assert f.stat().st_size == 4 << 20
    with open(f, "rb") as fh:  # fio's pattern in every quarter: none left a hole
        assert all(fh.read(1 << 20).count(0) < (1 << 20) for _ in range(4))
    r = C.raw_device_io("read", f, 4 << 20, method="fio", block_size=256 << 10, iodepth=8, numjobs=4)
    assert r["bytes"] == 4 << 20
    args = bench.parse_args(["--contenders", "raw", "--raw-bs", "4M", "--raw-jobs", "4x32", "--raw", "fio"])
    names = [c["name"] for c in bench.build_contenders(args, False, "fio")]
    assert "raw[fio,4M]" in names and "raw[fio,4M,4x32]" in names


def _loops() -> str:
    return subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout if shutil.which("losetup") else ""


def test_ram_profile_runs_in_its_own_file_system_in_ram_and_leaves_nothing(bench, tmp_path):
    C = bench.C
    prof = C.DeviceProfile("ram", tmp_path, fs_bytes=64 << 20)
    if not prof.available:
        pytest.skip(f"no ram profile here: {prof.why}")
    image, mount = C.ram_paths(os.getpid())
    with prof:
        assert prof.available, prof.why
        work = prof.directory
        assert work is not None and work.is_dir() and not any(work.iterdir())
        assert os.stat(work).st_dev != os.stat(tmp_path).st_dev  # not the disk under the target
        assert os.stat(image).st_blocks * 512 >= 64 << 20  # every page written before the run
        assert prof.label().startswith("ram (loop") and prof.describe()["fs_bytes"] == 64 << 20
        data = os.urandom(1 << 20)
        (work / "f").write_bytes(data)
        assert (work / "f").read_bytes() == data
        assert str(image) in _loops() and work.parent == mount
    assert not os.path.exists(mount) and not image.exists() and str(image) not in _loops()
    assert prof.directory is None


def test_ram_profile_that_fails_half_way_is_skipped_and_undone(bench, tmp_path, monkeypatch):
    C = bench.C
    prof = C.DeviceProfile("ram", tmp_path, fs_bytes=64 << 20)
    if not prof.available:
        pytest.skip(f"no ram profile here: {prof.why}")
    real = C._run_tool

    def no_mkfs(*argv):
        if argv[0] == "mkfs.ext4":
            raise OSError("mkfs.ext4: refused by the test")
        return real(*argv)

    monkeypatch.setattr(C, "_run_tool", no_mkfs)
    assert [p.name for p in C.entered([prof])] == []
    assert not prof.available and "refused by the test" in prof.why
    image, mount = C.ram_paths(os.getpid())
    assert not image.exists() and str(image) not in _loops() and not mount.exists()


def test_ram_profile_larger_than_free_memory_is_refused_before_anything_is_made(bench, tmp_path):
    prof = bench.C.DeviceProfile("ram", tmp_path, fs_bytes=1 << 50)
    assert not prof.available and prof.why
    with prof:
        assert prof.directory is None


def test_ram_profile_removes_what_a_killed_benchmark_left_and_nothing_else(bench, tmp_path):
    C = bench.C
    prof = C.DeviceProfile("ram", tmp_path, fs_bytes=64 << 20)
    if not prof.available:
        pytest.skip(f"no ram profile here: {prof.why}")
    dead = subprocess.Popen(["true"])
    dead.wait()  # a process id that is gone
    image, mount = C.ram_paths(dead.pid)
    other = C.RAM_SHM / "fp_dcp_bench_notapid.img"  # not a name the profile makes
    if image.exists() or mount.exists():
        pytest.skip("a leftover of that process id is there already")
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    other.write_bytes(b"x")
    try:
        loop = C._run_tool("losetup", "--find", "--show", str(image))
        C._run_tool("mkfs.ext4", "-q", "-F", loop)
        mount.mkdir()
        C._run_tool("mount", loop, str(mount))
        (mount / "data").write_bytes(b"left by a killed run")
        with prof:  # its set-up removes the dead run's mount, loop device and file
            assert prof.available, prof.why
            assert not os.path.ismount(mount) and not mount.exists()
            assert not image.exists() and str(image) not in _loops()
            assert other.exists()  # not the profile's: left alone
            assert C.ram_paths(os.getpid())[0].exists()  # a live process's own is kept
    finally:
        other.unlink(missing_ok=True)
        if os.path.ismount(mount):
            C._run_tool("umount", str(mount))
        if mount.is_dir():
            mount.rmdir()
        for line in _loops().splitlines():
            if str(image) in line:
                C._run_tool("losetup", "-d", line.split(":", 1)[0])
        image.unlink(missing_ok=True)


def test_fio_span_runs_from_the_first_request_sent_to_the_last_completed(bench, tmp_path):
    # per request: completion time (ms since the epoch), latency (ns), ...
    (tmp_path / "raw_lat.1.log").write_text("1000, 100000000, 1, 16777216, 0\n1500, 50000000, 1, 16777216, 0\n")
    (tmp_path / "raw_lat.2.log").write_text("2000, 200000000, 1, 16777216, 0\n")  # a job that started late
    (tmp_path / "raw_clat.1.log").write_text("5000, 1, 1, 16777216, 0\n")  # completion latencies: not read
    assert bench.C._fio_span(str(tmp_path)) == pytest.approx(1.1)  # sent at 900 ms, last done at 2000
    assert bench.C._fio_span(str(tmp_path / "none")) is None


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not on PATH")
def test_raw_jobs_are_timed_over_their_span_never_faster_than_fio_says(bench, tmp_path):
    r = bench.C.raw_device_io("write", tmp_path / "raw.bin", 8 << 20, method="fio", block_size=1 << 20,
                              iodepth=2, numjobs=4)
    assert r["bytes"] == 8 << 20 and r["span_seconds"] > 0
    assert r["seconds"] == max(r["fio_group_seconds"], r["span_seconds"])
    assert "first request to the last completion" in r["note"]
    assert not list(tmp_path.glob("*.log")) and not list(Path(tempfile.gettempdir()).glob("fp_dcp_fio_*"))


@pytest.mark.slow  # two children save and load 256 MiB each
def test_thp_row_allocates_its_tensors_on_pages_and_moves_them_in_place(bench, tmp_path):
    """``fp_dcp[thp]`` is fp_dcp with its children under THP_MEM_ALLOC_ENABLE=1:
    torch then starts every tensor of 2 MiB or more on a page, so the save
    writes them straight from their memory and the load reads them straight
    in; the plain row's tensors sit where torch's allocator puts them (64
    bytes past a page, or anywhere on the heap), and only those at an
    address the file system takes for O_DIRECT move in place."""
    from fp_dcp import _native

    args = bench.parse_args(["--contenders", "fp_dcp,fp_dcp_thp", "--no-verify-row"])
    cs = {c["name"]: c for c in bench.build_contenders(args, True, "python")}
    assert cs["fp_dcp[thp]"]["env"] == {"THP_MEM_ALLOC_ENABLE": "1"} and "env" not in cs["fp_dcp"]
    nbytes = 256 << 20  # 32-64 tensors of 4-8 MiB
    got = {}
    for name, c in cs.items():
        spec = {"kind": "fp_dcp", "path": str(tmp_path / name), "mix": "large", "size_bytes": nbytes, "seed": 3}
        saved = bench.C.run_child(bench.SCRIPT, {**spec, "op": "save"}, timeout_s=300, extra_env=c.get("env"))
        loaded = bench.C.run_child(bench.SCRIPT, {**spec, "op": "load"}, timeout_s=300, extra_env=c.get("env"))
        assert saved["ok"] and loaded["ok"] and loaded["verified"], (saved, loaded)
        got[name] = (saved["zero_copy_bytes"], loaded["direct_bytes"], saved["bytes"])
    zc, direct, payload = got["fp_dcp[thp]"]
    # a save writes in place all but what fills the window before each tensor and its last part block
    block, tensors = bench._io_shapes(tmp_path)["write"][0], len(bench.C.make_spec("large", nbytes, 3).tensors)
    assert zc >= payload - 2 * block * tensors and zc > 0.5 * payload
    assert direct > 0.95 * payload  # a load, all but each tensor's unaligned tail
    if _native.probe_alignment(str(tmp_path))[0] > 64:  # then only the tensors torch happened to align
        assert got["fp_dcp"][0] < 0.5 * payload and got["fp_dcp"][1] < 0.5 * payload


@pytest.mark.slow  # (about 25 child processes)
def test_recycle_row_saves_over_the_round_before_and_is_compared_with_a_rewrite(bench, tmp_path):
    """``fp_dcp[recycle]`` saves each round with ``recycle=`` its checkpoint of
    the round before (the first made outside the clock), its loads verified;
    ``raw[hugebuf,rewrite]`` and the paired writes go over a kept file (the
    same inode each time); nothing is left once the mix ends, and the row's
    raw reference is the rewrite row."""
    args = bench.parse_args(["--contenders", "fp_dcp_recycle,raw", "--raw", "python", "--raw-bs", "1M",
                             "--no-verify-row", "--repeat", "2", "--size", "8MiB"])
    cs = bench.build_contenders(args, True, "python")
    names = [c["name"] for c in cs]
    assert "fp_dcp[recycle]" in names and "raw[hugebuf,rewrite]" in names
    res = bench.run_mix(args, "large", cs, tmp_path, can_drop=False)
    recycled = res["runs"]["fp_dcp[recycle]"]
    assert all(r["ok"] for r in recycled["save"]) and all(r["verified"] for r in recycled["load"])
    assert all(r["ok"] for r in res["runs"]["raw[hugebuf,rewrite]"]["save"])
    assert list(tmp_path.iterdir()) == []  # the kept checkpoints and files removed at the end
    summ = bench._summaries(res, cs)
    rows = {r["vs"]: r for r in bench._ratios("large", summ, cs) if r["contender"] == "fp_dcp[recycle]"}
    assert rows["raw write over existing blocks"]["baseline"] == "raw[hugebuf,rewrite]"

    ck = tmp_path / "ck"
    bench._raw_write_beside(ck, 8 << 20, rewrite=True)
    (kept,) = tmp_path.iterdir()
    inode = kept.stat().st_ino
    bench._raw_write_beside(ck, 8 << 20, rewrite=True)
    assert kept.stat().st_ino == inode and kept.stat().st_size == 8 << 20
