"""The native layer, fp_dcp._aio: buffers, the three engines, their pipelines
and their errors. Every engine test runs once per engine this kernel allows
(the same suite for aio, io_uring and the thread pool)."""

import errno
import os
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp_dcp import _native

hooks = _native.testing()  # fault injection, CRC switches (FP_DCP_TEST_HOOKS=1: tests/conftest.py)

pytestmark = pytest.mark.usefixtures("aio_no_leaks")

A = 4096            # alignment used by the small engines
B = 4 * A           # their block size: small, so that small data spans many windows
QD = 4
KINDS = _native.available_engines()
HYP = settings(max_examples=25, deadline=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def align_up(x, a=A):
    return -(-x // a) * a


def small_engine(kind, **kw):
    kw.setdefault("queue_depth", QD)
    kw.setdefault("block_size", B)
    return _native.Engine(kind, alignment=A, **kw)


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


def random_bytes(rng, n):
    return rng.integers(0, 256, size=n, dtype=np.uint8)


def engine_requests(layout, buffers, block=B, align=A, mem_align=A, read=False, gap=0):
    """(requests, bytes moved in place) of a write (or read) of ``buffers``
    at ``layout``, by the rule docs/NATIVE.md states: the bytes go through
    bounce windows of ``block`` bytes, a write's sent once full or when the
    next bytes lie past it, a read's read when the next bytes lie outside it
    or more than ``gap`` past its end; a piece whose blocks, after the head
    that fills the open window, start at ``mem_align``-aligned memory and an
    ``align``-aligned offset moves them in place: a write its whole blocks,
    a read its aligned bytes (its last request short)."""
    requests = in_place = 0
    window = None  # (file, start, end) of the open window

    def send():
        nonlocal window, requests
        requests += window is not None
        window = None

    def through_windows(f, off, n):
        nonlocal window
        while n > 0:
            if window is not None and (off >= window[1] + block or (read and (
                    off < window[1] or off > window[2] + gap))):
                send()
            if window is None:
                window = (f, off // align * align, off // align * align)
            k = min(window[1] + block - off, n)
            window = (f, window[1], max(window[2], off + k) if read else off + k)
            off, n = off + k, n - k
            if not read and window[2] == window[1] + block:
                send()

    for (f, off), buf in zip(layout, buffers):
        view = memoryview(buf).cast("B")
        n, address = len(view), np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0
        if n == 0:
            continue
        if window is not None and window[0] != f:
            send()
        head = 0
        if window is not None and off < window[1] + block and (
                window[1] <= off <= window[2] + gap if read else window[2] <= off):
            head = window[1] + block - off
        done = 0
        if n - head >= block and (address + head) % mem_align == 0 and (off + head) % align == 0:
            through_windows(f, off, head)
            send()
            body = (n - head) // (align if read else block) * (align if read else block)
            requests += -(-body // block)
            in_place += body
            done = head + body
        through_windows(f, off + done, n - done)
    send()
    return requests, in_place


def write_files(eng, paths, layout, sources, sync=True, direct=None, **kw):
    """layout: list of (file, offset); writes and closes; returns stats."""
    fds = [eng.open(p, "w", direct=direct) for p in paths]
    try:
        return eng.write(fds, paths, [f for f, _ in layout], [o for _, o in layout], sources, **kw,
                         sync=sync)
    finally:
        for fd in fds:
            os.close(fd)


def read_files(eng, paths, layout, dests, direct=None, **kw):
    fds = [eng.open(p, "r", direct=direct) for p in paths]
    try:
        return eng.read(fds, paths, [f for f, _ in layout], [o for _, o in layout], dests, **kw)
    finally:
        for fd in fds:
            os.close(fd)


# ------------------------------------------------------------------ small functions

def test_page_size_and_alignment_probe(tmp_path):
    assert _native.page_size() == os.sysconf("SC_PAGESIZE")
    f = tmp_path / "f"
    f.write_bytes(b"x")
    for p in (str(tmp_path), str(f), "/dev/shm"):
        mem, off = _native.probe_alignment(p)
        for v in (mem, off):
            assert v >= 1 and v & (v - 1) == 0, (p, mem, off)
    with pytest.raises(FileNotFoundError) as ei:
        _native.probe_alignment(str(tmp_path / "missing"))
    assert ei.value.filename == str(tmp_path / "missing")
    assert [n for n in os.listdir(tmp_path) if n != "f"] == []  # the probe file is gone


def test_direct_io_supported(tmp_path):
    assert _native.direct_io_supported(str(tmp_path)) is True
    assert os.listdir(tmp_path) == []
    hooks.set_fault("open_direct", errno.EINVAL)  # as tmpfs before 6.6, overlayfs, FUSE
    assert _native.direct_io_supported(str(tmp_path)) is False
    hooks.set_fault("open_direct", errno.EACCES)
    with pytest.raises(PermissionError):
        _native.direct_io_supported(str(tmp_path))
    hooks.set_fault("")
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        _native.direct_io_supported(str(tmp_path / "missing"))


def test_engines_and_names():
    assert _native.ENGINES == ("aio", "uring", "threads")
    assert "threads" in KINDS
    assert set(KINDS) <= set(_native.ENGINES)
    with pytest.raises(ValueError) as ei:
        _native.Engine("libaio")
    for name in ("'auto'", "'aio'", "'uring'", "'threads'"):
        assert name in str(ei.value)
    with pytest.raises(ValueError, match="multiple of alignment"):
        _native.Engine("threads", block_size=A + 512, alignment=A)
    with pytest.raises(ValueError, match="queue_depth"):
        _native.Engine("threads", queue_depth=0)
    with _native.Engine("auto", queue_depth=2, block_size=A) as eng:
        assert eng.kind in KINDS
        assert (eng.queue_depth, eng.block_size, eng.alignment) == (2, A, 4096)


def test_engine_pool_and_close(tmp_path):
    _native.release_kept_pools()
    base = _native.stats()
    eng = _native.Engine("threads", queue_depth=3, block_size=2 * A, alignment=A)
    s = _native.stats()
    assert s["engines"] == base["engines"] + 1
    assert s["buffers"] == base["buffers"] + 1  # one pool of queue_depth + 1 bounce buffers
    assert s["locked_bytes"] == base["locked_bytes"]  # untouched until a call needs a slot
    src = _native.AlignedBuffer(4 * A)
    locked = _native.stats()["locked_bytes"]
    path = str(tmp_path / "f")
    fd = eng.open(path, "w")
    try:
        # aligned pieces of at least a block go in place: the pool stays untouched
        eng.write([fd], [path], [0], [0], [memoryview(src)[: 2 * A]])
        assert _native.stats()["locked_bytes"] == locked
        # a short piece goes through a bounce buffer: the pool is locked, once
        eng.write([fd], [path], [0, 0], [2 * A, 3 * A], [memoryview(src)[:A], memoryview(src)[:100]])
        assert _native.stats()["locked_bytes"] == locked + 4 * 2 * A
    finally:
        os.close(fd)
    fd = eng.open(path, "r")
    try:
        eng.read([fd], [path], [0], [0], [memoryview(src)[:100]])
        assert _native.stats()["locked_bytes"] == locked + 4 * 2 * A
    finally:
        os.close(fd)
    src.close()
    locked = _native.stats()["locked_bytes"]
    other = _native.Engine("threads", queue_depth=1, block_size=A, alignment=A)
    other.settle_pool()  # now, before any call: a thread can fault it in ahead of the I/O
    assert _native.stats()["locked_bytes"] == locked + 2 * A
    other.close()  # its settled pool is kept (locked) for the next engine of its shape
    assert _native.kept_pools() == (1, 2 * A) and _native.stats()["locked_bytes"] == locked + 2 * A
    with pytest.raises(ValueError, match="closed"):
        other.settle_pool()
    eng.close()
    eng.close()  # idempotent
    assert _native.kept_pools() == (2, 2 * A + 4 * 2 * A)
    _native.release_kept_pools()
    assert _native.stats() == base
    with pytest.raises(ValueError, match="closed"):
        eng.write([], [], [], [], [])


def test_closed_engines_bounce_buffers_are_kept_for_the_next(tmp_path):
    """A closed (or dropped) engine's settled bounce buffers are kept, locked,
    for the next engine of the same shape, which starts settled, writes
    through them and round-trips; never two engines at once, never past the
    limit, never after a failed call; release_kept_pools() frees them."""
    _native.release_kept_pools()
    base = _native.stats()
    shape = dict(queue_depth=1, block_size=A, alignment=A)  # a pool of 2 * A
    first = _native.Engine("threads", **shape)
    assert not first.pool_settled
    first.settle_pool()
    first.close()
    assert _native.kept_pools() == (1, 2 * A)
    a, b = _native.Engine("threads", **shape), _native.Engine("threads", **shape)
    assert a.pool_settled and not b.pool_settled and _native.kept_pools() == (0, 0)  # one engine takes it
    other = _native.Engine("threads", queue_depth=2, block_size=A, alignment=A)
    assert not other.pool_settled  # another shape
    other.close()
    path = str(tmp_path / "f")
    data = bytes(range(256)) * 40
    fd = a.open(path, "w")
    try:
        a.write([fd], [path], [0, 0], [0, A], [data[:100], data[100:]])
    finally:
        os.close(fd)
    back = bytearray(len(data) - 100 + A)
    fd = a.open(path, "r")
    try:
        a.read([fd], [path], [0, 0], [0, A], [memoryview(back)[:100], memoryview(back)[A:]])
    finally:
        os.close(fd)
    assert bytes(back[:100]) + bytes(back[A:]) == data
    del a  # dropped without close: kept too
    b.close()  # never settled: freed
    assert _native.kept_pools() == (1, 2 * A)
    default = _native.set_keep_limit(3 * A)  # room for one pool of 2 * A only
    try:
        c, d = _native.Engine("threads", **shape), _native.Engine("threads", **shape)
        assert c.pool_settled and not d.pool_settled
        d.settle_pool()
        c.close()
        d.close()
        assert _native.kept_pools() == (1, 2 * A)
        _native.set_keep_limit(0)  # frees what is kept, keeps nothing more
        assert _native.kept_pools() == (0, 0)
        e = _native.Engine("threads", **shape)
        e.settle_pool()
        e.close()
        assert _native.kept_pools() == (0, 0)
    finally:
        assert _native.set_keep_limit(default) == 0
    failed = _native.Engine("threads", **shape)
    failed.settle_pool()
    fd = os.open(str(tmp_path / "f"), os.O_RDONLY)
    try:
        with pytest.raises(OSError):
            failed.write([fd], [path], [0], [0], [data[:100]])  # a read-only fd
    finally:
        os.close(fd)
    failed.close()
    assert _native.kept_pools() == (0, 0)
    assert _native.stats() == base


def test_the_kept_bounce_buffers_limit_comes_from_the_environment(monkeypatch):
    from fp_dcp.engine import EngineSet

    default = _native.set_keep_limit(_native.DEFAULT_KEEP_POOL_BYTES)
    try:
        monkeypatch.setenv("FP_DCP_KEEP_BOUNCE_BUFFERS", "64MiB")
        EngineSet()
        assert _native.set_keep_limit(default) == 64 << 20
        monkeypatch.setenv("FP_DCP_KEEP_BOUNCE_BUFFERS", "99999999999TiB")  # past the address space: no limit
        EngineSet()
        assert _native.set_keep_limit(default) == sys.maxsize
        monkeypatch.setenv("FP_DCP_KEEP_BOUNCE_BUFFERS", "a lot")
        with pytest.raises(ValueError, match="FP_DCP_KEEP_BOUNCE_BUFFERS='a lot'.*0 keeps none"):
            EngineSet()
        monkeypatch.delenv("FP_DCP_KEEP_BOUNCE_BUFFERS")
        EngineSet()
        assert _native.set_keep_limit(default) == _native.DEFAULT_KEEP_POOL_BYTES
    finally:
        _native.set_keep_limit(default)


def test_settle_pool_on_a_thread_runs_beside_aligned_calls(tmp_path):
    """settle_pool() on another thread does not make the engine busy: a
    call that moves aligned memory only goes on meanwhile, one that needs a
    bounce buffer takes each as soon as it is faulted in, close() waits for
    the settle; bytes round-trip."""
    block = 4 << 20
    _native.release_kept_pools()  # (a kept pool of this shape would come settled)
    locked = _native.stats()["locked_bytes"]
    eng = _native.Engine("threads", queue_depth=15, block_size=block, alignment=A)  # a 64 MiB pool
    src = _native.AlignedBuffer(2 * block)
    np.frombuffer(src, dtype=np.uint8)[:] = np.random.default_rng(3).integers(0, 256, 2 * block, dtype=np.uint8)
    path = str(tmp_path / "f")
    fd = eng.open(path, "w")
    started = threading.Event()
    errors: list[BaseException] = []

    def settle() -> None:
        started.set()
        try:
            eng.settle_pool()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=settle)
    try:
        t.start()
        started.wait()
        time.sleep(0.002)  # (its first touches of 64 MiB take longer than this)
        assert not eng.busy
        mv = memoryview(src)
        assert eng.writes_in_place(mv) and eng.writes_in_place(mv[:block], block)
        assert not any([eng.writes_in_place(mv[:100]), eng.writes_in_place(mv[512:512 + block]),
                        eng.writes_in_place(mv[:block + 512]), eng.writes_in_place(mv, 512),
                        eng.writes_in_place(mv[:0])])  # short, memory, length, offset, empty
        eng.write([fd], [path], [0], [0], [mv], sync=False)  # in place: no wait, no refusal
        mv.release()
        eng.write([fd], [path], [0], [2 * block], [memoryview(src)[:100]], sync=True)  # a bounce buffer
    finally:
        t.join()
        os.close(fd)
    assert errors == [] and eng.pool_settled
    with open(path, "rb") as f:
        data = f.read()
    assert data[: 2 * block] == bytes(src) and data[2 * block: 2 * block + 100] == bytes(src)[:100]
    src.close()
    eng.close()
    for delay in (0.0, 0.002):  # close while a settle may be starting or running: it waits, or refuses it
        _native.release_kept_pools()
        eng = _native.Engine("threads", queue_depth=15, block_size=block, alignment=A)
        assert not eng.pool_settled
        started.clear()
        t = threading.Thread(target=settle)
        t.start()
        started.wait()
        time.sleep(delay)
        eng.close()
        t.join()
        assert eng.closed and all(isinstance(e, ValueError) and "closed" in str(e) for e in errors)
    _native.release_kept_pools()
    assert _native.stats()["locked_bytes"] == locked


@pytest.mark.parametrize("kind", ["aio", "threads"])
def test_calls_through_bounce_buffers_run_while_the_pool_settles(tmp_path, kind):
    """Writes and reads of unaligned memory (every byte through the bounce
    buffers, more of them than the pool holds) on a fresh pool whose slots
    another thread is still faulting in: each slot is used only once it is
    in, and every byte round-trips, whichever finishes first."""
    if kind not in _native.available_engines():
        pytest.skip(f"{kind} engine unavailable")
    block, qd = 1 << 20, 32
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 40 * block + 1, dtype=np.uint8)  # 40 slots' worth, one byte off
    for round_ in range(3):
        _native.release_kept_pools()  # a fresh pool each round
        eng = _native.Engine(kind, queue_depth=qd, block_size=block, alignment=A)
        assert not eng.pool_settled
        path = str(tmp_path / f"f{round_}")
        fd = eng.open(path, "w")
        t = threading.Thread(target=eng.settle_pool)
        try:
            t.start()
            src = memoryview(data)[1:]  # not page-aligned: through the bounce buffers
            eng.write([fd], [path], [0], [0], [src], sync=True)
        finally:
            t.join()
            os.close(fd)
        back = np.zeros(40 * block + 1, dtype=np.uint8)
        _native.release_kept_pools()
        eng.close()
        eng = _native.Engine(kind, queue_depth=qd, block_size=block, alignment=A)
        fd = eng.open(path, "r")
        t = threading.Thread(target=eng.settle_pool)
        try:
            t.start()
            eng.read([fd], [path], [0], [0], [memoryview(back)[1:]])
        finally:
            t.join()
            os.close(fd)
        assert eng.pool_settled
        eng.close()
        assert np.array_equal(back[1:], data[1:])
    _native.release_kept_pools()


def test_copy_gather_scatter():
    rng = np.random.default_rng(1)
    parts = [random_bytes(rng, n) for n in (0, 1, 100, 5000)]
    offs = np.array([0, 3, 10, 200], dtype=np.int64)
    big = bytearray(6000)
    _native.copy_gather(big, offs, tuple(parts))  # any sequence of buffers
    for p, o in zip(parts, offs):
        assert bytes(big[o:o + len(p)]) == p.tobytes()
    back = [bytearray(len(p)) for p in parts]
    _native.copy_scatter(big, list(offs), back)
    assert [bytes(b) for b in back] == [p.tobytes() for p in parts]
    with pytest.raises(ValueError, match="piece 3"):
        _native.copy_gather(big, [0, 0, 0, 1001], parts)
    with pytest.raises(ValueError, match="piece 0"):
        _native.copy_scatter(big, [-1], [bytearray(1)])
    with pytest.raises(ValueError):
        _native.copy_gather(big, [0], parts)  # lengths differ
    with pytest.raises(BufferError):
        _native.copy_gather(b"read-only", [0], [b"x"])


_PULL_CHILD = """
import sys, numpy as np
src = (np.arange(1 << 20, dtype=np.uint32) * 2654435761).astype(np.uint32)
print(src.ctypes.data, flush=True)
sys.stdin.readline()
"""


def test_pull_from_another_process():
    """Runs of another process's memory land back to back, also past the
    1,024 iovecs of one process_vm_readv; bad addresses, bad arguments and a
    process that is gone are errors."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", _PULL_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        addr = int(child.stdout.readline())
        want = (np.arange(1 << 20, dtype=np.uint32) * 2654435761).astype(np.uint32).view(np.uint8)
        starts = np.arange(0, want.nbytes - 64, 1500, dtype=np.int64)[::-1].copy()  # 2,796 runs, any order
        got = np.zeros(len(starts) * 37, dtype=np.uint8)
        _native.pull(child.pid, got, addr, starts, 37)
        expect = np.concatenate([want[s : s + 37] for s in starts])
        assert np.array_equal(got, expect)
        _native.pull(child.pid, got, addr, np.zeros(0, np.int64), 37)  # nothing to do
        with pytest.raises(OSError) as e:  # the last run is past the mapping
            _native.pull(child.pid, got[:74], addr, [0, 1 << 40], 37)
        assert e.value.errno == errno.EFAULT and str(child.pid) in str(e.value)
        with pytest.raises(ValueError, match="do not fit"):
            _native.pull(child.pid, got[:10], addr, [0], 37)
        with pytest.raises(BufferError):
            _native.pull(child.pid, b"read-only", addr, [0], 1)
    finally:
        child.communicate("\n")
    with pytest.raises(OSError) as e:
        _native.pull(child.pid, got, addr, [0], 1)
    assert e.value.errno == errno.ESRCH


def test_aio_engine_close_releases_its_context():
    """Closing a kernel-AIO engine does not wait for io_destroy (an RCU grace
    period), but the context is still destroyed: the system's count of AIO
    events comes back down."""
    if "aio" not in _native.available_engines():
        pytest.skip("kernel AIO is not available here")

    def aio_nr():
        with open("/proc/sys/fs/aio-nr") as f:
            return int(f.read())

    before = aio_nr()
    for _ in range(4):
        _native.Engine("aio", queue_depth=8, block_size=2 * A, alignment=A).close()
    deadline = time.monotonic() + 20
    while aio_nr() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert aio_nr() <= before


# ------------------------------------------------------------------ AlignedBuffer

@pytest.mark.parametrize("alignment", [4096, 65536])
def test_aligned_buffer(alignment):
    base = _native.stats()
    buf = _native.AlignedBuffer(3 * alignment + 5, alignment)
    assert buf.address % alignment == 0
    assert buf.size == len(buf) == 3 * alignment + 5
    assert buf.alignment == alignment
    assert buf.locked  # root may lock; CI runs as root
    assert _native.stats()["buffers"] == base["buffers"] + 1
    assert _native.stats()["locked_bytes"] == base["locked_bytes"] + buf.size
    arr = np.frombuffer(buf, dtype=np.uint8)
    assert arr.ctypes.data == buf.address  # zero copy
    assert not arr.any()  # prefaulted with zeros
    arr[:4] = [1, 2, 3, 4]
    mv = memoryview(buf)
    assert (mv.format, mv.itemsize, mv.ndim, mv.readonly) == ("B", 1, 1, False)
    assert bytes(mv[:4]) == b"\x01\x02\x03\x04"
    with pytest.raises(BufferError):
        buf.close()
    del arr
    mv.release()
    buf.close()
    buf.close()
    assert buf.closed
    with pytest.raises(ValueError):
        buf.address
    with pytest.raises(ValueError):
        memoryview(buf)
    assert _native.stats() == base


def test_aligned_buffer_arguments():
    with pytest.raises(ValueError):
        _native.AlignedBuffer(10, 3000)
    with pytest.raises(ValueError):
        _native.AlignedBuffer(-1)
    b = _native.AlignedBuffer(0)
    assert len(memoryview(b)) == 0
    b = _native.AlignedBuffer(A, lock=False, prefault=False)
    assert not b.locked


# ------------------------------------------------------------------ round trips

def piece_layouts():
    """Per file, a list of (gap, length, kind): kind 0 = packed from an unaligned
    address, 1 = aligned address (any length), 2 = aligned offset and address
    and at least a block long (the zero-copy path)."""
    piece = st.one_of(
        st.tuples(st.integers(0, 3 * B), st.integers(0, 3 * B + 100), st.just(0)),
        st.tuples(st.integers(0, 2 * B), st.integers(1, B + 10), st.just(1)),
        st.tuples(st.integers(0, 2 * B), st.integers(B, 3 * B + 5000), st.just(2)),
    )
    return st.lists(st.lists(piece, max_size=8), min_size=1, max_size=3)


def build(rng, files):
    """Sources, the (file, offset) layout and each file's expected bytes."""
    layout, sources, expected = [], [], []
    for f, pieces in enumerate(files):
        cursor, chunks = 0, []
        for gap, length, kind in pieces:
            off = cursor + gap
            data = random_bytes(rng, length)
            if kind == 0:
                holder = np.empty(length + 1, np.uint8)[1:]  # odd address
                holder[:] = data
                src = holder
                assert length == 0 or src.ctypes.data % A
            else:
                if kind == 2:
                    off = align_up(off)
                ab = _native.AlignedBuffer(length, A)
                np.frombuffer(ab, np.uint8)[:] = data
                src = ab
            layout.append((f, off))
            sources.append(src)
            chunks.append((off, data))
            cursor = off + length
        end = max([o + len(d) for o, d in chunks if len(d)], default=0)
        content = bytearray(align_up(end))
        for o, d in chunks:
            content[o:o + len(d)] = d.tobytes()
        expected.append(bytes(content))
    return layout, sources, expected


@HYP
@given(files=piece_layouts(), seed=st.integers(0, 2**32 - 1))
def test_write_read_round_trip(kind, tmp_path, files, seed):
    rng = np.random.default_rng(seed)
    layout, sources, expected = build(rng, files)
    paths = [str(tmp_path / f"f{i}") for i in range(len(files))]
    with small_engine(kind) as eng:
        ws = write_files(eng, paths, layout, sources)
        for p, exp in zip(paths, expected):
            with open(p, "rb") as fh:
                got = fh.read()
            assert len(got) == len(exp)  # the aligned end of the last piece
            assert got == exp  # pieces in place, gaps and padding zero
        lengths = [len(memoryview(s).cast("B")) for s in sources]
        assert ws["bytes"] == sum(lengths)
        assert sum(lengths) <= ws["bytes_on_disk"] <= sum(len(e) for e in expected)
        assert ws["bytes_on_disk"] % A == 0
        # every request a whole window or whole blocks in place, but where a gap or the end cuts it
        assert (ws["requests"], ws["zero_copy_bytes"]) == engine_requests(layout, sources)

        dests = [bytearray(n) for n in lengths]
        rs = read_files(eng, paths, layout, dests)
        for d, s in zip(dests, sources):
            assert bytes(d) == bytes(memoryview(s).cast("B"))
        assert rs["bytes"] == sum(lengths)
        # read back into memory aligned as the sources were: whole blocks in place, the windows coalesced
        aligned = [_native.AlignedBuffer(n, A) if isinstance(s, _native.AlignedBuffer) else np.empty(n + 1, np.uint8)[1:]
                   for s, n in zip(sources, lengths)]
        rs = read_files(eng, paths, layout, aligned, coalesce_gap=2 * A)
        for d, s in zip(aligned, sources):
            assert bytes(memoryview(d).cast("B")) == bytes(memoryview(s).cast("B"))
        assert (rs["requests"], rs["direct_bytes"]) == engine_requests(layout, aligned, read=True, gap=2 * A)
        assert _native.stats()["inflight"] == 0


def test_on_start_runs_once_before_the_first_request_and_a_raise_writes_nothing(kind, tmp_path):
    """Engine.write(on_start=...) calls it once, with the arguments taken and
    no request out yet (the file is still empty); what it raises fails the
    write before any byte is written, and the engine goes on working."""
    rng = np.random.default_rng(4)
    data = [random_bytes(rng, n) for n in (3 * B + 5, 700, B)]
    layout = [(0, 0), (0, 4 * B), (0, 5 * B)]
    path = str(tmp_path / "f")
    sizes: list[int] = []
    with small_engine(kind) as eng:
        ws = write_files(eng, [path], layout, data, on_start=lambda: sizes.append(os.path.getsize(path)))
        assert sizes == [0] and ws["bytes"] == sum(len(d) for d in data)

        def refuse():
            raise KeyError("refused")

        with pytest.raises(KeyError, match="refused"):
            write_files(eng, [str(tmp_path / "g")], layout, data, on_start=refuse)
        assert os.path.getsize(tmp_path / "g") == 0 and _native.stats()["inflight"] == 0
        write_files(eng, [str(tmp_path / "h")], layout, data)
    with open(path, "rb") as a, open(tmp_path / "h", "rb") as b:
        assert a.read() == b.read()


@HYP
@given(sizes=st.lists(st.integers(1, 12 * B + 777), min_size=1, max_size=3),
       ranges=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 4 * B + 9),
                                 st.booleans(), st.integers(0, 2**31)), max_size=25),
       gap=st.sampled_from([0, 100, 64 * 1024]),
       seed=st.integers(0, 2**32 - 1))
def test_read_overlapping_ranges(kind, tmp_path, sizes, ranges, gap, seed):
    """Arbitrary (overlapping, unaligned) ranges of files whose size is not
    aligned read back the file's bytes, into aligned and unaligned memory."""
    rng = np.random.default_rng(seed)
    paths, contents = [], []
    for i, size in enumerate(sizes):
        data = random_bytes(rng, size).tobytes()
        p = tmp_path / f"r{i}"
        p.write_bytes(data)
        paths.append(str(p))
        contents.append(data)
    wanted = []
    for start, length, aligned, f in ranges:
        f %= len(sizes)
        start %= sizes[f]
        if aligned:
            start -= start % A
        length = min(length, sizes[f] - start)
        wanted.append((f, start, length, aligned))
    wanted.sort(key=lambda w: (w[0], w[1]))
    dests, holders = [], []
    for f, start, length, aligned in wanted:
        if aligned:
            ab = _native.AlignedBuffer(length, A)
            holders.append(ab)
            dests.append(memoryview(ab))
        else:
            dests.append(np.empty(length + 1, np.uint8)[1:])
    with small_engine(kind) as eng:
        st_ = read_files(eng, paths, [(f, s) for f, s, _, _ in wanted], dests, coalesce_gap=gap)
    for (f, start, length, _), d in zip(wanted, dests):
        assert bytes(d) == contents[f][start:start + length]
    assert st_["bytes"] == sum(w[2] for w in wanted)
    for d in dests:
        if isinstance(d, memoryview):
            d.release()


def test_memory_alignment_below_the_offsets(kind, tmp_path):
    """An engine whose memory alignment is what the file system asks of
    O_DIRECT memory (statx) moves a piece at an offset aligned to the
    engine's alignment straight from and to memory that is aligned only to
    that (not to a page): the same bytes on disk, the same checksums and the
    same bytes read back as through the bounce buffers, which an engine with
    the default (memory aligned as the offsets) takes for the same memory."""
    mem = _native.probe_alignment(str(tmp_path))[0]
    if mem >= A:
        pytest.skip(f"this file system asks O_DIRECT memory to be aligned to {mem}: no address below a page")
    rng = np.random.default_rng(11)
    lengths = [3 * B + 100, B, 2 * B + A]
    offsets = [0, 4 * B, 6 * B]
    holders = [_native.AlignedBuffer(n + A, A) for n in lengths]
    sources = [np.frombuffer(h, np.uint8)[mem:mem + n] for h, n in zip(holders, lengths)]
    for s in sources:
        s[:] = random_bytes(rng, len(s))
    assert all(s.ctypes.data % A == mem for s in sources)
    layout = [(0, o) for o in offsets]
    got = {}
    for name, m in (("in place", mem), ("bounced", None)):
        path = str(tmp_path / name)
        with small_engine(kind, memory_alignment=m) as eng:
            assert eng.memory_alignment == (A if m is None else mem)
            # (a write moves whole blocks in place; the last piece's last page goes through a window)
            assert [eng.writes_in_place(s, o) for s, o in zip(sources, offsets)] == [False, m is not None, False]
            ws = write_files(eng, [path], layout, sources, checksums=B)
            assert ws["zero_copy_bytes"] == (6 * B if m is not None else 0)
            holders += [_native.AlignedBuffer(n + A, A) for n in lengths]
            dests = [np.frombuffer(h, np.uint8)[mem:mem + n] for h, n in zip(holders[-len(lengths):], lengths)]
            rs = read_files(eng, [path], layout, dests, checksums=B)
            assert rs["direct_bytes"] == (sum(n - n % A for n in lengths) if m is not None else 0)
        assert all(np.array_equal(d, s) for d, s in zip(dests, sources))
        assert rs["crc32c"].tolist() == ws["crc32c"].tolist()
        got[name] = (open(path, "rb").read(), ws["crc32c"].tolist())
    assert got["in place"] == got["bounced"]
    del sources, dests, s
    for holder in holders:
        holder.close()


@pytest.mark.parametrize("bad", [0, 3, 2 * A, -A])
def test_memory_alignment_is_checked(bad):
    with pytest.raises(ValueError, match="memory_alignment must be a power of two"):
        _native.Engine(alignment=A, memory_alignment=bad)


@pytest.mark.parametrize("direct", [None, False])
def test_default_sizes_many_pieces(kind, tmp_path, direct):
    """The default engine geometry, thousands of small packed tensors around
    large aligned ones, direct and buffered fds."""
    rng = np.random.default_rng(7)
    layout, sources, expected = build(rng, [
        [(0, 9 << 20, 2)] + [(int(g), int(n), 0) for g, n in
                             zip(rng.integers(0, 64, 3000), rng.integers(1, 3000, 3000))]
        + [(5, (5 << 20) + 3, 2), (0, 10, 0)],
        [(100, 12345, 0)],
    ])
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    with _native.Engine(kind) as eng:
        ws = write_files(eng, paths, layout, sources, direct=direct)
        for p, exp in zip(paths, expected):
            assert open(p, "rb").read() == exp
        assert eng.block_size <= 5 << 20
        assert (ws["requests"], ws["zero_copy_bytes"]) == engine_requests(layout, sources, eng.block_size)
        assert ws["zero_copy_bytes"] >= (9 << 20) + (5 << 20) - 2 * eng.block_size
        dests = [np.empty(len(memoryview(s).cast("B")) + 1, np.uint8)[1:] for s in sources]
        read_files(eng, paths, layout, dests, direct=direct)
        for d, s in zip(dests, sources):
            assert bytes(d) == bytes(memoryview(s).cast("B"))


def test_short_transfers_are_continued(kind, tmp_path):
    rng = np.random.default_rng(3)
    layout, sources, expected = build(rng, [[(0, 10 * B + 3, 2), (17, 5 * B, 0)]])
    path = str(tmp_path / "s")
    with small_engine(kind) as eng:
        hooks.set_fault("short", after=7)
        ws = write_files(eng, [path], layout, sources)
        assert open(path, "rb").read() == expected[0]
        assert ws["requests"] > 10 + 6  # the halves were resubmitted
        hooks.set_fault("short", after=7)
        dests = [bytearray(len(memoryview(s).cast("B"))) for s in sources]
        rs = read_files(eng, [path], layout, dests)
        assert [bytes(d) for d in dests] == [bytes(memoryview(s).cast("B")) for s in sources]
        assert rs["bytes_read"] > rs["bytes"]


# ------------------------------------------------------------------ errors

def test_truncated_file(kind, tmp_path):
    path = tmp_path / "t"
    path.write_bytes(os.urandom(10000))
    with small_engine(kind) as eng:
        for off, n in ((9000, 3000), (20000, 10), (0, 10001)):
            dest = bytearray(n)
            with pytest.raises(OSError) as ei:
                read_files(eng, [str(path)], [(0, off)], [dest])
            assert ei.value.errno == errno.EIO
            assert ei.value.filename == str(path)
            assert "unexpected end of file" in str(ei.value)
            assert f"needed up to {off + n}" in str(ei.value)
            assert _native.stats()["inflight"] == 0
        dest = bytearray(1000)
        read_files(eng, [str(path)], [(0, 9000)], [dest])  # the engine still works
        assert bytes(dest) == path.read_bytes()[9000:]


def test_open_errors(kind, tmp_path):
    with small_engine(kind) as eng:
        missing = str(tmp_path / "no" / "such")
        for mode in ("w", "r"):
            with pytest.raises(FileNotFoundError) as ei:
                eng.open(missing, mode)
            assert ei.value.filename == missing
        with pytest.raises(IsADirectoryError) as ei:
            eng.open(str(tmp_path), "w")
        assert ei.value.filename == str(tmp_path)
        with pytest.raises(ValueError, match="mode"):
            eng.open(str(tmp_path / "x"), "a")


def test_io_errors_name_the_path(kind, tmp_path):
    good, ro = str(tmp_path / "good"), str(tmp_path / "ro")
    open(ro, "wb").close()
    data = np.ones(3 * B + 5, np.uint8)
    with small_engine(kind) as eng:
        # writing through an fd opened for reading
        fds = [eng.open(good, "w"), eng.open(ro, "r")]
        try:
            with pytest.raises(OSError) as ei:
                eng.write(fds, [good, ro], [0, 1], [0, 0], [data, data])
        finally:
            for fd in fds:
                os.close(fd)
        assert ei.value.errno == errno.EBADF
        assert ei.value.filename == ro
        assert _native.stats()["inflight"] == 0
        # a closed fd
        fd = eng.open(good, "w")
        os.close(fd)
        with pytest.raises(OSError) as ei:
            eng.write([fd], [good], [0], [0], [data])
        assert ei.value.errno == errno.EBADF and ei.value.filename == good
        with pytest.raises(OSError) as ei:
            eng.read([fd], [good], [0], [0], [bytearray(10)])
        assert ei.value.errno == errno.EBADF and ei.value.filename == good
        # a directory (or a FIFO, a device) is refused when opened, naming it
        with pytest.raises(OSError, match="not a regular file") as ei:
            eng.open(str(tmp_path), "r")
        assert ei.value.errno == errno.EINVAL and ei.value.filename == str(tmp_path)
        assert _native.stats()["inflight"] == 0


@pytest.mark.parametrize("op", ["write", "read"])
def test_injected_failure_mid_stream(kind, tmp_path, op):
    """An error in the middle of a deep queue: everything in flight is waited
    for, the error names the file it hit, and the engine stays usable."""
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    data = np.arange(20 * B, dtype=np.uint8)[1:]  # unaligned: every block via a bounce buffer
    layout = [(0, 0), (1, 0)]
    with small_engine(kind) as eng:
        write_files(eng, paths, layout, [data, data])
        hooks.set_fault("io", errno.ENOSPC if op == "write" else errno.EIO, after=25)
        with pytest.raises(OSError) as ei:
            if op == "write":
                write_files(eng, paths, layout, [data, data])
            else:
                read_files(eng, paths, layout, [bytearray(len(data))] * 2)
        assert ei.value.errno == (errno.ENOSPC if op == "write" else errno.EIO)
        assert ei.value.filename == paths[1]  # the 26th request is in the second file
        assert _native.stats()["inflight"] == 0
        out = bytearray(len(data))
        write_files(eng, paths, layout, [data, data])
        read_files(eng, paths, [(1, 0)], [out])
        assert bytes(out) == data.tobytes()


def test_validation(kind, tmp_path):
    p = str(tmp_path / "v")
    with small_engine(kind) as eng:
        fd = eng.open(p, "w")
        try:
            cases = [
                ([0, 0], [100, 0], "piece 1: pieces must be sorted"),
                ([1, 0], [0, 0], "piece 1: pieces must be sorted"),
                ([0, 0], [0, 5], "piece 1: .* overlaps"),
                ([0, 2], [0, 100], "piece 1: file_index 2 is not in \\[0, 2\\)"),
                ([0, 0], [-4, 100], "piece 0: file_offset -4"),
            ]
            for fi, fo, msg in cases:
                with pytest.raises(ValueError, match=msg):
                    eng.write([fd, fd], [p, p], fi, fo, [b"0123456789", b"abc"])
            with pytest.raises(ValueError, match="1 fds but 2 paths"):
                eng.write([fd], [p, p], [0], [0], [b"x"])
            with pytest.raises(ValueError, match="2 buffers but 1"):
                eng.write([fd], [p], [0], [0, 1], [b"x", b"y"])
            with pytest.raises(TypeError, match="sources\\[1\\]"):
                eng.write([fd], [p], [0, 0], [0, 1], [b"x", 3])
            with pytest.raises(BufferError, match="dests\\[0\\]"):
                eng.read([fd], [p], [0], [0], [b"read-only"])
            # reads may overlap; zero-length pieces anywhere are fine
            eng.write([fd], [p], np.array([0, 0, 0], np.int32), np.array([0, 5, 5]),
                      [b"01234", b"", b"56789"])
        finally:
            os.close(fd)
        assert open(p, "rb").read() == b"0123456789".ljust(A, b"\0")


def test_tmpfs_and_buffered_fallback(kind):
    """/dev/shm (tmpfs): the fd falls back to buffered when O_DIRECT is refused
    (forced here: kernels since 6.6 accept O_DIRECT on tmpfs), and the
    pipeline still writes and reads the right bytes."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/fp_dcp_test_{os.getpid()}_{kind}"
    rng = np.random.default_rng(5)
    layout, sources, expected = build(rng, [[(0, 3 * B + 7, 2), (3, 100, 0), (B, 2 * B, 0)]])
    try:
        with small_engine(kind) as eng:
            hooks.set_fault("open_direct", errno.EINVAL)
            fd = eng.open(path, "w")
            assert not eng.is_direct(fd)
            os.close(fd)
            with pytest.raises(OSError) as ei:
                eng.open(path, "w", direct=True)
            assert ei.value.errno == errno.EINVAL and ei.value.filename == path
            write_files(eng, [path], layout, sources)
            assert open(path, "rb").read() == expected[0]
            dests = [bytearray(len(memoryview(s).cast("B"))) for s in sources]
            read_files(eng, [path], layout, dests)
            assert [bytes(d) for d in dests] == [bytes(memoryview(s).cast("B")) for s in sources]
            hooks.set_fault("")
            fd = eng.open(path, "r", direct=False)
            assert not eng.is_direct(fd)
            os.close(fd)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_direct_fd_on_ext4(kind, tmp_path):
    with small_engine(kind) as eng:
        fd = eng.open(str(tmp_path / "d"), "w")
        try:
            assert eng.is_direct(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------ the GIL

@pytest.fixture(scope="module")
def big_source():
    return np.ones((256 << 20) + 1, np.uint8)[1:]  # 256 MiB at an unaligned address


def test_gil_released(kind, tmp_path, big_source):
    """A call releases the GIL: while two threads write 256 MiB each on their
    own engines, a pure-Python thread runs and sees both calls in progress at
    once.  (No timing window: with the GIL held through a call, at most one
    call is ever in progress and the watcher never runs during one, so the
    test fails; with it released the watcher sees the overlap within a few
    calls, which are repeated until it does.)"""
    engines = [_native.Engine(kind, queue_depth=8, block_size=1 << 20) for _ in range(2)]
    paths = [str(tmp_path / f"g{i}") for i in range(2)]
    seen, done, calls = threading.Event(), [False, False], [0, 0]
    errors = []

    def work(i):
        try:
            for _ in range(20):
                write_files(engines[i], [paths[i]], [(0, 0)], [big_source], sync=False)
                calls[i] += 1
                if seen.is_set():
                    break
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            done[i] = True

    def watch():
        while not seen.is_set() and not all(done):
            if engines[0].busy and engines[1].busy:
                seen.set()
            time.sleep(0)  # a pure-Python loop: it runs only while no call holds the GIL

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)] + [threading.Thread(target=watch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert seen.is_set(), f"no Python thread ran while both engines were in a call ({calls} calls each)"
    finally:
        for e in engines:
            e.close()
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


def test_one_engine_one_thread(kind, tmp_path, big_source):
    """A second call on an engine that is busy in another thread is refused,
    and the running call is not disturbed by the refusal."""
    eng = _native.Engine(kind, queue_depth=8, block_size=1 << 20)
    path, small = str(tmp_path / "busy"), str(tmp_path / "small")
    started, result = threading.Event(), []

    def work():
        started.set()
        result.append(write_files(eng, [path], [(0, 0)], [big_source], sync=False))

    try:
        t = threading.Thread(target=work)
        t.start()
        started.wait()
        while not eng.busy and t.is_alive():  # the worker's call has begun (no timing window assumed)
            time.sleep(0.001)
        refused = False
        try:
            write_files(eng, [small], [(0, 0)], [b"x"])
        except RuntimeError as e:
            assert "another thread" in str(e)
            refused = True
        still_running = t.is_alive() and not result
        t.join()
        assert result and result[0]["bytes"] == len(big_source)
        # the second call ran only if the first had ended: never two at once
        assert refused or not still_running
        if not refused:
            pytest.skip("the big write ended before the second call (a faster disk): nothing to refuse")
        write_files(eng, [small], [(0, 0)], [b"x"])  # free again
    finally:
        eng.close()


# ------------------------------------------------------------------ checksums

def crc32c_ref(data, crc=0):
    """Bit-at-a-time CRC-32C, the definition."""
    crc ^= 0xFFFFFFFF
    for b in bytes(data):
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


@pytest.fixture(params=["hw", "sw"])
def crc_impl(request):
    before = hooks.crc32c_impl()
    got = hooks.crc32c_impl(request.param)
    if got != request.param:
        hooks.crc32c_impl(before)
        pytest.skip(f"no {request.param} CRC-32C on this CPU")
    yield got
    hooks.crc32c_impl(before)


def test_crc32c_known_values(crc_impl):
    # RFC 3720 (iSCSI) B.4 and the usual check value
    assert _native.crc32c(b"123456789") == 0xE3069283
    assert _native.crc32c(bytes(32)) == 0x8A9136AA
    assert _native.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert _native.crc32c(bytes(range(32))) == 0x46DD794E
    assert _native.crc32c(b"") == 0


def test_crc32c_lengths_alignments_seeds_and_combine(crc_impl):
    """Every length around the interleaved strides (3 x 256, 3 x 8192), every
    start address mod 8: the same as the definition; seeds chain; combine
    joins; blocks cut."""
    rng = np.random.default_rng(9)
    data = random_bytes(rng, 3 * 8192 * 2 + 300).tobytes()
    for n in [0, 1, 7, 8, 9, 255, 256, 767, 768, 769, 800, 24575, 24576, 24577, 49200]:
        for off in range(8):
            chunk = data[off:off + n]
            got = _native.crc32c(memoryview(data)[off:off + n])
            if n < 2000 or off == 0:  # the definition is slow
                assert got == crc32c_ref(chunk), (n, off)
            a = n // 3
            assert _native.crc32c(chunk[a:], _native.crc32c(chunk[:a])) == got
            assert _native.crc32c_combine(_native.crc32c(chunk[:a]), _native.crc32c(chunk[a:]), n - a) == got
    assert _native.crc32c(data) == crc32c_ref(data)
    blocks = _native.crc32c_blocks(data, 1000)
    assert blocks.dtype == np.uint32 and len(blocks) == -(-len(data) // 1000)
    assert [int(c) for c in blocks] == [_native.crc32c(data[i:i + 1000]) for i in range(0, len(data), 1000)]
    assert list(_native.crc32c_blocks(b"", 10)) == [0]
    with pytest.raises(ValueError):
        _native.crc32c_blocks(data, 0)
    # many buffers in one call: each one's blocks, as crc32c_blocks gives them
    bufs = [data[:0], data[:1], data[5:1005], data[7:2007], memoryview(data)[3:3333], np.frombuffer(data, np.uint8)]
    crcs, first = _native.crc32c_many(bufs, 1000)
    assert crcs.dtype == np.uint32 and first.dtype == np.int64 and len(first) == len(bufs) + 1
    assert [crcs[first[i]:first[i + 1]].tolist() for i in range(len(bufs))] == [
        _native.crc32c_blocks(b, 1000).tolist() for b in bufs]
    none, at = _native.crc32c_many([], 1000)
    assert len(none) == 0 and at.tolist() == [0]
    with pytest.raises(ValueError):
        _native.crc32c_many(bufs, 0)
    with pytest.raises(TypeError, match=r"buffers\[1\]"):
        _native.crc32c_many([data, "not a buffer"], 1000)


def test_crc32c_implementations_agree():
    rng = np.random.default_rng(10)
    data = np.empty((5 << 20) + 8, np.uint8)[3:]  # odd start, over 3 x 8 KiB many times
    data[:] = random_bytes(rng, len(data))
    before = hooks.crc32c_impl()
    try:
        got = {impl: _native.crc32c(data) for impl in ("sw", "hw") if hooks.crc32c_impl(impl) == impl}
    finally:
        hooks.crc32c_impl(before)
    assert len(set(got.values())) == 1, got


def expected_crcs(sources, block, origins=None):
    """What Engine.write/read(checksums=block, checksum_origin=origins) report."""
    out = []
    for i, s in enumerate(sources):
        mv = memoryview(s).cast("B")
        n = len(mv)
        if block is True:
            out.append(_native.crc32c(mv))
            continue
        o = 0 if origins is None else origins[i]
        if n == 0:
            out.append(0)
            continue
        for g in range(o // block, (o + n - 1) // block + 1):
            out.append(_native.crc32c(mv[max(g * block - o, 0):min((g + 1) * block - o, n)]))
    return np.array(out, dtype=np.uint32)


@HYP
@given(files=piece_layouts(), seed=st.integers(0, 2**32 - 1),
       block=st.sampled_from([True, 1, 100, A, 3 * A + 5, B, 1 << 20]),
       with_origin=st.booleans(), short=st.integers(0, 3))
def test_pipeline_checksums(kind, tmp_path, files, seed, block, with_origin, short):
    """The CRCs a write computes on the fly (fused with the bounce copy, or on
    the source of zero-copy requests) and those a read computes on what
    landed (fused with the copy out, or after a zero-copy request) equal the
    CRCs of the sources, per piece or per block of a grid, through short
    transfers too."""
    rng = np.random.default_rng(seed)
    layout, sources, expected = build(rng, files)
    origins = None
    if with_origin and block is not True:
        origins = [int(x) for x in rng.integers(0, 3 * block + 7, len(sources))]
    want = expected_crcs(sources, block, origins)
    paths = [str(tmp_path / f"c{i}") for i in range(len(files))]
    with small_engine(kind) as eng:
        hooks.set_fault("short", after=short)
        ws = write_files(eng, paths, layout, sources, checksums=block, checksum_origin=origins)
        assert np.array_equal(ws["crc32c"], want)
        if block is not True:
            first = ws["crc32c_first"]
            assert first[0] == 0 and first[-1] == len(want) and len(first) == len(sources) + 1
        for p, exp in zip(paths, expected):
            assert open(p, "rb").read() == exp
        dests = []
        for s in sources:
            n = len(memoryview(s).cast("B"))
            dests.append(_native.AlignedBuffer(n, A) if rng.integers(0, 2) else np.empty(n + 1, np.uint8)[1:])
        hooks.set_fault("short", after=short)
        rs = read_files(eng, paths, layout, dests, checksums=block, checksum_origin=origins)
        hooks.set_fault("")
        assert np.array_equal(rs["crc32c"], want)
        for d, s in zip(dests, sources):
            assert bytes(memoryview(d)) == bytes(memoryview(s).cast("B"))


def test_checksums_default_engine_many_pieces(kind, tmp_path):
    """Default geometry (4 MiB requests, reads taken one completion at a
    time): thousands of pieces, zero-copy and packed, all checksummed."""
    rng = np.random.default_rng(11)
    layout, sources, _ = build(rng, [
        [(0, 9 << 20, 2)] + [(int(g), int(n), 0) for g, n in
                             zip(rng.integers(0, 64, 2000), rng.integers(1, 3000, 2000))]
        + [(5, (5 << 20) + 3, 2)],
    ])
    path = str(tmp_path / "m")
    with _native.Engine(kind) as eng:
        ws = write_files(eng, [path], layout, sources, checksums=1 << 20)
        assert np.array_equal(ws["crc32c"], expected_crcs(sources, 1 << 20))
        dests = [np.empty(len(memoryview(s).cast("B")), np.uint8) for s in sources]
        rs = read_files(eng, [path], layout, dests, checksums=True)
        assert np.array_equal(rs["crc32c"], expected_crcs(sources, True))
        assert "crc32c_first" not in rs
        assert "crc32c" not in read_files(eng, [path], layout, dests)  # off by default


def test_checksum_arguments(kind, tmp_path):
    p = str(tmp_path / "a")
    with small_engine(kind) as eng:
        for bad in (0, -4, "x", 1.5, 2**40):
            with pytest.raises(ValueError, match="checksums must be"):
                write_files(eng, [p], [(0, 0)], [b"abc"], checksums=bad)
        with pytest.raises(ValueError, match="checksum_origin needs"):
            write_files(eng, [p], [(0, 0)], [b"abc"], checksums=True, checksum_origin=[0])
        with pytest.raises(ValueError, match="1 buffers but 2 checksum_origin"):
            write_files(eng, [p], [(0, 0)], [b"abc"], checksums=8, checksum_origin=[0, 1])
        with pytest.raises(ValueError, match="negative"):
            write_files(eng, [p], [(0, 0)], [b"abc"], checksums=8, checksum_origin=[-1])
        ws = write_files(eng, [p], [(0, 0), (0, 10)], [b"", b"abc"], checksums=2)
        assert list(ws["crc32c"]) == [0, _native.crc32c(b"ab"), _native.crc32c(b"c")]
        assert list(ws["crc32c_first"]) == [0, 1, 3]


def test_failed_call_with_checksums_leaves_the_engine_usable(kind, tmp_path):
    data = np.arange(20 * B, dtype=np.uint8)[1:]
    path = str(tmp_path / "e")
    with small_engine(kind) as eng:
        write_files(eng, [path], [(0, 0)], [data])
        hooks.set_fault("io", errno.EIO, after=5)
        with pytest.raises(OSError) as ei:
            read_files(eng, [path], [(0, 0)], [_native.AlignedBuffer(len(data), A)], checksums=A)
        assert ei.value.errno == errno.EIO and ei.value.filename == path
        assert _native.stats()["inflight"] == 0
        out = np.empty(len(data), np.uint8)
        rs = read_files(eng, [path], [(0, 0)], [out], checksums=True)
        assert int(rs["crc32c"][0]) == _native.crc32c(data)


def test_kill_fault_kills_mid_pipeline(tmp_path):
    """_set_fault("kill", SIGKILL, after=n): the process dies in the middle of
    a write, with requests in flight (used by the crash-consistency tests)."""
    import signal
    import subprocess
    import sys

    path = str(tmp_path / "k")
    code = (
        "import numpy as np, os\n"
        "from fp_dcp import _native\n"
        "e = _native.Engine('auto', queue_depth=4, block_size=1 << 20)\n"
        f"fd = e.open({path!r}, 'w')\n"
        "_native.testing().set_fault('kill', 9, after=3)\n"
        "e.write([fd], ['k'], [0], [0], [np.ones(32 << 20, np.uint8)])\n"
        "print('survived')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout, p.stderr)
    assert "survived" not in p.stdout
    assert os.path.getsize(path) == 32 << 20  # presized, then killed part-way


@pytest.mark.parametrize("lens", [[], [0], [1], [5, (1 << 20) + 3, 3 << 20, 300 << 10, 7], [9 << 20]])
def test_copy_gather_checksums_in_the_same_pass(lens):
    """copy_gather(..., checksum_block) copies exactly as without it and returns
    crc32c_blocks of every source (fused copy; non-temporal stores past 256 KiB,
    here into unaligned destinations)."""
    rng = np.random.default_rng(len(lens))
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in lens]
    offs = np.asarray([1 + sum(m + 13 for m in lens[:i]) for i in range(len(lens))], dtype=np.int64)
    dst = np.zeros(1 + sum(m + 13 for m in lens), dtype=np.uint8)
    crcs, first = _native.copy_gather(dst, offs, srcs, checksum_block=1 << 20)
    assert first.tolist() == [0] + np.cumsum([max(1, -(-n // (1 << 20))) for n in lens]).tolist()
    expect = np.zeros_like(dst)
    for i, (o, src) in enumerate(zip(offs, srcs)):
        expect[o : o + len(src)] = src
        assert crcs[first[i] : first[i + 1]].tolist() == _native.crc32c_blocks(src, 1 << 20).tolist()
    assert np.array_equal(dst, expect)  # nothing outside the pieces touched
    assert _native.copy_gather(dst, offs, srcs) is None
    with pytest.raises(ValueError, match="checksum_block"):
        _native.copy_gather(dst, offs, srcs, checksum_block=-1)


def test_fused_copy_crc_streams_only_where_the_destination_is_not_just_ahead():
    """Streaming stores in the fused copy + CRC only from 256 KiB, with the
    destination 8-byte aligned relative to the source and at least 256 bytes
    past it modulo 4 KiB: a destination 64 bytes past a page (torch's large
    tensors) read from a page-aligned bounce buffer made every store flush a
    half-full write-combining buffer."""
    hw = hooks.crc32c_impl() == "hw"
    base = 1 << 30
    assert not hooks.crc_copy_streams(base + 64, base, 1 << 20)
    assert not hooks.crc_copy_streams(base + 4096 + 8, base, 1 << 20)
    assert not hooks.crc_copy_streams(base, base, 1 << 20)
    assert not hooks.crc_copy_streams(base + 2051, base, 1 << 20)  # unaligned stores
    assert not hooks.crc_copy_streams(base + 2048, base, 4096)      # small: plain stores
    assert hooks.crc_copy_streams(base + 2048, base, 1 << 20) == hw
    assert hooks.crc_copy_streams(base - 64, base, 1 << 20) == hw    # behind: 4032 mod 4096
    # both store kinds copy and checksum the same bytes
    rng = np.random.default_rng(5)
    src = _native.AlignedBuffer(3 << 20, 4096, lock=False)
    s = np.frombuffer(src, np.uint8)
    s[:] = rng.integers(0, 256, len(s), dtype=np.uint8)
    want = _native.crc32c_blocks(src, 1 << 20).tolist()
    for delta in (64, 2048):
        dst = _native.AlignedBuffer((3 << 20) + 4096, 4096, lock=False)
        d = np.frombuffer(dst, np.uint8)
        before = hooks.crc_nt_bytes()
        crcs, _ = _native.copy_gather(dst, [delta], [src], checksum_block=1 << 20)
        streamed = hooks.crc_nt_bytes() - before
        assert crcs.tolist() == want and np.array_equal(d[delta : delta + len(s)], s)
        assert streamed == (3 << 20 if hw and delta == 2048 else 0)
        del d
        dst.close()
    del s
    src.close()


@pytest.mark.parametrize("delta", [64, 0])
def test_verified_read_checksums_each_byte_once_without_streaming_hazard(kind, tmp_path, delta):
    """A verified read into a destination 64 bytes past a page (bounce path,
    the copy out fused with the CRC) or page-aligned (zero-copy, the CRC over
    the destination): every byte is checksummed exactly once (counted, not
    timed: ``checksum_bytes`` == the bytes delivered <= the bytes read), and
    the unaligned copy never takes the streaming stores that 4K-alias the
    bounce buffer."""
    n = 9 << 20
    rng = np.random.default_rng(delta)
    src = random_bytes(rng, n)
    path = str(tmp_path / "v")
    with _native.Engine(kind) as eng:
        write_files(eng, [path], [(0, 0)], [src])
        buf = _native.AlignedBuffer(n + 4096, 4096, lock=False)
        dest = np.frombuffer(buf, np.uint8)[delta : delta + n]
        before = hooks.crc_nt_bytes()
        rs = read_files(eng, [path], [(0, 0)], [dest], checksums=1 << 20)
        streamed = hooks.crc_nt_bytes() - before
        assert np.array_equal(dest, src)
        assert rs["crc32c"].tolist() == _native.crc32c_blocks(src, 1 << 20).tolist()
        assert rs["checksum_bytes"] == rs["bytes"] == n <= rs["bytes_read"]
        assert streamed == 0
        if delta == 0:
            assert rs["direct_bytes"] == n
        plain = read_files(eng, [path], [(0, 0)], [dest])
        assert plain["checksum_bytes"] == 0
        del dest
        buf.close()


def test_checksum_skip_feeds_only_wanted_pieces_to_the_crc(kind, tmp_path):
    """checksum_skip: a skipped piece is still read (bounce copy or zero-copy)
    but not checksummed: one entry 0, its bytes not counted in checksum_bytes."""
    rng = np.random.default_rng(21)
    sizes = [3 << 20, 5000, 1 << 20, 777]
    sources = [random_bytes(rng, n) for n in sizes]
    layout, off = [], 0
    for n in sizes:
        layout.append((0, off))
        off = align_up(off + n + 100, 4096)
    path = str(tmp_path / "s")
    skip = np.array([False, True, True, False])
    with _native.Engine(kind) as eng:
        write_files(eng, [path], layout, sources)
        dests = [np.zeros(n, np.uint8) for n in sizes]
        rs = read_files(eng, [path], layout, dests, checksums=1 << 20, checksum_skip=skip)
        first = rs["crc32c_first"]
        for i, (d, s) in enumerate(zip(dests, sources)):
            assert np.array_equal(d, s)
            got = rs["crc32c"][first[i] : first[i + 1]].tolist()
            assert got == ([0] if skip[i] else _native.crc32c_blocks(s, 1 << 20).tolist())
        assert rs["checksum_bytes"] == sizes[0] + sizes[3]
        with pytest.raises(ValueError, match="checksum_skip"):
            read_files(eng, [path], layout, dests, checksums=1 << 20, checksum_skip=skip[:2])
        with pytest.raises(ValueError, match="checksum_skip needs"):
            read_files(eng, [path], layout, dests, checksum_skip=skip)


def test_engine_set_keeps_one_engine_per_thread_and_replaces_them_together(tmp_path):
    """EngineSet: the primary session is kept while options and file system
    match; the sessions made from it (large, more, twins) are distinct
    engines and are closed with it when the options change; a directory's
    own session stays; a pickled set is empty."""
    import pickle

    from fp_dcp.engine import EngineSet
    from fp_dcp.options import FastPersistOptions

    opts = FastPersistOptions(queue_depth=4, block_size_bytes=1 << 20)
    other_dir = tmp_path / "d1"
    other_dir.mkdir()
    es = EngineSet()
    first = es.session(opts, str(tmp_path))
    assert es.session(opts, str(tmp_path)) is first
    large = es.large_session(above_bytes=0)
    assert large is not None and large.engine is not first.engine
    more = es.more_large(2)
    twin, twin_large = es.twin(0)
    engines = [s.engine for s in (first, large, *more, twin, twin_large)]
    assert len({id(e) for e in engines}) == len(engines)  # one engine per reading thread
    assert es.more_large(2) == more and es.twin(0) == (twin, twin_large)
    assert es.large_session(above_bytes=1 << 40) is large  # kept once made
    own = es.for_directory(opts, str(other_dir))
    assert pickle.loads(pickle.dumps(es)).primary is None

    second = es.session(opts.replace(queue_depth=8), str(tmp_path))
    assert second is not first and es.large is None and es.more == [] and es.twins == []
    assert all(s.engine is None for s in (first, large, *more, twin, twin_large))
    assert es.for_directory(opts, str(other_dir)) is own and own.engine is not None
    es.close()
    assert second.engine is None and own.engine is None and es.primary is None
