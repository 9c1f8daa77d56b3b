"""Requests sized by what is moved and by the device: the reader
reads long runs through an engine of large requests (the device's largest
whole request, bounded) and short scattered runs through one of many small
requests; explicit engine options override the rule."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistWriter, _native, engine, tuning
from fp_dcp.engine import (
    LARGE_IN_FLIGHT_BYTES,
    LARGE_REQUEST_MAX_BYTES,
    LARGE_REQUEST_MIN_BYTES,
    SHAPE_WITHOUT_LIMIT,
    WRITE_SHAPE_UNDER_LIMIT,
    device_iops_limits,
    device_max_request_bytes,
    large_read_shape,
    read_shape,
    write_shape,
)
from tests._sd import assert_sd_equal, flip_byte, load, save, zeros_like_sd

pytestmark = pytest.mark.usefixtures("aio_no_leaks")

KiB = 1 << 10
MiB = 1 << 20


@pytest.mark.parametrize(
    "max_request, alignment, want",
    [
        (None, 4096, (4 * MiB, 8)),          # the device does not say: 4 MiB, 32 MiB in flight
        (4 * MiB, 4096, (4 * MiB, 8)),       # this VM's virtio disk (max_sectors_kb 4096)
        (1280 << 10, 4096, (1280 << 10, 25)),
        (128 << 10, 4096, (1 * MiB, 32)),    # a small limit: no smaller than 1 MiB
        (32 * MiB, 4096, (4 * MiB, 8)),      # a large one: bounded by memory
        ((1 << 20) + 512, 4096, (1 * MiB, 32)),  # rounded down to the alignment
    ],
)
def test_large_read_shape(max_request, alignment, want):
    block, qd = large_read_shape(max_request, alignment)
    assert (block, qd) == want
    assert LARGE_REQUEST_MIN_BYTES <= block <= LARGE_REQUEST_MAX_BYTES and block % alignment == 0
    assert block * qd <= LARGE_IN_FLIGHT_BYTES and qd >= 4


def test_device_max_request_bytes_reads_sysfs(tmp_path):
    got = device_max_request_bytes(str(tmp_path))
    assert got is None or (got > 0 and got % 512 == 0)
    assert device_max_request_bytes("/proc") is None  # no block device


def test_a_partition_is_sized_and_limited_by_its_whole_disk(tmp_path, monkeypatch):
    # a fake sysfs: the directory's device is partition 1 of a disk whose queue
    # takes 512 KiB requests; cgroups may name either device
    st = os.stat(tmp_path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    disk = tmp_path / "sys" / "block" / "vdz"
    (disk / "vdz1").mkdir(parents=True)
    (disk / "queue").mkdir()
    (disk / "queue" / "max_sectors_kb").write_text("512\n")
    (disk / "dev").write_text("253:16\n")
    (disk / "vdz1" / "dev").write_text(dev + "\n")
    (disk / "device").mkdir()
    (disk / "device" / "model").write_text("FAKE DISK\n")
    links = tmp_path / "sys" / "dev" / "block"
    links.mkdir(parents=True)
    (links / dev).symlink_to(disk / "vdz1")
    monkeypatch.setattr(tuning, "_SYS_DEV_BLOCK", str(links))
    assert tuning.block_device(str(tmp_path)) == (dev, str(disk))
    assert device_max_request_bytes(str(tmp_path)) == 512 * KiB
    assert engine._disk_devs(str(tmp_path)) == {dev, "253:16"}
    assert tuning.device_identity(str(tmp_path)) == {"dev": dev, "disk": "vdz", "model": "FAKE DISK"}
    # no sysfs entry: no disk, nothing said
    (links / dev).unlink()
    assert tuning.block_device(str(tmp_path)) == (dev, None)
    assert device_max_request_bytes(str(tmp_path)) is None
    assert engine._disk_devs(str(tmp_path)) == {dev}


def _fake_cgroups(monkeypatch, tree: dict[str, str]) -> None:
    """This process's /proc and cgroup files are ``tree``'s texts (absent: unreadable);
    the directory under test is partition 254:1 of disk 254:0."""
    monkeypatch.setattr(engine, "_read_text", lambda path: tree.get(path, ""))
    monkeypatch.setattr(engine, "_disk_devs", lambda directory: {"254:1", "254:0"})


_MOUNTINFO = (
    "20 1 254:1 / / rw - ext4 /dev/vda1 rw\n"
    "30 20 0:26 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio\n"
    "31 20 0:27 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    # a container's view: the hierarchy's /kube/pod7 mounted at a path with a space
    "32 20 0:28 /kube/pod7 /sys/fs/cgroup/uni\\040fied rw - cgroup2 cgroup2 rw\n"
)


def test_iops_limits_come_from_this_process_s_cgroups_and_their_ancestors(monkeypatch):
    _fake_cgroups(monkeypatch, {
        "/proc/self/cgroup": "4:memory:/jobs/a\n7:blkio:/jobs/a\n0::/kube/pod7/c\n",
        "/proc/self/mountinfo": _MOUNTINFO,
        # v1: the group's own read limit, its parent's write limit; another disk's lower one is not ours
        "/sys/fs/cgroup/blkio/jobs/a/blkio.throttle.read_iops_device": "254:0 3000\n8:0 10\n",
        "/sys/fs/cgroup/blkio/jobs/blkio.throttle.write_iops_device": "254:0 2000\n",
        "/sys/fs/cgroup/blkio/blkio.throttle.write_iops_device": "8:0 5\n",
        # v2, in the mounted part of the hierarchy: a lower read limit, no write limit
        "/sys/fs/cgroup/uni fied/c/io.max": "254:0 rbps=max wbps=1000000 riops=700 wiops=max\n",
        "/sys/fs/cgroup/uni fied/io.max": "8:0 riops=1 wiops=1\n",
    })
    assert engine._cgroup_dirs() == [
        ("v1", "/sys/fs/cgroup/blkio/jobs/a"), ("v1", "/sys/fs/cgroup/blkio/jobs"), ("v1", "/sys/fs/cgroup/blkio"),
        ("v2", "/sys/fs/cgroup/uni fied/c"), ("v2", "/sys/fs/cgroup/uni fied")]
    assert device_iops_limits("/x") == {"read": 700, "write": 2000}
    assert write_shape("/x", 4096) == WRITE_SHAPE_UNDER_LIMIT == (4 * MiB, 8)
    monkeypatch.setattr(engine, "device_max_request_bytes", lambda directory: 2 * MiB)
    assert read_shape("/x", 4096) == large_read_shape(2 * MiB, 4096) == (2 * MiB, 16)
    # a group whose name only begins like the mounted part's is not inside it
    tree = {"/proc/self/cgroup": "0::/kube/pod70/c\n", "/proc/self/mountinfo": _MOUNTINFO}
    monkeypatch.setattr(engine, "_read_text", lambda path: tree.get(path, ""))
    assert engine._cgroup_dirs() == [("v2", "/sys/fs/cgroup/uni fied")]


@pytest.mark.parametrize("tree", [
    {},  # no /proc: nothing says
    {"/proc/self/cgroup": "7:blkio:/jobs/a\n", "/proc/self/mountinfo": _MOUNTINFO},  # groups without limits
    {"/proc/self/cgroup": "7:blkio:/\n", "/proc/self/mountinfo": _MOUNTINFO,  # another disk's limit; a limit of 0
     "/sys/fs/cgroup/blkio/blkio.throttle.read_iops_device": "8:0 100\n",
     "/sys/fs/cgroup/blkio/blkio.throttle.write_iops_device": "254:0 0\nnot a line\n"},
])
def test_no_operation_limit_takes_the_fast_disk_shape(monkeypatch, tree):
    _fake_cgroups(monkeypatch, tree)
    assert "write" not in device_iops_limits("/x")
    assert write_shape("/x", 4096) == SHAPE_WITHOUT_LIMIT == (1 * MiB, 32)
    assert write_shape("/x", 1 * MiB) == (1 * MiB, 32)
    assert write_shape("/x", 3 * 4096) == (1 * MiB - 4096, 32)  # a multiple of the alignment
    assert write_shape("/x", 2 * MiB) == (2 * MiB, 32)  # no smaller than the alignment
    assert device_iops_limits("/x") == {} and read_shape("/x", 4096) == SHAPE_WITHOUT_LIMIT


def test_proc_files_are_read_whole():
    """/proc returns its text in pieces; a mountinfo of many mounts is read to its end."""
    with open("/proc/self/mountinfo") as f:
        want = f.read()
    assert engine._read_text("/proc/self/mountinfo") == want
    assert engine._read_text("/nonexistent/cgroup") == ""


def test_a_session_s_writes_follow_the_real_cgroup_limit(tmp_path):
    """Where cgroup v1 blkio throttling can be set (root), a process moved into
    a group that limits its disk's writes gets the large shape, and the same
    directory outside it the fast-disk shape."""
    root = "/sys/fs/cgroup/blkio"
    if os.geteuid() != 0 or not os.path.exists(f"{root}/blkio.throttle.write_iops_device"):
        pytest.skip("needs root and cgroup v1 blkio throttling")
    disks = [d for d in engine._disk_devs(str(tmp_path)) if os.path.exists(f"/sys/dev/block/{d}/queue")]
    if not disks:
        pytest.skip(f"{tmp_path} is on no block device")
    code = f"""
import os
from fp_dcp import FastPersistOptions
from fp_dcp.engine import IOSession
def shape():
    s = IOSession(FastPersistOptions(), {str(tmp_path)!r})
    try:
        return (s.engine.block_size, s.engine.queue_depth)
    finally:
        s.close()
group = {root!r} + "/fp_dcp_test_" + str(os.getpid())
os.mkdir(group)
try:
    outside = shape()
    with open(group + "/blkio.throttle.write_iops_device", "w") as f:
        f.write({disks[0]!r} + " 100000")
    with open(group + "/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    try:
        inside = shape()
    finally:
        with open({root!r} + "/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
finally:
    os.rmdir(group)
print(outside, inside)
"""
    env = dict(os.environ, FP_DCP_TUNING_FILE="none")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{SHAPE_WITHOUT_LIMIT} {WRITE_SHAPE_UNDER_LIMIT}"


def _ckpt(tmp_path):
    rng = np.random.default_rng(1)
    sd = {
        "big": torch.from_numpy(rng.standard_normal((2048, 1024), dtype=np.float32)),  # 8 MiB
        "small": torch.from_numpy(rng.standard_normal(1000, dtype=np.float32)),
    }
    save(sd, tmp_path / "c")
    return sd, tmp_path / "c"


def test_long_runs_go_out_as_large_requests(tmp_path):
    sd, path = _ckpt(tmp_path)
    target = zeros_like_sd(sd)
    s = load(target, path).last_stats
    assert_sd_equal(sd, target)
    big = sd["big"].numel() * 4
    # the 8 MiB tensor (and the small one where it is packed right behind it)
    assert big <= s["large_request_bytes"] <= s["bytes"]
    block, _ = read_shape(str(path), 4096)
    assert block >= 1 * MiB
    assert s["requests"] <= -(-big // block) + 4  # large requests, not 32 of 256 KiB
    assert s["checksum_bytes"] == s["bytes"]      # both engines' reads verified, each byte once


def test_direct_bytes_counts_reads_in_place(tmp_path):
    """Bytes read straight into the target (aligned memory at an aligned
    file offset) are counted, bytes through the bounce buffers are not."""
    sd, path = _ckpt(tmp_path)
    big = sd["big"].numel() * 4
    page = _native.AlignedBuffer(big, 4096)
    aligned = {"big": torch.frombuffer(page, dtype=torch.float32).view(2048, 1024),
               "small": torch.zeros_like(sd["small"])}
    s = load(aligned, path).last_stats
    assert_sd_equal(sd, aligned)
    assert s["direct_bytes"] == big
    off_page = zeros_like_sd(sd)
    if off_page["big"].data_ptr() % 4096 == 0:
        pytest.skip("this allocator put the target on a page boundary")
    s = load(off_page, path).last_stats
    assert_sd_equal(sd, off_page)
    # in place too where the file system takes O_DIRECT memory at that address
    mem = _native.probe_alignment(str(tmp_path))[0]
    assert s["direct_bytes"] == (big if off_page["big"].data_ptr() % mem == 0 else 0)
    del aligned
    page.close()


def test_tensors_below_a_page_go_in_place_where_the_file_system_takes_them(tmp_path):
    """A large tensor whose memory is aligned to what the file system asks of
    O_DIRECT memory (statx), but not to a page, is saved straight from its
    memory and loaded straight into it (a torch tensor sits 64 bytes past a
    page; NVMe takes 4-byte aligned memory), bit-exact."""
    mem = _native.probe_alignment(str(tmp_path))[0]
    if mem >= 4096:
        pytest.skip(f"this file system asks O_DIRECT memory to be aligned to {mem}")
    big = 8 << 20
    rng = np.random.default_rng(5)
    src_page, dst_page = _native.AlignedBuffer(big + 4096, 4096), _native.AlignedBuffer(big + 4096, 4096)

    def at(page):
        return torch.frombuffer(page, dtype=torch.uint8)[mem:mem + big].view(torch.float32).view(2048, 1024)

    sd = {"big": at(src_page), "small": torch.from_numpy(rng.standard_normal(1000, dtype=np.float32))}
    sd["big"].copy_(torch.from_numpy(rng.standard_normal((2048, 1024), dtype=np.float32)))
    assert sd["big"].data_ptr() % 4096 == mem
    w = FastPersistWriter(tmp_path / "c")
    try:
        dcp.save(sd, storage_writer=w)
        assert w.last_stats["zero_copy_bytes"] == big
    finally:
        w.close()
    target = {"big": at(dst_page), "small": torch.zeros(1000)}
    s = load(target, tmp_path / "c").last_stats
    assert_sd_equal(sd, target)
    assert s["direct_bytes"] == big
    del sd, target
    src_page.close()
    dst_page.close()


def test_explicit_engine_options_override_the_rule(tmp_path):
    sd, path = _ckpt(tmp_path)
    target = zeros_like_sd(sd)
    s = load(target, path, queue_depth=4, block_size_bytes=1 << 20).last_stats
    assert_sd_equal(sd, target)
    assert s["large_request_bytes"] == 0
    assert s["requests"] >= sd["big"].numel() * 4 // MiB


def test_a_flipped_byte_in_a_long_run_is_still_caught(tmp_path):
    from tests._sd import FAILED

    sd, path = _ckpt(tmp_path)
    from fp_dcp.load.reader import read_checkpoint_metadata
    import os

    _, layout, _ = read_checkpoint_metadata(str(path))
    e = next(exts[0] for idx, exts in layout.extents.items() if idx.fqn == "big")
    flip_byte(os.path.join(path, layout.files[e.file][0]), e.file_offset + 5 * MiB + 3, mask=1)
    with pytest.raises(FAILED, match="checksum mismatch"):
        load(zeros_like_sd(sd), path)
    assert _native.stats()["inflight"] == 0


def test_in_long_runs_groups_pieces_back_to_back():
    from fp_dcp.load.execute import LONG_RUN_BYTES, in_long_runs

    L = LONG_RUN_BYTES
    files = np.array([0, 0, 0, 0, 1, 1, 1], np.int64)
    offs = np.array([0, L // 2, L // 2 + 100, 5 * L, 0, L // 4, 3 * L], np.int64)
    lens = np.array([L // 2, 100, L // 2, L, L // 4, L // 2, 10], np.int64)
    # file 0: [0, L/2) + [L/2, L/2+100) + [L/2+100, L+100): one run of L+100 bytes; then a lone L piece
    # file 1: [0, L/4) + [L/4, 3L/4): 3L/4, short; a lone 10-byte piece
    assert in_long_runs(files, offs, lens).tolist() == [True, True, True, True, False, False, False]
    # an overlap continues the run; another file never does
    assert in_long_runs(np.array([0, 1]), np.array([0, 0]), np.array([L - 1, L - 1])).tolist() == [False, False]
    assert in_long_runs(np.array([0, 0]), np.array([0, 10]), np.array([L - 1, L - 1])).tolist() == [True, True]
    assert in_long_runs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)).tolist() == []


def test_packed_small_tensors_go_out_as_large_requests(tmp_path):
    """Hundreds of small tensors packed back to back are one long run: read
    in large requests (a device that charges per operation reads 256 KiB
    requests at a twelfth of 4 MiB ones), each tensor still checked."""
    rng = np.random.default_rng(2)
    sd = {f"s{i}": torch.from_numpy(rng.standard_normal(2048, dtype=np.float32)) for i in range(600)}  # 8 KiB each
    save(sd, tmp_path / "c")
    target = zeros_like_sd(sd)
    s = load(target, tmp_path / "c").last_stats
    assert_sd_equal(sd, target)
    assert s["large_request_bytes"] >= s["bytes"] // 2
    assert s["checksum_bytes"] == s["bytes"]
    assert s["requests"] < 600 // 4


def _many_big(tmp_path, n=6):
    rng = np.random.default_rng(3)
    sd = {f"w{i}": torch.from_numpy(rng.standard_normal((1024, 1024), dtype=np.float32)) for i in range(n)}  # 4 MiB
    save(sd, tmp_path / "c")
    return sd, tmp_path / "c"


@pytest.mark.parametrize("threads", [2, 3])
def test_long_runs_split_over_read_threads(tmp_path, monkeypatch, threads):
    """read_threads engines of large requests read shares of the long runs at
    once (each copies on its own core): bit-exact, every byte read once and
    checked once, and the split really happened."""
    import fp_dcp.load.execute as execute

    monkeypatch.setattr(execute, "_MIN_BYTES_PER_THREAD", 4 * MiB)
    sd, path = _many_big(tmp_path)
    target = zeros_like_sd(sd)
    s = load(target, path, read_threads=threads).last_stats
    assert_sd_equal(sd, target)
    assert s["long_run_threads"] == threads
    assert s["large_request_bytes"] == s["bytes"] == 24 * MiB
    assert s["checksum_bytes"] == s["bytes"] == s["checksum_verified_bytes"]
    assert s["engine_calls"] >= threads  # the load's chunks may make several batches


def test_read_threads_one_and_small_loads_stay_on_one_engine(tmp_path):
    sd, path = _many_big(tmp_path)
    s1 = load(zeros_like_sd(sd), path).last_stats  # the default: one
    assert s1["long_run_threads"] == 1
    # four asked, but 24 MiB is less than two threads' minimum: one engine
    s = load(zeros_like_sd(sd), path, read_threads=4).last_stats
    assert s["long_run_threads"] == 1
    with pytest.raises(ValueError, match="read_threads"):
        load(zeros_like_sd(sd), path, read_threads=0)


def test_a_flipped_byte_read_by_another_thread_is_caught(tmp_path, monkeypatch):
    """The last tensor's bytes go to the last thread: its checksum error is
    raised in the load, naming the tensor's file, and no engine is left busy."""
    import os

    import fp_dcp.load.execute as execute
    from fp_dcp.load.reader import read_checkpoint_metadata
    from tests._sd import FAILED

    monkeypatch.setattr(execute, "_MIN_BYTES_PER_THREAD", 4 * MiB)
    sd, path = _many_big(tmp_path)
    _, layout, _ = read_checkpoint_metadata(str(path))
    e = max((exts[0] for exts in layout.extents.values()), key=lambda x: (x.file, x.file_offset))
    name = layout.files[e.file][0]
    flip_byte(os.path.join(path, name), e.file_offset + 3 * MiB + 7, mask=0x10)
    with pytest.raises(FAILED, match="checksum mismatch") as info:
        load(zeros_like_sd(sd), path, read_threads=3)
    assert name in str(info.value)
    assert _native.stats()["inflight"] == 0
